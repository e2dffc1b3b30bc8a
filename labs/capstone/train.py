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
   the model is built whole from the seed, sharded over TP (:func:`model.parallelize`) and cut into PP stages
   (:func:`model.pipeline_stages`); this rank keeps its stage;
3. the stage runs the pipeline schedule (:func:`commlab.parallel.pipeline.pipeline_step`, GPipe or 1F1B) inside
   the data-parallel wrapper's ``no_sync`` (:class:`commlab.overlap.BucketedDataParallel` over the DP group),
   then ``sync_gradients`` averages the stage's gradients over DP once, after the pipeline's flush;
4. the optimizer steps; the loss logged is the global batch's mean (an AllReduce over DP of the pipeline's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: its own folder and the checkout's root on the path
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from commlab.compress import CompressionHookState, PowerSGDState, compression_hook, powersgd_hook  # noqa: E402
from commlab.experiments.corpus import load_corpus  # noqa: E402
from commlab.experiments.methods import compressor_for, parse_spec  # noqa: E402
from commlab.launch.device import group_device  # noqa: E402
from commlab.overlap import BucketedDataParallel  # noqa: E402
from commlab.parallel.mesh import ParallelLayout, build_mesh, mesh_groups  # noqa: E402
from commlab.parallel.pipeline import pipeline_step  # noqa: E402
from labs.capstone import checkpoint  # noqa: E402
from labs.capstone.model import GPTConfig, build_gpt, check_layout, lm_loss, parallelize, pipeline_stages  # noqa: E402

__all__ = ["Options", "parse_args", "Trainer", "global_batch", "main"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


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
    seed: int = 0
    lr: float = 3e-3
    compressor: str = "dense"
    error_feedback: bool = True
    dtype: str = "float32"
    backend: str | None = None
    log: str | None = None
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    resume: bool = False
    model: GPTConfig = GPTConfig()

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all DP ranks."""
        return self.micro_batch * self.micro_batches * self.dp


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default 3e-3)")
    p.add_argument("--compressor", default="dense", metavar="SPEC",
                   help="how the DP dimension averages gradients: dense (default), powersgd:R, topk:RATIO, "
                        "randomk:RATIO, int:8, int:4, qsgd:BITS, sign, cast:bf16, cast:fp16")
    p.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                   help="compress without error feedback (default: with it, for every compressor but the casts)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
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
    args = p.parse_args(argv)
    if (args.ckpt_every or args.resume) and not args.ckpt_dir:
        p.error("--ckpt-every and --resume need --ckpt-dir")
    if args.ckpt_every < 0:
        p.error(f"--ckpt-every must be >= 0, got {args.ckpt_every}")
    for name in ("micro_batch", "micro_batches", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    opts = Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options) if f.name != "model"})
    try:
        check_layout(opts.model, opts.tp, opts.pp, opts.dp)
        parse_spec(opts.compressor)
    except ValueError as e:
        p.error(str(e))
    return opts


def global_batch(step: int, opts: Options, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, the same on every rank: ``(global_batch, block)`` int64 inputs and next-token targets."""
    block = opts.model.block
    g = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
    starts = torch.randint(len(ids) - block - 1, (opts.global_batch,), generator=g)
    x = torch.stack([ids[s:s + block] for s in starts.tolist()])
    y = torch.stack([ids[s + 1:s + block + 1] for s in starts.tolist()])
    return x, y


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
        model = build_gpt(opts.model, opts.seed, DTYPES[opts.dtype]).to(self.device)
        self.full_shapes = {name: p.shape for name, p in model.named_parameters()}
        self.model = parallelize(model, self.groups["tp"])
        self.module = pipeline_stages(model, opts.pp)[self.stage]
        self.dp = BucketedDataParallel(self.module, process_group=self.groups["dp"])
        register_dp_sync(self.dp, opts, self.groups["dp"])
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=opts.lr)
        self.ids = load_corpus().train

    def step(self, step: int) -> float:
        """One optimizer step on the global batch of ``step``; returns its mean loss (nats), the same on every rank."""
        opts = self.opts
        x, y = global_batch(step, opts, self.ids)
        share = opts.micro_batch * opts.micro_batches
        rows = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        x, y = x[rows].to(self.device), y[rows].to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with self.dp.no_sync():
            result = pipeline_step(self.dp, x, y, lm_loss, opts.micro_batches, self.groups["pp"], opts.schedule)
        self.dp.sync_gradients()
        self.optimizer.step()
        loss = torch.tensor([result.loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss, group=self.groups["dp"])
        return float(loss.item()) / opts.dp


def register_dp_sync(dp: BucketedDataParallel, opts: Options, group: dist.ProcessGroup) -> None:
    """Give ``dp`` the comm hook of ``opts.compressor`` over the DP ``group`` (none for dense: the AllReduce).

    PowerSGD (Vogels et al. 2019, Algorithm 1) with its error feedback and warm start, compressing from the
    second step (``start_iter=2``: the first is averaged densely, as torch's hook requires with error feedback);
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
        return
    ef = opts.error_feedback and kind != "cast"
    dp.register_comm_hook(CompressionHookState(compressor_for(opts.compressor, opts.seed), group, ef),
                          compression_hook)


def train(opts: Options) -> list[float]:
    """Run steps up to ``opts.steps`` in the current process group (from the newest checkpoint's next step with
    ``resume``); the losses of the steps it ran, the same on every rank."""
    trainer = Trainer(opts)
    start = 0
    if opts.resume and checkpoint.latest_step(opts.ckpt_dir) is not None:
        start = checkpoint.load(opts.ckpt_dir, trainer.model, trainer.module, trainer.optimizer,
                                trainer.full_shapes) + 1
    losses = []
    log = open(opts.log, "a" if start else "w", encoding="utf-8") if opts.log and dist.get_rank() == 0 else None
    try:
        for step in range(start, opts.steps):
            losses.append(trainer.step(step))
            if log is not None:
                log.write(json.dumps({"step": step, "loss": losses[-1]}) + "\n")
                log.flush()
            if opts.ckpt_every and (step + 1) % opts.ckpt_every == 0:
                checkpoint.save(opts.ckpt_dir, step, trainer.model, trainer.module, trainer.optimizer)
    finally:
        if log is not None:
            log.close()
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    from commlab.launch import init_from_env
    ctx = init_from_env(backend=opts.backend)
    losses = train(opts)
    if ctx.rank == 0:
        print(f"tp={opts.tp} pp={opts.pp} dp={opts.dp}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
              f"in {opts.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
