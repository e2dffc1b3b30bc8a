"""``python -m commlab selftest``: check commlab on the world it finds, against torch and a single process.

Under torchrun, ``srun`` or ``srun torchrun`` it checks the job's world; under plain ``python`` it forks
``-n`` ranks (default 4) through :func:`commlab.launch.launch`. It checks:

* the ring AllReduce against ``dist.all_reduce`` (0 to 65539 float32 elements, 13 int64), relative error;
* a 2-D mesh (``build_mesh``; TP 2 when the world and processes per node are even, else 1): every TP group
  in one node, and a tensor-parallel MLP against the single-process one (output, gradients; float64);
* one :class:`~commlab.overlap.BucketedDataParallel` step over the DP groups against the whole batch's
  gradient in one process (float64).

Rank 0 prints a table (check, result, max error, tolerance); the exit status is 0 when all pass. Under a
launcher a failure raises :class:`SelftestFailed` on every rank, and torchrun's ``record`` puts the root
cause in its error file. ``--fail-rank R`` makes rank R raise after the first check, to see a failure.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

from commlab.bench.timing import max_over_ranks
from commlab.collectives import ring_all_reduce
from commlab.launch import group_device, launch, read_env
from commlab.launch.env import detect_launcher
from commlab.launch.inprocess import runs_in_process
from commlab.overlap import BucketedDataParallel
from commlab.parallel.mesh import ParallelLayout, build_mesh, mesh_groups
from commlab.parallel.tensor import ParallelMLP, TransformerMLP

__all__ = ["Check", "SelftestFailed", "run_checks", "format_table", "main", "RING_SIZES", "max_over_world"]

#: Element counts of the ring AllReduce check (float32): empty, one, odd and not divisible by small worlds.
RING_SIZES = (0, 1, 7, 1023, 65539)
_FLOAT32_TOL = 1e-5   # relative: N float32 terms summed in another order
_FLOAT64_TOL = 1e-10  # absolute, float64 layers of size ~10


class SelftestFailed(RuntimeError):
    """At least one selftest check failed (the message names them with their errors)."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One row of the table: the largest error over every rank, and the bound it must stay within."""

    name: str
    max_error: float
    tolerance: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance


def max_over_world(value: float, device: torch.device) -> float:
    """The largest ``value`` over every rank of the default group (an AllReduce MAX of one float64 on
    ``device``, the group's device); every rank must call it and gets the same number."""
    return max_over_ranks([value], device)[0]


def _ring_checks(device: torch.device) -> list[Check]:
    rank = dist.get_rank()
    rows = []
    for count in RING_SIZES:
        g = torch.Generator().manual_seed(1000 * rank + count)
        x = torch.randn(count, generator=g, dtype=torch.float32).to(device)
        ref = x.clone()
        dist.all_reduce(ref)
        got = ring_all_reduce(x)
        scale = ref.abs().max().item() if count else 1.0
        err = (got - ref).abs().max().item() / max(scale, 1e-30) if count else 0.0
        rows.append(Check(f"ring AllReduce, {count} x float32", max_over_world(err, device), _FLOAT32_TOL,
                          "vs dist.all_reduce"))
    x = torch.arange(13, dtype=torch.int64, device=device) * (rank + 1) - 5
    ref = x.clone()
    dist.all_reduce(ref)
    err = float((ring_all_reduce(x) - ref).abs().max().item())
    rows.append(Check("ring AllReduce, 13 x int64", max_over_world(err, device), 0.0, "vs dist.all_reduce"))
    return rows


