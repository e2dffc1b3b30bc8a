"""Train the capstone GPT with TP x PP x DP: one script for a laptop (gloo), a GPU node and a SLURM cluster (NCCL).

    torchrun --standalone --nproc-per-node 8 labs/capstone/train.py --tp 2 --pp 2 --dp 2 --steps 20
    python labs/capstone/train.py --steps 20                       # one rank, no launcher

Every rank builds the whole model from the seed; :func:`parallelize` then applies TP, PP and DP in turn, as
torchtitan does. A step draws the same global batch on every rank (from the seed and the step), keeps this
rank's DP share, runs the pipeline schedule inside the DP wrapper's ``no_sync``, averages the gradients over
DP (once, after the flush; with pp = 1 overlapped with the last backward) and steps Adam. With ``--inner-steps
H`` each DP replica steps alone and DiLoCo's outer step averages over DP every H steps (:class:`OuterStep`).
Measurement: ``measure.py``; prediction: ``predict.py``; checkpoints, lock, signals, loss check:
``checkpoint.py``. Chapter 14; lab 14 runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function
from tqdm import tqdm

if __package__ in (None, ""):  # run by path (torchrun labs/capstone/train.py): import labs.capstone from the checkout
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from commlab.compress import CompressionHookState, PowerSGDState, compression_hook, powersgd_hook
from commlab.experiments.corpus import load_corpus
from commlab.experiments.methods import compressor_for, parse_spec
from commlab.launch import init_from_env
from commlab.launch.device import Clock, group_device
from commlab.launch.env import exit_process, read_env
from commlab.overlap import BucketedDataParallel
from commlab.overlap.bucketed import DEFAULT_BUCKET_CAP_BYTES
from commlab.parallel import ZeroOneOptimizer
from commlab.parallel.mesh import ParallelLayout, build_mesh, mesh_groups
from commlab.parallel.pipeline import pipeline_step
from commlab.parallel.tensor import tp_sharded_parameters
from commlab.sync import DiLoCo

from labs.capstone import checkpoint, predict, preflight
from labs.capstone.measure import StepLog, StepMeter, StepStats, profiled, steady_means, summary
from labs.capstone.model import (GPT, MATMUL_DTYPE, PARAM_DTYPE, GPTConfig, apply_tp, build_gpt, check_layout, lm_loss,
                                 pipeline_stages)

__all__ = ["Options", "parse_args", "parallelize", "apply_dp", "OuterStep", "Trainer", "train", "main"]


def flag(default, help: str, **argparse_options):
    """A field of :class:`Options`, read from the flag of its name; ``argparse_options`` go to ``add_argument``."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_options})


#: Other spellings of ``--compressor`` values (those the literature uses).
COMPRESSOR_ALIASES = {"none": "dense", "int8": "int:8", "int4": "int:4", "fp16": "cast:fp16", "bf16": "cast:bf16"}


