"""Train the capstone GPT with TP x PP x DP: one script for a laptop (gloo), a GPU node and a SLURM cluster (NCCL).

    torchrun --standalone --nproc-per-node 8 labs/capstone/train.py --tp 2 --pp 2 --dp 2 --steps 20
    python labs/capstone/train.py --steps 20                       # one rank, no launcher

Under torchrun or srun the job's ranks are used (:func:`commlab.launch.init_from_env`: gloo on CPU, NCCL with
one GPU per ``LOCAL_RANK`` when CUDA is present, unless ``--backend`` says otherwise). The layout is checked
against the model and the world before any process group is made.

One step, on every rank (the pieces are the course's own):

1. every rank draws the same global batch of ``micro_batch * micro_batches * dp`` windows of the corpus (seeded
   by ``--seed`` and the step) and keeps its DP share;
2. the mesh (:func:`commlab.parallel.mesh.build_mesh`, TP innermost) gives the rank its TP, PP and DP groups;
   the model is built whole from the seed, sharded over TP (:func:`model.apply_tp`) and cut into PP stages
   (:func:`model.pipeline_stages`); this rank keeps its stage;
3. the stage runs the pipeline schedule (:func:`commlab.parallel.pipeline.pipeline_step`, GPipe or 1F1B) inside
   the data-parallel wrapper's ``no_sync`` (:class:`commlab.overlap.BucketedDataParallel` over the DP group),
   then ``sync_gradients`` averages the stage's gradients over DP once, after the pipeline's flush;
4. the optimizer steps; the loss logged is the global batch's mean (an AllReduce over DP of the pipeline's).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

if __package__ in (None, ""):  # run as a script: its own folder and the checkout's root on the path
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from commlab.compress import CompressionHookState, PowerSGDState, compression_hook, powersgd_hook  # noqa: E402
from commlab.experiments.corpus import load_corpus  # noqa: E402
from commlab.experiments.methods import compressor_for, parse_spec  # noqa: E402
from commlab.launch.device import Clock, group_device  # noqa: E402
from commlab.overlap import BucketedDataParallel  # noqa: E402
from commlab.overlap.bucketed import DEFAULT_BUCKET_CAP_BYTES  # noqa: E402
from commlab.parallel import ZeroOneOptimizer  # noqa: E402
from commlab.parallel.mesh import ParallelLayout, build_mesh, mesh_groups  # noqa: E402
from commlab.parallel.planner import model_flops_per_token  # noqa: E402
from commlab.parallel.pipeline import pipeline_step  # noqa: E402
from commlab.parallel.tensor import tp_sharded_parameters  # noqa: E402
from commlab.parallel.tensor.communications import CommTimer, timed  # noqa: E402
from tqdm import tqdm  # noqa: E402

from labs.capstone import checkpoint  # noqa: E402
from labs.capstone.model import (MATMUL_DTYPE, PARAM_DTYPE, GPTConfig, apply_tp, build_gpt, check_layout,  # noqa: E402
                                 lm_loss, pipeline_stages)

__all__ = ["Options", "StepStats", "parse_args", "Trainer", "global_batch", "measure_gemm_flops", "gemm_shape",
           "steady_means", "SPLIT", "train", "main"]


@dataclasses.dataclass(frozen=True)
class Options:
    """What one run does (the command line's flags, see :func:`parse_args`)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 2
    micro_batches: int = 2
    schedule: str = "1f1b"
    steps: int = 20
    eval_every: int = 0
    seed: int = 0
    lr: float = 3e-3
    zero1: bool = False
    dp_impl: str = "commlab"
    compressor: str = "dense"
    error_feedback: bool = True
    dtype: str = "float32"
    backend: str | None = None
    log: str | None = None
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    resume: bool = False
    profile: str | None = None
    fail_at_step: int | None = None
    fail_rank: int = 0
    plan: bool = True
    model: GPTConfig = GPTConfig()

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all DP ranks."""
        return self.micro_batch * self.micro_batches * self.dp


#: Other spellings of ``--compressor`` values (those the issue and the literature use).
COMPRESSOR_ALIASES = {"none": "dense", "int8": "int:8", "int4": "int:4", "fp16": "cast:fp16", "bf16": "cast:bf16"}


def _check_run_args(p: argparse.ArgumentParser, args) -> None:
    """Refuse what would fail later (after training, for a profile) with a usage error (exit 2) naming it."""
    import math
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.backend == "nccl" and not torch.cuda.is_available():
        p.error("--backend nccl needs CUDA GPUs and torch sees none here; use --backend gloo (the default "
                "without CUDA)")
    try:
        parse_spec(args.compressor)
    except ValueError as e:
        p.error(str(e))
    if args.compressor != "dense" and args.dp < 2:
        p.error(f"--compressor {args.compressor} compresses the DP dimension, and --dp {args.dp} has no other "
                "replica to send to; use --dp 2 or more, or --compressor dense")
    for flag, path in (("--ckpt-dir", args.ckpt_dir), ("--profile", args.profile)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            p.error(f"{flag} {path} is a file, not a directory")
    if args.profile is not None:
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as e:
            p.error(f"--profile {args.profile}: cannot create it ({e.strerror})")
        if not os.access(args.profile, os.W_OK):
            p.error(f"--profile {args.profile}: not writable")
    if args.log is not None:
        parent = os.path.dirname(os.path.abspath(args.log))
        if os.path.isdir(args.log):
            p.error(f"--log-file {args.log} is a directory; give a file name such as {args.log}/run.jsonl")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            p.error(f"--log-file {args.log}: its directory {parent} does not exist or is not writable")
    corpus = load_corpus()
    longest = min(len(corpus.train), len(corpus.val)) - 2
    if args.seq > longest:
        p.error(f"--seq {args.seq} is longer than the held-out split allows ({longest} tokens)")


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """Read the flags; a layout that does not fit the model is a usage error (exit 2) naming the numbers."""
    p = argparse.ArgumentParser(prog="labs/capstone/train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (divides heads and ffn)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (divides layers)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas; tp x pp x dp = world size")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step and DP rank (default 2)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="validation loss on the held-out split every N steps and after the last (default 0: "
                        "after the last only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default 3e-3)")
    p.add_argument("--dp-impl", choices=["commlab", "ddp"], default="commlab",
                   help="the DP wrapper: commlab's BucketedDataParallel (default) or torch's "
                        "DistributedDataParallel (same bucket cap; with --pp 1 and a dense --compressor only, "
                        "for the benchmark against it)")
    p.add_argument("--zero1", action="store_true",
                   help="shard Adam's state over the DP group (ZeRO stage 1, commlab.parallel.ZeroOneOptimizer)")
    p.add_argument("--compressor", default="dense", metavar="SPEC",
                   help="how the DP dimension averages gradients: dense (default), powersgd:R, topk:RATIO, "
                        "randomk:RATIO, int:8, int:4, qsgd:BITS, sign, cast:bf16, cast:fp16")
    p.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                   help="compress without error feedback (default: with it, for every compressor but the casts)")
    p.add_argument("--dtype", choices=sorted(PARAM_DTYPE), default="float32")
    size = GPTConfig()
    for name, what in (("layers", "transformer blocks"), ("hidden", "model width"), ("heads", "attention heads"),
                       ("ffn", "the MLP's inner width"), ("seq", "sequence length")):
        p.add_argument(f"--{name}", type=int, default=getattr(size, name),
                       help=f"{what} (default {getattr(size, name)}: the tiny model CI trains)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: NCCL when CUDA is present, else gloo")
    # Not "--log": torchrun's own parser reads every option of the command line, the script's too, and takes
    # "--log" for an ambiguous abbreviation of its --log-dir / --logs-specs.
    p.add_argument("--log-file", dest="log", metavar="FILE.jsonl", default=None,
                   help="one JSON line per step (rank 0 writes it)")
    p.add_argument("--ckpt-dir", default=None, metavar="DIR",
                   help="where checkpoints go (torch.distributed.checkpoint, loadable under any layout)")
    p.add_argument("--ckpt-every", type=int, default=0, metavar="N", help="save every N steps (0: never)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --ckpt-dir (if there is one), under this layout")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler Chrome trace per rank to DIR/rank<R>.json (open it in Perfetto)")
    p.add_argument("--no-plan", dest="plan", action="store_false",
                   help="skip the planner's prediction after training (and the calibration it measures first)")
    p.add_argument("--fail-at-step", type=int, default=None, metavar="K",
                   help="a test of restarts: rank --fail-rank exits (code 13) before step K, on the job's first "
                        "attempt only (TORCHELASTIC_RESTART_COUNT 0), as a crashed process would")
    p.add_argument("--fail-rank", type=int, default=0, metavar="R", help="the rank --fail-at-step stops (default 0)")
    args = p.parse_args(argv)
    if (args.ckpt_every or args.resume) and not args.ckpt_dir:
        p.error("--ckpt-every and --resume need --ckpt-dir")
    if args.dp_impl == "ddp" and (args.pp != 1 or args.compressor != "dense"):
        p.error("--dp-impl ddp runs with --pp 1 and --compressor dense only (DDP's backward cannot be driven by "
                "a pipeline schedule, and the compressors are commlab's hooks)")
    for name in ("ckpt_every", "eval_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("micro_batch", "micro_batches", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.compressor = COMPRESSOR_ALIASES.get(args.compressor, args.compressor)
    _check_run_args(p, args)
    try:
        model = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn, seq=args.seq)
    except ValueError as e:
        p.error(str(e))
    opts = Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options) if f.name != "model"},
                   model=model)
    try:
        check_layout(opts.model, opts.tp, opts.pp, opts.dp)
    except ValueError as e:
        p.error(str(e))
    return opts


def global_batch(step: int, opts: Options, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, the same on every rank: ``(global_batch, seq)`` int64 inputs and next-token targets."""
    seq = opts.model.seq
    g = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
    starts = torch.randint(len(ids) - seq - 1, (opts.global_batch,), generator=g)
    x = torch.stack([ids[s:s + seq] for s in starts.tolist()])
    y = torch.stack([ids[s + 1:s + seq + 1] for s in starts.tolist()])
    return x, y


def gemm_shape(opts: Options) -> tuple[int, int, int]:
    """``(m, k, n)`` of the model's largest matrix multiplication on one rank: a micro-batch's tokens times the
    MLP's first layer, ``(micro_batch * seq, hidden) @ (hidden, ffn / tp)``."""
    c = opts.model
    return opts.micro_batch * c.seq, c.hidden, c.ffn // opts.tp


def measure_gemm_flops(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int] = (256, 256, 256),
                       seconds: float = 0.1, trials: int = 3) -> float:
    """This rank's matrix-multiply rate (FLOP/s) at ``shape`` = ``(m, k, n)`` on ``device``, measured now: the
    best of ``trials`` runs of about ``seconds`` each (a run the scheduler interrupted is not the rate).

    The capstone measures it at its own largest GEMM (:func:`gemm_shape`), on every rank at once: a CPU has
    no datasheet peak to divide by, and on a shared CPU each rank gets only its share of the machine; on a
    GPU this is the rate at this size and dtype, below the datasheet's peak. It is the denominator of the
    capstone's MFU and the planner's peak for the CPU cluster it calibrates (achievable fraction 1).
    """
    m, k, n = shape
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(4):
        a @ b
    sync()
    best = 0.0
    for _ in range(trials):
        count, start = 0, time.perf_counter()
        while True:
            for _ in range(8):
                a @ b
            count += 8
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                best = max(best, 2.0 * m * k * n * count / elapsed)
                break
    return best


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One step, measured on every rank and combined: ``step_s`` is the slowest rank's, and each part of it is
    the mean over the ranks, so that the parts add up to about the step (a rank's parts add up to its own
    step; what is left is bookkeeping between the marks). Seconds throughout; on a GPU every time is read
    from CUDA events, not the host clock.

    Attributes:
        step, loss: the step index and the global batch's mean training loss (nats).
        step_s: wall seconds of the whole step.
        pipeline_s: seconds in the forward and backward passes (the pipeline schedule when pp > 1): compute,
            TP, PP and bubble, and with pp = 1 the DP AllReduces the backward could not hide.
        compute_s: of those, computing: the stage's forward and backward, less its TP collectives.
        tp_s: TP communication: the collectives of Megatron's f and g in every layer, timed one by one
            (:func:`commlab.parallel.tensor.communications.timed`); all exposed, none overlaps compute here.
        bubble_s: the schedule's ideal bubble at the measured compute: ``(pp - 1) / m`` times the stage's busy
            seconds (Narayanan et al. 2021, §2.2.1: a bubble of ``(p - 1)(t_f + t_b)`` per step), at most
            the stage's idle seconds.
        pp_s: the rest of ``pipeline_s``: PP transfers, waiting for slower stages, the schedule's bookkeeping.
        dp_s: DP communication not hidden behind compute: with pp > 1 the gradient averaging after the flush
            (the comm hook's compression included); with pp = 1 the wait after the last gradient was ready
            (``BucketedDataParallel.last_step``; 0 with ``--dp-impl ddp``, whose wait is inside compute).
        exposed_comm_s: ``tp_s + pp_s + dp_s``.
        optimizer_s: seconds in the optimizer step (ZeRO-1's AllGather included).
        other_s: ``step_s`` less the mean parts: how much longer the slowest rank took than the mean one, and
            the bookkeeping between the marks (the loss's AllReduce). The parts of :data:`SPLIT` add up to
            ``step_s``.
        tokens_per_s: tokens of the global batch per second of ``step_s``.
        mfu: model FLOP/s over the world's GEMM rate (``gemm_flop_per_s`` times the ranks); the model FLOPs
            are the planner's (:func:`commlab.parallel.planner.model_flops_per_token`: ``6 P + 12 L h s`` per
            token, PaLM's MFU accounting, Chowdhery et al. 2022, Appendix B; no recomputation, which the capstone
            does not do).
        gemm_flop_per_s: the slowest rank's matrix-multiply rate at the model's largest GEMM, measured once at
            start-up (FLOP/s): the denominator of ``mfu`` (times the world size) and the planner's peak.
        val_loss: the mean loss on a fixed batch of the held-out split after this step (nats), on the steps
            ``--eval-every`` names and the last one; None on the others.
    """

    step: int
    loss: float
    step_s: float
    pipeline_s: float
    compute_s: float
    tp_s: float
    bubble_s: float
    pp_s: float
    dp_s: float
    exposed_comm_s: float
    optimizer_s: float
    other_s: float
    tokens_per_s: float
    mfu: float
    gemm_flop_per_s: float
    val_loss: float | None = None


class Trainer:
    """This rank's part of a TP x PP x DP run: its groups, its stage (wrapped for DP) and its optimizer.

    Every rank of the world must construct it (the mesh's groups are made collectively).

    Raises:
        ValueError: the layout does not fit the model or the world (on every rank, before any group is made).
    """

    def __init__(self, opts: Options):
        world = dist.get_world_size()
        check_layout(opts.model, opts.tp, opts.pp, opts.dp, world)
        self.opts = opts
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        per_node = local if local % opts.tp == 0 else world
        mesh = build_mesh(ParallelLayout(dp=opts.dp, pp=opts.pp, tp=opts.tp, devices_per_node=per_node), world)
        self.groups = mesh_groups(mesh)
        self.device = group_device(self.groups["dp"])
        self.dp_rank = dist.get_rank(self.groups["dp"])
        self.stage = dist.get_rank(self.groups["pp"])
        model = build_gpt(opts.model, opts.seed, PARAM_DTYPE[opts.dtype]).to(self.device)
        self.full_shapes = {name: p.shape for name, p in model.named_parameters()}
        self.model = apply_tp(model, self.groups["tp"])
        self.module = pipeline_stages(model, opts.pp)[self.stage]
        if opts.dp_impl == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            cap_mb = DEFAULT_BUCKET_CAP_BYTES / 2 ** 20
            self.dp = DistributedDataParallel(self.module, process_group=self.groups["dp"], bucket_cap_mb=cap_mb)
            self.dp_hook_state = None
            self.clock = Clock(self.device)
        else:
            # TP shards and replicated parameters in separate buckets: a compressor whose output depends on the
            # whole bucket (Top-K's selection, a quantiser's scale) then keeps the replicated ones identical on
            # every TP rank (they drifted apart by 5e-3 in 3 steps of Top-K at 2x1x2 when they shared buckets).
            sharded = tp_sharded_parameters(self.module)
            self.dp = BucketedDataParallel(self.module, process_group=self.groups["dp"],
                                           bucket_key=lambda name, _p: name in sharded)
            self.dp_hook_state = register_dp_sync(self.dp, opts, self.groups["dp"])
            self.clock = self.dp.clock
        if opts.zero1:
            # After the DP wrapper: the gradients arrive averaged, and the step adds only the AllGather.
            self.optimizer = ZeroOneOptimizer(self.module.parameters(), dp_group=self.groups["dp"],
                                              optimizer_cls=torch.optim.Adam, lr=opts.lr)
        else:
            self.optimizer = torch.optim.Adam(self.module.parameters(), lr=opts.lr)
        corpus = load_corpus()
        self.ids, self.val_ids = corpus.train, corpus.val
        self.tp_timer = CommTimer(self.clock)
        self.model_flops_per_token = model_flops_per_token(opts.model.planner_config())
        dist.barrier()
        # The slowest rank's rate, the same on every rank: MFU's denominator and the planner's peak (predict.py).
        rate = torch.tensor([measure_gemm_flops(self.device, MATMUL_DTYPE[opts.dtype], gemm_shape(opts))],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(rate, op=dist.ReduceOp.MIN)
        self.gemm_flops = float(rate.item())

    def _share(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's rows of a global batch, on the device."""
        share = self.opts.micro_batch * self.opts.micro_batches
        rows = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        x, y = batch
        return x[rows].to(self.device), y[rows].to(self.device)

    def step(self, step: int) -> StepStats:
        """One optimizer step on the global batch of ``step``, measured; the same :class:`StepStats` on every rank."""
        opts = self.opts
        x, y = self._share(global_batch(step, opts, self.ids))
        clock, timer = self.clock, self.tp_timer
        timer.reset()
        t0 = clock.mark()
        self.optimizer.zero_grad(set_to_none=True)
        with timed(self.groups["tp"], timer), self._precision():
            if opts.pp == 1:
                mean_loss = self._accumulate(x, y)
                t1 = t2 = clock.mark()   # the DP AllReduces overlap the last micro-batch's backward
            else:
                with self.dp.no_sync():
                    result = pipeline_step(self.dp, x, y, lm_loss, opts.micro_batches, self.groups["pp"],
                                           opts.schedule)
                t1 = clock.mark()
        if opts.pp > 1:
            self.dp.sync_gradients()
            t2 = clock.mark()
            mean_loss = result.loss
        self.optimizer.step()
        t3 = clock.mark()
        pipeline_s, tp_s = clock.elapsed(t0, t1), timer.seconds()
        if opts.pp == 1:
            dp_s = self._exposed_dp_wait() if opts.dp > 1 else 0.0   # one replica: nothing to wait for
            busy_s, bubble_s, pp_s = pipeline_s - dp_s, 0.0, 0.0     # no pipeline: no bubble, no PP
        else:
            dp_s = clock.elapsed(t1, t2)
            busy_s, idle_s = result.busy_s[self.stage], result.idle_s[self.stage]
            bubble_s = min(idle_s, (opts.pp - 1) / opts.micro_batches * busy_s)
            pp_s = max(0.0, pipeline_s - busy_s - bubble_s)
        loss = torch.tensor([mean_loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss, group=self.groups["dp"])
        step_s = torch.tensor([clock.elapsed(t0, t3)], dtype=torch.float64, device=self.device)
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
        parts = torch.tensor([pipeline_s, max(0.0, busy_s - tp_s), tp_s, bubble_s, pp_s, dp_s, tp_s + pp_s + dp_s,
                              clock.elapsed(t2, t3)], dtype=torch.float64, device=self.device)
        dist.all_reduce(parts)
        step_s = float(step_s.item())
        pipeline_s, compute_s, tp_s, bubble_s, pp_s, dp_s, exposed_s, opt_s = (parts / dist.get_world_size()).tolist()
        other_s = max(0.0, step_s - (compute_s + tp_s + bubble_s + pp_s + dp_s + opt_s))
        tokens = opts.global_batch * opts.model.seq
        achieved = self.model_flops_per_token * tokens / step_s
        return StepStats(step, float(loss.item()) / opts.dp, step_s, pipeline_s, compute_s, tp_s, bubble_s, pp_s,
                         dp_s, exposed_s, opt_s, other_s, tokens / step_s,
                         achieved / (self.gemm_flops * dist.get_world_size()), self.gemm_flops)

    def _exposed_dp_wait(self) -> float:
        """pp = 1: seconds the backward waited for the DP AllReduces after its last gradient was ready (0 under
        torch's DDP, which does not say)."""
        record = getattr(self.dp, "last_step", None)
        if record is None or record.wait_end_s is None or record.last_grad_s is None:
            return 0.0
        return max(0.0, record.wait_end_s - record.last_grad_s)

    def validation_loss(self) -> float:
        """Mean loss on a fixed global batch of the held-out split (nats), the same on every rank.

        With pp = 1 a forward pass without gradients. With pp > 1 the pipeline schedule, whose backward
        cannot be left out (the engine has no forward-only schedule), inside ``no_sync``; the gradients
        it leaves are dropped, so training is unchanged.
        """
        opts = self.opts
        x, y = self._share(global_batch(0, opts, self.val_ids))
        if opts.pp == 1:
            with torch.no_grad(), self._precision():
                total = sum(lm_loss(self.module(xj), yj) for xj, yj in zip(x.chunk(opts.micro_batches),
                                                                            y.chunk(opts.micro_batches)))
            mean = float(total) / opts.micro_batches
        else:
            with self.dp.no_sync(), self._precision():
                mean = pipeline_step(self.dp, x, y, lm_loss, opts.micro_batches, self.groups["pp"],
                                     opts.schedule).loss
            self.optimizer.zero_grad(set_to_none=True)
        loss = torch.tensor([mean], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss, group=self.groups["dp"])
        return float(loss.item()) / opts.dp

    def _precision(self):
        """bfloat16 autocast for ``--dtype bfloat16`` (the forward passes; autograd runs each backward op in its
        forward's dtype), else nothing."""
        if self.opts.dtype != "bfloat16":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """No pipeline (``pp == 1``): the micro-batches one after another, gradients accumulated inside
        ``no_sync`` but for the last, whose backward averages them over DP overlapped with its computation (as
        DDP does). Returns the mean of the micro-batches' losses."""
        m = self.opts.micro_batches
        total = 0.0
        for j, (xj, yj) in enumerate(zip(x.chunk(m), y.chunk(m))):
            ctx = self.dp.no_sync() if j < m - 1 else contextlib.nullcontext()
            with ctx:
                loss = lm_loss(self.dp(xj), yj) / m
                loss.backward()
            total = total + loss.detach()  # read once, below: no host synchronisation per micro-batch
        return float(total)


def register_dp_sync(dp: BucketedDataParallel, opts: Options,
                     group: dist.ProcessGroup) -> PowerSGDState | CompressionHookState | None:
    """Give ``dp`` the comm hook of ``opts.compressor`` over the DP ``group`` (none for dense: the AllReduce);
    return the hook's state (None for dense), which checkpoints store.

    PowerSGD (Vogels et al. 2019, Algorithm 1) with its error feedback and warm start, compressing from the
    third step (``start_iter=2``: the first two are averaged densely, the least torch's hook allows with error
    feedback);
    the other compressors through :func:`commlab.compress.compression_hook`, with error feedback unless
    ``--no-error-feedback`` or a cast (a cast loses too little to need it).
    """
    kind, arg = parse_spec(opts.compressor)
    if kind == "dense":
        return
    if kind == "powersgd":
        state = PowerSGDState(process_group=group, rank=int(arg), start_iter=2,
                              use_error_feedback=opts.error_feedback, warm_start=opts.error_feedback,
                              random_seed=opts.seed)
        dp.register_comm_hook(state, powersgd_hook)
        return state
    ef = opts.error_feedback and kind != "cast"
    state = CompressionHookState(compressor_for(opts.compressor, opts.seed), group, ef)
    dp.register_comm_hook(state, compression_hook)
    return state


def _dp_sync(trainer: Trainer) -> checkpoint.DPSync | None:
    """The compressor state a checkpoint stores for this rank, and the setting it is valid for."""
    state, opts = trainer.dp_hook_state, trainer.opts
    if state is None:
        return None
    where = f"pp{trainer.stage}.tp{dist.get_rank(trainer.groups['tp'])}.dp{trainer.dp_rank}"
    setting = (f"tp={opts.tp} pp={opts.pp} dp={opts.dp}, {opts.compressor} with error feedback "
               f"{'on' if opts.error_feedback else 'off'}, {opts.dtype}, seed {opts.seed}, "
               f"bucket cap {trainer.dp.bucket_cap_bytes} B")
    return checkpoint.DPSync(state, trainer.dp, where, setting)


def train(opts: Options, stats: list | None = None) -> list[float]:
    """Run steps up to ``opts.steps`` in the current process group (from the newest checkpoint's next step with
    ``resume``); the losses of the steps it ran, the same on every rank. Each step's :class:`StepStats` is
    appended to ``stats`` if given, written as a JSON line to ``opts.log`` by rank 0, and shown in a progress bar
    on rank 0 when its stderr is a terminal."""
    trainer = Trainer(opts)
    start, sync = 0, _dp_sync(trainer)
    rank0 = dist.get_rank() == 0
    if opts.resume:
        if checkpoint.latest_step(opts.ckpt_dir) is not None:
            start = checkpoint.load(opts.ckpt_dir, trainer.model, trainer.module, trainer.optimizer,
                                    trainer.full_shapes, sync) + 1
        if rank0:
            print(f"resume: no checkpoint in {opts.ckpt_dir!r}, starting at step 0" if start == 0 else
                  f"resume: from the checkpoint of step {start - 1} in {opts.ckpt_dir!r}" +
                  (f"; it already reaches --steps {opts.steps}: nothing to do" if start >= opts.steps else ""),
                  file=sys.stderr, flush=True)
    losses = []
    log = _open_log(opts.log, start) if opts.log and rank0 else None
    bar = tqdm(range(start, opts.steps), desc=f"tp={opts.tp} pp={opts.pp} dp={opts.dp}", unit="step",
               disable=None if rank0 else True)
    profiler = _profiler(opts, trainer.device)
    try:
        for step in bar:
            _maybe_fail(opts, step, log)
            with record_function(f"capstone::step{step}"):
                st = trainer.step(step)
            if step == opts.steps - 1 or (opts.eval_every and (step + 1) % opts.eval_every == 0):
                with record_function("capstone::validation"):
                    st = dataclasses.replace(st, val_loss=trainer.validation_loss())
            losses.append(st.loss)
            if stats is not None:
                stats.append(st)
            bar.set_postfix(loss=f"{st.loss:.3f}", tok_s=f"{st.tokens_per_s:.0f}", refresh=False)
            if log is not None:
                log.write(json.dumps(dataclasses.asdict(st)) + "\n")
                log.flush()
            if opts.ckpt_every and (step + 1) % opts.ckpt_every == 0:
                checkpoint.save(opts.ckpt_dir, step, trainer.model, trainer.module, trainer.optimizer, sync)
    finally:
        bar.close()
        if log is not None:
            log.close()
        if profiler is not None:
            profiler.__exit__(None, None, None)
            os.makedirs(opts.profile, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(opts.profile, f"rank{dist.get_rank()}.json"))
    return losses


def _profiler(opts: Options, device: torch.device):
    """A started ``torch.profiler.profile`` over every step (CPU, and CUDA on a GPU), or None without --profile.

    The trace shows commlab's own ranges: ``capstone::step<k>``, the pipeline's and the DP wrapper's
    (``overlap::...``), beside torch's operators and the collectives."""
    if not opts.profile:
        return None
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


def _open_log(path: str, start: int):
    """The JSON-lines log, opened for this run's steps: new from step 0; resuming at ``start``, the lines of
    the steps before it kept and those from it on dropped (a run that died after its last checkpoint had
    logged steps that the resumed run now does again)."""
    if start == 0 or not os.path.exists(path):
        return open(path, "w", encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", start) < start]
    log = open(path, "w", encoding="utf-8")
    log.writelines(kept)
    log.flush()
    return log


def _maybe_fail(opts: Options, step: int, log) -> None:
    """``--fail-at-step``: end this rank abruptly (no cleanup, as a crash would) on the first attempt only, so
    that torchrun's restart (``--max-restarts``) runs the job again from its newest checkpoint."""
    if opts.fail_at_step != step or dist.get_rank() != opts.fail_rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if log is not None:
        log.flush()
    print(f"rank {opts.fail_rank}: exiting before step {step} (--fail-at-step, a test of restarts)",
          file=sys.stderr, flush=True)
    os._exit(13)


#: The parts of a step, in the order the summary and the chapter's figure show them.
SPLIT = ("compute_s", "tp_s", "pp_s", "bubble_s", "dp_s", "optimizer_s", "other_s")


def steady_means(stats: Sequence[StepStats]) -> dict[str, float]:
    """Means over the steps after the first (which pays for warm-up) of every timed field of StepStats: means,
    not medians, so that the parts of the split still add up to the step. Tokens/s and MFU are those of the
    mean step."""
    steady = stats[1:] or stats
    keys = ("step_s", "pipeline_s", "exposed_comm_s") + SPLIT
    out = {k: sum(getattr(s, k) for s in steady) / len(steady) for k in keys}
    out["tokens_per_s"] = steady[0].tokens_per_s * steady[0].step_s / out["step_s"]
    out["mfu"] = steady[0].mfu * steady[0].step_s / out["step_s"]
    return out | {"steps": len(steady), "gemm_flop_per_s": steady[0].gemm_flop_per_s}


def _summary(stats: list[StepStats]) -> str:
    """Means of the steps after the first, one line: the step, its split, throughput and MFU."""
    med = steady_means(stats)
    ms = {k: med[k] * 1e3 for k in SPLIT + ("step_s", "exposed_comm_s")}
    above = ("; MFU above 100 %: the GEMM rate measured at start-up was lower than what the steps reached "
             "(a machine busy with other work), so read it as unreliable") if med["mfu"] > 1 else ""
    return (f"step {ms['step_s']:.1f} ms (mean of {med['steps']}): compute {ms['compute_s']:.1f}, "
            f"TP {ms['tp_s']:.1f}, PP {ms['pp_s']:.1f}, bubble {ms['bubble_s']:.1f}, DP {ms['dp_s']:.1f}, "
            f"optimizer {ms['optimizer_s']:.1f}, other {ms['other_s']:.1f} ms "
            f"(exposed communication {ms['exposed_comm_s']:.1f} ms); "
            f"{med['tokens_per_s']:.0f} tokens/s, MFU {100 * med['mfu']:.1f} % of the measured GEMM rate{above}")


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    from commlab.launch import init_from_env
    from commlab.launch.env import read_env
    created = not dist.is_initialized()
    world = dist.get_world_size() if dist.is_initialized() else read_env().world_size
    try:  # before any process group exists: every rank refuses at once, as a usage error
        check_layout(opts.model, opts.tp, opts.pp, opts.dp, world)
        if opts.fail_at_step is not None and not 0 <= opts.fail_rank < world:
            raise ValueError(f"--fail-rank {opts.fail_rank} is not a rank of this world of {world}")
    except ValueError as e:
        hint = "" if world > 1 else (f" (start it with torchrun --nproc-per-node {opts.tp * opts.pp * opts.dp}, "
                                     "or under srun)")
        print(f"labs/capstone/train.py: error: {e}{hint}", file=sys.stderr, flush=True)
        return 2
    ctx = init_from_env(backend=opts.backend)
    stats: list[StepStats] = []
    losses = train(opts, stats)
    if ctx.rank == 0 and losses:
        print(f"tp={opts.tp} pp={opts.pp} dp={opts.dp}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
              f"in {len(losses)} steps; validation loss {stats[-1].val_loss:.4f}", flush=True)
        print(_summary(stats), flush=True)
    if opts.plan and stats:
        from labs.capstone import predict
        device = group_device(None)
        cal = predict.calibrate_here(device, stats[-1].gemm_flop_per_s, ctx.local_world_size)
        if ctx.rank == 0:
            cluster = predict.measured_cluster(cal, opts.dtype, device)
            print(predict.report(opts, cal, steady_means(stats)["step_s"], predict.predict(opts, cluster),
                                 predict.recommend(opts, cluster)), flush=True)
    if created:
        # Every rank leaves together and closes its connections in order, as torch asks: a rank that exits
        # with its gloo pairs still open can make a peer's background thread fail on the closed socket.
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from commlab.launch.env import exit_process
    exit_process(main())