def _mesh_layout(world: int, local_world: int) -> ParallelLayout:
    tp = 2 if world % 2 == 0 and local_world % 2 == 0 else 1
    return ParallelLayout(dp=world // tp, pp=1, tp=tp, devices_per_node=local_world)


def _mesh_checks(device: torch.device, local_world: int, node_rank: int) -> tuple[list[Check], dict]:
    world = dist.get_world_size()
    layout = _mesh_layout(world, local_world)
    mesh = build_mesh(layout)
    groups = mesh_groups(mesh)
    # Every TP group inside one node, by the node ranks the launcher gave (not by arithmetic).
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node_rank)
    split = [g for g in layout.groups("tp") if len({nodes[r] for r in g}) > 1]
    name = f"mesh {layout.dp} (DP) x {layout.tp} (TP): TP groups inside a node"
    rows = [Check(name, float(len(split)), 0.0, f"{len(split)} TP group(s) span nodes" if split else
                  f"{len(layout.groups('tp'))} TP group(s) of {layout.tp}")]
    rows += _tp_checks(groups["tp"], layout, device)
    return rows, groups


def _tp_checks(tp_group, layout: ParallelLayout, device: torch.device) -> list[Check]:
    hidden, ffn = 8, 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        full = TransformerMLP(hidden, ffn, dtype=torch.float64)
    par = ParallelMLP(full, tp_group).to(device)
    full = full.to(device)
    dp_index = layout.coords(dist.get_rank())[0]  # the same input on every rank of one TP group
    g = torch.Generator().manual_seed(100 + dp_index)
    x = torch.randn(3, 5, hidden, generator=g, dtype=torch.float64)
    upstream = torch.randn(3, 5, hidden, generator=g, dtype=torch.float64).to(device)
    x_par = x.clone().to(device).requires_grad_(True)
    x_ref = x.clone().to(device).requires_grad_(True)
    y_par, y_ref = par(x_par), full(x_ref)
    (y_par * upstream).sum().backward()
    (y_ref * upstream).sum().backward()
    errs = {
        "output": (y_par - y_ref).abs().max().item(),
        "input gradient": (x_par.grad - x_ref.grad).abs().max().item(),
    }
    grad_err = 0.0
    for mine, ref in ((par.fc1, full.fc1), (par.fc2, full.fc2)):
        grad_err = max(grad_err, (mine.full_weight(grad=True) - ref.weight.grad).abs().max().item(),
                       (mine.full_bias(grad=True) - ref.bias.grad).abs().max().item())
    errs["weight gradients"] = grad_err
    return [Check(f"TP MLP (tp={layout.tp}, float64) {what}", max_over_world(e, device), _FLOAT64_TOL,
                  "vs the full MLP") for what, e in errs.items()]


def _dp_check(dp_group, device: torch.device) -> Check:
    per_rank = 4
    dp = dist.get_world_size(dp_group)
    me = dist.get_rank(dp_group)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
    reference = copy.deepcopy(model).to(device)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(per_rank * dp, 6, generator=g, dtype=torch.float64).to(device)
    y = torch.randn(per_rank * dp, 3, generator=g, dtype=torch.float64).to(device)
    wrapped = BucketedDataParallel(model.to(device), bucket_cap_bytes=64, process_group=dp_group)
    shard = slice(me * per_rank, (me + 1) * per_rank)
    nn.functional.mse_loss(wrapped(x[shard]), y[shard]).backward()  # equal shards: mean of means = mean
    nn.functional.mse_loss(reference(x), y).backward()
    err = max((p.grad - q.grad).abs().max().item()
              for p, q in zip(wrapped.module.parameters(), reference.parameters()))
    return Check(f"BucketedDataParallel step (dp={dp}, {len(wrapped.buckets)} buckets, float64)",
                 max_over_world(err, device), _FLOAT64_TOL, "vs the whole batch in one process")