@dataclasses.dataclass(frozen=True)
class Options:
    """One run. Each field but ``model`` is the flag of its name (``micro_batch``: ``--micro-batch``; a bool
    that defaults to True: ``--no-<name>``); ``model``'s fields are ``--layers --hidden --heads --ffn --seq``."""

    # the layout: tp x pp x dp ranks
    tp: int = flag(1, "tensor-parallel size, dividing heads and ffn")
    pp: int = flag(1, "pipeline stages, dividing layers")
    dp: int = flag(1, "data-parallel replicas; tp x pp x dp = world size")
    micro_batch: int = flag(2, "sequences per micro-batch")
    micro_batches: int = flag(2, "micro-batches per step and DP rank")
    schedule: str = flag("1f1b", "the pipeline schedule", choices=("gpipe", "1f1b"))
    # the optimization
    steps: int = flag(20, "optimizer steps")
    eval_every: int = flag(0, "held-out loss every N steps and after the last; 0: the last only", metavar="N")
    seed: int = flag(0, "seed of the weights and of the batches")
    lr: float = flag(3e-3, "Adam's learning rate")
    dtype: str = flag("float32", "bfloat16: float32 parameters, the passes under bfloat16 autocast",
                      choices=tuple(PARAM_DTYPE))
    # the DP dimension
    dp_impl: str = flag("commlab", "the DP wrapper: commlab's BucketedDataParallel, or torch's "
                        "DistributedDataParallel (with --pp 1 and --compressor dense)", choices=("commlab", "ddp"))
    zero1: bool = flag(False, "shard Adam's state over the DP group (ZeRO stage 1)")
    compressor: str = flag("dense", "how DP averages gradients: dense, powersgd:R, topk:RATIO, randomk:RATIO, "
                           "int:8, int:4, qsgd:BITS, sign, cast:bf16, cast:fp16", metavar="SPEC",
                           type=lambda spec: COMPRESSOR_ALIASES.get(spec, spec))
    error_feedback: bool = flag(True, "use error feedback when compressing (per step or the outer step), with "
                                "every compressor but the casts")
    # syncing DP less often: DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025) instead of the AllReduce
    inner_steps: int | None = flag(None, "DiLoCo over DP: each replica takes H local steps, then the outer step "
                                   "averages the pseudo-gradients over DP (default: average gradients every step)",
                                   metavar="H", type=int)
    outer_lr: float = flag(0.7, "the outer SGD's learning rate (with --inner-steps)", metavar="LR")
    outer_momentum: float = flag(0.9, "the outer SGD's momentum (with --inner-steps)", metavar="MU")
    nesterov: bool = flag(True, "use Nesterov momentum in the outer step (with --inner-steps)")
    fragments: int = flag(1, "Streaming DiLoCo: fragments synced on a staggered schedule (with --inner-steps)",
                          metavar="K")
    sync_delay: int = flag(0, "Streaming DiLoCo: inner steps a fragment's outer AllReduce overlaps (tau)",
                           metavar="TAU")
    mixing: float = flag(0.0, "Streaming DiLoCo: local <- alpha local + (1 - alpha) global", metavar="ALPHA")
    outer_compressor: str = flag("dense", "how the outer step sends the pseudo-gradient: dense, int:8, topk:RATIO, "
                                 "cast:bf16, ... (as --compressor)", metavar="SPEC",
                                 type=lambda spec: COMPRESSOR_ALIASES.get(spec, spec))
    model: GPTConfig = GPTConfig()
    # where it runs and what it writes
    backend: str | None = flag(None, "default: NCCL when CUDA is present, else gloo", choices=("gloo", "nccl"))
    log_file: str | None = flag(None, "one JSON line per step, written by rank 0", metavar="FILE.jsonl")
    ckpt_dir: str | None = flag(None, "where checkpoints go, loadable under any layout", metavar="DIR")
    ckpt_every: int = flag(0, "save every N steps and after the last; on SIGTERM or SIGUSR1 save and stop (0: only "
                           "then); under torchrun the save must end within its 30 s before SIGKILL, and SIGUSR1 "
                           "needs --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", metavar="N")
    resume: bool = flag(False, "continue from the newest checkpoint in --ckpt-dir that loads, under this layout")
    overwrite: bool = flag(False, "start afresh in a --ckpt-dir that holds checkpoints, deleting them")
    profile: str | None = flag(None, "write a torch.profiler trace per rank to DIR/rank<R>.json", metavar="DIR")
    plan: bool = flag(True, "calibrate and print the planner's prediction after training")

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all DP ranks."""
        return self.micro_batch * self.micro_batches * self.dp


#: The model's flags: GPTConfig's fields, its defaults the tiny model CI trains.
MODEL_FLAGS = {"layers": "transformer blocks", "hidden": "model width", "heads": "attention heads",
               "ffn": "the MLP's inner width", "seq": "sequence length"}


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """Read the flags; what would fail later is a usage error now (exit 2, :func:`preflight.check`)."""
    p = argparse.ArgumentParser(prog="labs/capstone/train.py", description=__doc__.split("\n\n")[0])
    fields = [(f.name, f.default, dict(f.metadata)) for f in dataclasses.fields(Options) if f.name != "model"]
    fields += [(name, getattr(GPTConfig(), name), {"help": what}) for name, what in MODEL_FLAGS.items()]
    for name, default, options in fields:
        options["help"] += "" if default is None or isinstance(default, bool) else f" (default {default})"
        if isinstance(default, bool):  # --zero1 turns on what is off; --no-plan turns off what is on
            p.add_argument("--" + ("no-" if default else "") + name.replace("_", "-"), dest=name,
                           action="store_false" if default else "store_true",
                           help=("do not " if default else "") + options["help"])
        else:
            options.setdefault("type", str if default is None else type(default))
            p.add_argument("--" + name.replace("_", "-"), default=default, **options)
    args = vars(p.parse_args(argv))
    try:
        model = GPTConfig(**{name: args.pop(name) for name in MODEL_FLAGS})
        opts = Options(**args, model=model)
        preflight.check(opts)
    except ValueError as e:
        p.error(str(e))
    return opts


def get_batch(step: int, opts: Options, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, the same on every rank: ``(global_batch, seq)`` int64 inputs and targets."""
    seq = opts.model.seq
    g = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
    starts = torch.randint(len(ids) - seq - 1, (opts.global_batch,), generator=g).tolist()
    return torch.stack([ids[s:s + seq] for s in starts]), torch.stack([ids[s + 1:s + seq + 1] for s in starts])


def parallelize(model: GPT, mesh, opts: Options):
    """TP, then PP, then DP, on this rank: its pipeline stage of ``model`` (TP-sharded in place), the DP wrapper
    around the stage, and the wrapper's comm hook state (None for dense averaging)."""
    apply_tp(model, mesh.get_group("tp"))                                 # Megatron's split of every block
    stage = pipeline_stages(model, opts.pp)[mesh.get_local_rank("pp")]    # this rank's consecutive blocks
    dp, hook_state = apply_dp(stage, mesh.get_group("dp"), opts)          # gradient averaging over DP
    return stage, dp, hook_state


def apply_dp(stage: nn.Module, group: dist.ProcessGroup, opts: Options):
    """Wrap ``stage`` for data parallelism over ``group``: torch's DDP (``--dp-impl ddp``), or commlab's
    bucketed averaging with the comm hook of ``--compressor``. Returns the wrapper and the hook's state.

    PowerSGD (Vogels et al. 2019) compresses from the third step (``start_iter=2``: the least torch's hook
    allows with error feedback); the others run through :func:`commlab.compress.compression_hook`.
    """
    if opts.dp_impl == "ddp":
        cap_mb = DEFAULT_BUCKET_CAP_BYTES / 2 ** 20
        return DistributedDataParallel(stage, process_group=group, bucket_cap_mb=cap_mb), None
    # TP shards and replicated parameters in separate buckets, so that a compressor whose output depends on the
    # whole bucket (Top-K's selection, a quantiser's scale) keeps the replicated ones equal on every TP rank.
    sharded = tp_sharded_parameters(stage)
    dp = BucketedDataParallel(stage, process_group=group, bucket_key=lambda name, _p: name in sharded)
    kind, arg = parse_spec(opts.compressor)
    if kind == "dense":
        return dp, None
    if kind == "powersgd":
        state = PowerSGDState(process_group=group, rank=int(arg), start_iter=2, use_error_feedback=opts.error_feedback,
                              warm_start=opts.error_feedback, random_seed=opts.seed)
        dp.register_comm_hook(state, powersgd_hook)
    else:
        state = CompressionHookState(compressor_for(opts.compressor, opts.seed), group,
                                     opts.error_feedback and kind != "cast")
        dp.register_comm_hook(state, compression_hook)
    return dp, state