def run_checks(fail_rank: int | None = None) -> list[Check]:
    """Every check, on the initialised default group; every rank must call it. Returns the same rows on
    every rank (each error is the largest over all ranks)."""
    device = group_device()
    rows = _ring_checks(device)
    if fail_rank is not None and dist.get_rank() == fail_rank:
        raise RuntimeError(f"selftest: rank {fail_rank} fails on purpose (--fail-rank {fail_rank})")
    env = read_env()
    local_world = env.local_world_size or dist.get_world_size()
    node_rank = env.node_rank if env.node_rank is not None else 0
    if detect_launcher() == "commlab.launch":  # forked ranks: one node holding all of them
        local_world, node_rank = dist.get_world_size(), 0
    mesh_rows, groups = _mesh_checks(device, local_world, node_rank)
    rows += mesh_rows
    rows.append(_dp_check(groups["dp"], device))
    return rows


def _rank_main(fail_rank: int | None) -> list[Check]:
    return run_checks(fail_rank)


def format_table(rows: list[Check], world: int, backend: str, launcher: str) -> str:
    """The table rank 0 prints."""
    width = max(len(r.name) for r in rows)
    lines = [f"# commlab selftest: {world} rank(s), backend {backend}, launcher {launcher}",
             f"{'check':<{width}}  {'result':<6}  {'max error':>10}  {'tolerance':>9}  detail"]
    for r in rows:
        tolerance = f"{r.tolerance:.0e}" if r.tolerance else "exact"
        lines.append(f"{r.name:<{width}}  {'ok' if r.ok else 'FAILED':<6}  {r.max_error:>10.3g}  "
                     f"{tolerance:>9}  {r.detail}")
    bad = [r for r in rows if not r.ok]
    lines.append(f"# {len(rows) - len(bad)} of {len(rows)} checks passed" + ("" if not bad else
                 ": FAILED " + "; ".join(r.name for r in bad)))
    return "\n".join(lines)


def _seconds(text: str) -> float:
    # argparse reports the ValueError's message as "argument --timeout: invalid _seconds value" unless it is
    # an ArgumentTypeError.
    from commlab.launch.env import check_timeout
    try:
        return check_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}") from None


@record
def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m commlab selftest``; returns the exit status (0: every check passed)."""
    parser = argparse.ArgumentParser(prog="python -m commlab selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--world-size", type=int, default=None,
                        help="ranks to fork when no launcher started this process (default 4); under torchrun "
                             "or srun the job's world is used and this must match it if given")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="auto (default): NCCL under a launcher when CUDA is available, else gloo")
    parser.add_argument("--timeout", type=_seconds, default=120.0,
                        help="seconds (default 120): with forked ranks, for the whole check; under torchrun or "
                             "srun, for each collective and for a finished rank's wait for the others")
    parser.add_argument("--fail-rank", type=int, default=None, metavar="R",
                        help="make rank R raise after the first check (to see how a failure is reported)")
    args = parser.parse_args(argv)
    in_process = runs_in_process()
    if in_process:
        job = read_env()
        world = job.world_size
        if args.world_size is not None and args.world_size != world:
            parser.error(f"-n {args.world_size} does not match the job's {world} ranks ({job.launcher})")
        printer = job.rank == 0
    else:
        world = 4 if args.world_size is None else args.world_size
        printer = True
    if world < 1:
        parser.error("-n must be >= 1")
    if args.fail_rank is not None and not 0 <= args.fail_rank < world:
        parser.error(f"--fail-rank must be a rank 0..{world - 1}")
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if in_process and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        from commlab.launch.device import nccl_gpu_problem
        problem = nccl_gpu_problem(None if in_process else world)
        if problem is not None:
            parser.error(problem)
    rows = launch(_rank_main, world, args.fail_rank, backend=backend, timeout=args.timeout)[0]
    launcher = read_env().launcher if in_process else "commlab.launch (forked ranks)"
    if printer:
        print(format_table(rows, world, backend, launcher), flush=True)
    bad = [r for r in rows if not r.ok]
    if bad and in_process:
        raise SelftestFailed(f"{len(bad)} of {len(rows)} selftest checks failed: " +
                             "; ".join(f"{r.name}: max error {r.max_error:.3g} > {r.tolerance:.0e}" for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    from commlab.launch.env import exit_process
    exit_process(main())