class OuterStep:
    """DiLoCo over the DP group for one rank's stage (``--inner-steps``): one :class:`commlab.sync.DiLoCo` per kind
    of parameter, TP shards and replicated ones, on the same schedule. Apart for the reason the DP buckets are
    (:func:`apply_dp`): a compressor's output depends on the whole fragment, and the replicated parameters must
    stay equal on every TP rank. :meth:`step` after each inner optimizer step; True when an outer update landed.

    Each rank's parameters are its local tensors (its TP shards of its PP stage), so each rank averages with the
    DP peers that hold the same shards. Collective over the world (RunError on every rank for a ``--fragments``
    above the tensors of a rank's smaller kind).
    """

    def __init__(self, stage: nn.Module, group: dist.ProcessGroup, opts: Options):
        sharded = tp_sharded_parameters(stage)
        kinds = {"sharded": [p for n, p in stage.named_parameters() if n in sharded],
                 "replicated": [p for n, p in stage.named_parameters() if n not in sharded]}
        kinds = {kind: params for kind, params in kinds.items() if params}
        least = torch.tensor([min(len(params) for params in kinds.values())], device=group_device(group))
        dist.all_reduce(least, op=dist.ReduceOp.MIN)   # every rank refuses alike, before any DiLoCo exists
        if opts.fragments > int(least.item()):
            raise checkpoint.RunError(f"--fragments {opts.fragments}: a fragment is a run of whole parameter tensors, "
                                      f"and the smallest set a rank syncs (its stage's TP shards, or its replicated "
                                      f"parameters) has {int(least.item())}; use fewer")
        compressor = None if opts.outer_compressor == "dense" else opts.outer_compressor
        feedback = opts.error_feedback and compressor is not None and not compressor.startswith("cast")
        self.parts = {kind: DiLoCo(params, group, inner_steps=opts.inner_steps, outer_lr=opts.outer_lr,
                                   outer_momentum=opts.outer_momentum, nesterov=opts.nesterov,
                                   fragments=opts.fragments, sync_delay=opts.sync_delay, mixing=opts.mixing,
                                   compressor=compressor, error_feedback=feedback, seed=opts.seed)
                      for kind, params in kinds.items()}

    def step(self) -> bool:
        return any([part.step() for part in self.parts.values()])   # a list: every part steps

    @property
    def bytes_sent_per_rank(self) -> float:
        return sum(part.bytes_sent_per_rank for part in self.parts.values())

    def state_dict(self) -> dict:
        return {kind: part.state_dict() for kind, part in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        for kind, part in self.parts.items():
            part.load_state_dict(state[kind])

    @torch.no_grad()
    def start_from_parameters(self) -> None:
        """Take the parameters as they are now (loaded from a checkpoint of plain DP) as the global copy; before
        the first step, so that the rest of the state is as new (zero momentum, no step counted)."""
        for part in self.parts.values():
            for glob, p in zip(part.global_params, part.params):
                glob.copy_(p)

    def close(self) -> None:
        """Wait for an outer AllReduce in flight (``--sync-delay``); before the process group goes."""
        for part in self.parts.values():
            part.close()


class Trainer:
    """This rank's part of a TP x PP x DP run: its mesh, its stage wrapped for DP, its optimizer, its meter.
    Every rank of the world makes it (collectively); ValueError on every rank, before any group exists, if the
    layout does not fit the model or the world."""

    def __init__(self, opts: Options):
        world = dist.get_world_size()
        check_layout(opts.model, opts.tp, opts.pp, opts.dp, world)
        self.opts = opts
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))   # a TP group stays inside a node if it can
        node = local if local % opts.tp == 0 else world
        self.mesh = build_mesh(ParallelLayout(dp=opts.dp, pp=opts.pp, tp=opts.tp, devices_per_node=node), world)
        self.groups = mesh_groups(self.mesh)
        self.device = group_device(self.groups["dp"])
        self.model = build_gpt(opts.model, opts.seed, PARAM_DTYPE[opts.dtype]).to(self.device)
        self.full_shapes = {name: p.shape for name, p in self.model.named_parameters()}
        self.stage, self.dp, hook_state = parallelize(self.model, self.mesh, opts)
        params, dp_group = self.stage.parameters(), self.groups["dp"]
        self.optimizer = (ZeroOneOptimizer(params, dp_group=dp_group, optimizer_cls=torch.optim.Adam, lr=opts.lr)
                          if opts.zero1 else torch.optim.Adam(params, lr=opts.lr))   # ZeRO-1: Adam sharded over DP
        self.outer = None if opts.inner_steps is None else OuterStep(self.stage, dp_group, opts)   # DiLoCo
        self.dp_sync = checkpoint.dp_sync_of(hook_state, self.dp, self.mesh, opts)   # what checkpoints store
        self.outer_sync = checkpoint.outer_sync_of(self.outer, self.mesh, opts)
        corpus = load_corpus()
        self.train_ids, self.val_ids = corpus.train, corpus.val
        clock = self.dp.clock if isinstance(self.dp, BucketedDataParallel) else Clock(self.device)
        self.meter = StepMeter(opts, clock, self.groups["tp"], self.mesh.get_local_rank("pp"), self.device)

    def local_batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's rows of a global batch, on the device."""
        share, dp_rank = self.opts.micro_batch * self.opts.micro_batches, self.mesh.get_local_rank("dp")
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        return batch[0][rows].to(self.device), batch[1][rows].to(self.device)

    def step(self, step: int) -> StepStats:
        """One optimizer step on the global batch of ``step``, measured; the same StepStats on every rank."""
        opts, meter = self.opts, self.meter
        x, y = self.local_batch(get_batch(step, opts, self.train_ids))
        meter.start()
        self.optimizer.zero_grad(set_to_none=True)
        pipeline = None
        with meter.timing_tp(), self.autocast():
            if opts.pp == 1:   # DP's averaging overlaps the last micro-batch's backward
                loss = self.accumulate(x, y)
            else:
                with self.dp.no_sync():
                    pipeline = pipeline_step(self.dp, x, y, lm_loss, opts.micro_batches, self.groups["pp"],
                                             opts.schedule)
                loss = pipeline.loss
        meter.mark()
        if opts.pp > 1 and self.outer is None:
            self.dp.sync_gradients()   # once, after the pipeline's flush
        meter.mark()
        self.optimizer.step()
        meter.mark()
        loss = self.global_mean(loss)
        if self.outer is not None and math.isfinite(loss):   # a non-finite loss stops the run (RunDirectory)
            self.outer_step(step)   # DiLoCo: the inner step was this replica's own; every H steps the outer step
            meter.mark()
        return meter.stats(step, loss, pipeline, self.dp)

    def outer_step(self, step: int) -> None:
        """DiLoCo's step after the inner one (an outer update every H steps). RunError on every rank if any DP
        group's pseudo-gradient is not finite (DiLoCo refuses it within its group; one AllReduce tells the world)."""
        bad = torch.zeros(1, dtype=torch.int64, device=self.device)
        try:
            self.outer.step()
        except FloatingPointError:
            bad += 1
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if int(bad.item()):
            raise checkpoint.RunError(f"step {step}: DiLoCo's pseudo-gradient is not finite on some DP group; "
                                      "stopping, with nothing saved from this step on (lower --lr or --outer-lr, "
                                      "or resume from an earlier checkpoint)")

    def accumulate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """pp = 1: the micro-batches in turn, gradients accumulated inside ``no_sync`` but for the last, whose
        backward averages them over DP overlapped with its computation (as DDP does; with ``--inner-steps``
        inside ``no_sync`` too). The mean loss."""
        m = self.opts.micro_batches
        total = 0.0
        for j, (xj, yj) in enumerate(zip(x.chunk(m), y.chunk(m))):
            with self.dp.no_sync() if j < m - 1 or self.outer is not None else contextlib.nullcontext():
                loss = lm_loss(self.dp(xj), yj) / m
                loss.backward()
            total = total + loss.detach()   # read once, below: no host synchronisation per micro-batch
        return float(total)

    def validation_loss(self) -> float:
        """Mean loss on a fixed global batch of the held-out split (nats), the same on every rank. With pp > 1
        the pipeline schedule (it has no forward-only form), whose gradients are then dropped. With
        ``--inner-steps`` each replica's own parameters on its share of the batch."""
        opts, m = self.opts, self.opts.micro_batches
        x, y = self.local_batch(get_batch(0, opts, self.val_ids))
        if opts.pp == 1:
            with torch.no_grad(), self.autocast():
                loss = float(sum(lm_loss(self.stage(xj), yj) for xj, yj in zip(x.chunk(m), y.chunk(m)))) / m
        else:
            with self.dp.no_sync(), self.autocast():
                loss = pipeline_step(self.dp, x, y, lm_loss, m, self.groups["pp"], opts.schedule).loss
            self.optimizer.zero_grad(set_to_none=True)
        return self.global_mean(loss)

    def global_mean(self, loss: float) -> float:
        """The mean over the DP replicas of this replica's mean loss."""
        total = torch.tensor([loss], dtype=torch.float64, device=self.device)
        with record_function("stats::loss"):
            dist.all_reduce(total, group=self.groups["dp"])
        return float(total.item()) / self.opts.dp

    def autocast(self):
        """bfloat16 autocast for ``--dtype bfloat16`` (each backward op runs in its forward's dtype), else nothing."""
        if self.opts.dtype != "bfloat16":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=MATMUL_DTYPE[self.opts.dtype])


def train(opts: Options, stats: list | None = None) -> list[float]:
    """Run the steps up to ``opts.steps`` in the current process group (with ``resume``, from the step after
    the newest checkpoint that loads); the losses of the steps it ran, the same on every rank. Each step's
    StepStats is appended to ``stats`` if given, and written to ``--log-file`` by rank 0. RunError (every rank)
    for a --ckpt-dir it may not use and at the first non-finite loss (checkpoint.RunDirectory)."""
    rank0 = dist.get_rank() == 0
    with checkpoint.RunDirectory(opts) as ckpt_dir:   # locked; checkpoints verified; SIGTERM/SIGUSR1 caught
        trainer = Trainer(opts)
        start = ckpt_dir.resume(trainer)
        losses = []
        with tqdm(range(start, opts.steps), desc=f"tp={opts.tp} pp={opts.pp} dp={opts.dp}", unit="step",
                  disable=None if rank0 else True) as bar, \
                StepLog(opts.log_file if rank0 else None, start) as log, profiled(opts.profile, trainer.device):
            for step in bar:
                with record_function(f"capstone::step{step}"):
                    measured = trainer.step(step)
                if step == opts.steps - 1 or (opts.eval_every and (step + 1) % opts.eval_every == 0):
                    with record_function("capstone::validation"):
                        measured = dataclasses.replace(measured, val_loss=trainer.validation_loss())
                losses.append(measured.loss)
                if stats is not None:
                    stats.append(measured)
                log.write(measured)
                bar.set_postfix(loss=f"{measured.loss:.3f}", tok_s=f"{measured.tokens_per_s:.0f}", refresh=False)
                if ckpt_dir.end_of_step(step, measured.loss, trainer):   # saved on a preemption signal: stop
                    break
        if trainer.outer is not None:
            trainer.outer.close()
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    created = not dist.is_initialized()
    world = read_env().world_size if created else dist.get_world_size()
    try:   # before any process group exists: every rank refuses at once, as a usage error
        preflight.check_world(opts, world)
    except ValueError as e:
        print(f"labs/capstone/train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    ctx = init_from_env(backend=opts.backend)
    stats: list[StepStats] = []
    try:
        losses, code = train(opts, stats), 0
    except checkpoint.RunError as e:   # raised on every rank alike: all leave together below
        if ctx.rank == 0:
            print(f"labs/capstone/train.py: error: {e}", file=sys.stderr, flush=True)
        losses, stats, code = [], [], 1
    if ctx.rank == 0 and losses:
        val = "" if stats[-1].val_loss is None else f"; validation loss {stats[-1].val_loss:.4f}"
        print(f"tp={opts.tp} pp={opts.pp} dp={opts.dp}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
              f"in {len(losses)} steps{val}", flush=True)
        print(summary(stats), flush=True)
    if opts.plan and stats and opts.inner_steps is not None:
        if ctx.rank == 0:
            print("plan: not predicted: the planner prices a DP AllReduce every step, and --inner-steps syncs "
                  f"every {opts.inner_steps} steps (commlab.sync.cost prices the outer step)", flush=True)
    elif opts.plan and stats and checkpoint.preempted_at() is None:
        report = predict.calibrate_and_report(opts, steady_means(stats)["step_s"], stats[-1].gemm_flop_per_s,
                                              ctx.local_world_size, group_device(None))
        if report is not None:
            print(report, flush=True)
    if created:   # every rank leaves together: a rank gone with its gloo pairs open can fail a peer's thread
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    exit_process(main())
