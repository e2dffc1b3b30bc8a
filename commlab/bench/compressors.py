"""Compressors beside the torch primitives they rest on, and our PowerSGD hook beside PyTorch's.

``python -m commlab bench --compressors`` prints two measurements: the throughput of
``decompress(compress(x))`` on one large float32 tensor (default 16 Mi elements), in GB/s of dense input,
for every compressor beside the bare torch operations it is built on and beside ``y.copy_(x)``, the memory
bound (ours / torch is the price of the checks, packing and bookkeeping; median of ``repeats``, the three
timed in turn); and the median DDP step time with ``powersgd_hook`` and PyTorch's ``powerSGD_hook``
(:func:`bench_powersgd_ddp`, alternated on ``world_size`` gloo ranks).

Book: chapters 4 to 7 (the codecs), chapter 7, §7.8 (the hooks).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence

import torch

__all__ = ["ThroughputRow", "bench_compressor_throughput", "bench_powersgd_ddp", "print_compressor_bench"]


@dataclasses.dataclass(frozen=True)
class ThroughputRow:
    """One compressor: seconds per round trip (ours, the torch primitive, a copy_), GB/s of dense input."""

    name: str
    primitive: str
    seconds: float
    primitive_seconds: float
    nbytes: int
    payload_nbytes: int
    copy_seconds: float = math.nan

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def primitive_gb_per_s(self) -> float:
        return self.nbytes / self.primitive_seconds / 1e9

    @property
    def copy_gb_per_s(self) -> float:
        """GB/s of ``y.copy_(x)`` on the same tensor, timed beside this row (NaN if not measured)."""
        return self.nbytes / self.copy_seconds / 1e9

    @property
    def ratio(self) -> float:
        """our time / primitive time (1.0 = no overhead)."""
        return self.seconds / self.primitive_seconds

    @property
    def copy_ratio(self) -> float:
        """our time / the time of a copy_ of the same tensor (the memory bound; >= 1 in practice)."""
        return self.seconds / self.copy_seconds


def _median_seconds(fns: Sequence[Callable[[], object]], repeats: int, device: torch.device) -> list[float]:
    """Median seconds of each of ``fns``, timed in turn within each of ``repeats`` rounds after one warm-up."""
    # On a GPU the kernels run asynchronously: synchronise before reading the clock, so that the work is
    # timed and not its launch.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:
        fn()  # warm-up: allocator, lazy initialisation
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats):
        # Alternate the order too, so that neither always runs first after the other's memory traffic.
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            t0 = time.perf_counter()
            fns[j]()
            sync()
            times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _candidates(x: torch.Tensor, ratio: float):
    """(compressor, primitive name, primitive function) for each compressor that can be imported."""
    from commlab.compress.cast import CastCompressor

    n = x.numel()
    k = max(1, int(n * ratio))
    out = [(CastCompressor(torch.float16), "x.to(fp16).to(fp32)", lambda: x.to(torch.float16).to(torch.float32)),
           (CastCompressor(torch.bfloat16), "x.to(bf16).to(fp32)", lambda: x.to(torch.bfloat16).to(torch.float32))]

    def topk_prim():
        idx = x.abs().topk(k).indices
        return torch.zeros_like(x).index_copy_(0, idx, x.index_select(0, idx))

    def randk_prim():
        idx = torch.randperm(n, device=x.device)[:k]
        return torch.zeros_like(x).index_copy_(0, idx, x.index_select(0, idx))

    def sign_prim():
        return torch.sign(x) * x.abs().mean()

    def round_prim():
        scale = x.abs().max() / 127
        return torch.round(x / scale).to(torch.int8).to(torch.float32) * scale

    def qsgd_prim():
        # One norm per bucket of 512, as QSGD's default (one bucket if 512 does not divide the size).
        v = x.view(-1, 512) if n % 512 == 0 else x.view(1, -1)
        norm = v.norm(dim=1, keepdim=True)
        r = v.abs() / norm * 7
        level = torch.floor(r + torch.rand_like(r))
        return (torch.sign(v) * level * norm / 7).view(-1)

    makers = [("sparse", "TopK", dict(ratio=ratio), "torch.topk + index_copy_", topk_prim),
              ("sparse", "RandomK", dict(ratio=ratio), "torch.randperm + index_select", randk_prim),
              ("quantize", "QSGD", dict(), "norms of 512, floor(r + rand), sign", qsgd_prim),
              ("quantize", "RoundingQuantizer", dict(bits=8), "round(x / scale).to(int8)", round_prim),
              ("sign", "SignCompressor", dict(), "torch.sign(x) * mean|x|", sign_prim)]
    import importlib
    for module, cls, kwargs, prim_name, prim in makers:
        try:
            c = getattr(importlib.import_module(f"commlab.compress.{module}"), cls)(**kwargs)
        except (ImportError, AttributeError, TypeError, ValueError):
            continue  # not written yet, or a different constructor: skip it rather than guess
        out.append((c, prim_name, prim))
    return out


def bench_compressor_throughput(numel: int = 16 * 2 ** 20, repeats: int = 3, ratio: float = 0.01,
                                seed: int = 0, device: torch.device | str = "cpu") -> list[ThroughputRow]:
    """Time ``decompress(compress(x))`` of each compressor and its torch primitive on ``numel`` float32 values.

    Args:
        numel: elements of the random normal input (default 16 Mi: 64 MiB, far beyond the caches).
        repeats: timed runs; the median is reported.
        ratio: kept fraction for the sparsifiers (default 1 %).
        device: where the tensor lives and the work runs (``"cuda"``: the current GPU; the clock is read
            after ``torch.cuda.synchronize``).

    Raises:
        ValueError: ``numel`` < 1 or ``repeats`` < 1. RuntimeError: ``device`` is CUDA and none is available.
    """
    if numel < 1 or repeats < 1:
        raise ValueError(f"need numel >= 1 and repeats >= 1, got numel={numel}, repeats={repeats}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for and no CUDA GPU is visible")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(device)
    y = torch.empty_like(x)
    rows = []
    for comp, prim_name, prim in _candidates(x, ratio):
        payload = comp.compress(x)
        seconds, prim_seconds, copy_seconds = _median_seconds(
            [lambda: comp.decompress(comp.compress(x)), prim, lambda: y.copy_(x)], repeats, device)
        rows.append(ThroughputRow(comp.name, prim_name, seconds, prim_seconds, x.numel() * x.element_size(),
                                  payload.nbytes, copy_seconds))
    return rows


def _ddp_steps(hidden: int, steps: int, rank_r: int, warmup: int):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commlab.compress.hooks import powersgd_hook
    from commlab.compress.powersgd import PowerSGDState
    from commlab.train import DigitsMLP

    torch.manual_seed(dist.get_rank())
    x = torch.randn(64, 64)
    y = torch.randint(0, 10, (64,))
    runs = {}
    for name in ("ours", "torch"):
        model = DigitsMLP(64, hidden, 10)
        # One bucket (an explicit cap also sets the first bucket's, 1 MB by default): PyTorch's hook aborts with
        # several buckets on gloo (see tests/test_powersgd_hooks.py).
        ddp = DDP(model, bucket_cap_mb=64)
        if name == "ours":
            ddp.register_comm_hook(PowerSGDState(rank=rank_r, start_iter=2), powersgd_hook)
        else:
            ddp.register_comm_hook(torch_psgd.PowerSGDState(None, matrix_approximation_rank=rank_r,
                                                            start_powerSGD_iter=2), torch_psgd.powerSGD_hook)
        runs[name] = (model, ddp, torch.optim.SGD(model.parameters(), lr=0.01))
    times = {"ours": [], "torch": []}
    for step in range(warmup + steps):
        for name in (("ours", "torch") if step % 2 == 0 else ("torch", "ours")):
            model, ddp, opt = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_powersgd_ddp(world_size: int = 2, hidden: int = 1024, steps: int = 20, rank: int = 2,
                       warmup: int = 4, timeout: float = 300) -> dict[str, float]:
    """Median seconds per DDP step with our ``powersgd_hook`` and with PyTorch's, on gloo ranks.

    The model is :class:`commlab.train.DigitsMLP` ``64 -> hidden -> hidden -> 10`` (hidden 1024: 1.1 M
    parameters), batch 64; PowerSGD rank ``rank``, start_iter 2 (so ``warmup`` >= 2 steps run uncompressed
    and are not timed). Returns ``{"ours": s, "torch": s}`` from rank 0 (the slowest rank sets the pace,
    and a barrier starts every step together).
    """
    from commlab.launch import launch

    if warmup < 2:
        raise ValueError(f"warmup must be >= 2 (PowerSGD starts at step 2), got {warmup}")
    return launch(_ddp_steps, world_size, hidden, steps, rank, warmup, timeout=timeout)[0]


def print_compressor_bench(world_size: int = 2, numel: int = 16 * 2 ** 20, repeats: int = 3,
                           device: torch.device | str = "cpu") -> int:
    """Print both measurements (the throughput on ``device``, the DDP steps on gloo CPU ranks); return 0."""
    device = torch.device(device)
    where = f"{torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"# compress + decompress of {numel} float32 ({numel * 4 / 2 ** 20:.3g} MiB) on {device}, "
          f"median of {repeats}, {where}")
    rows = bench_compressor_throughput(numel, repeats, device=device)
    print(f"#{'compressor':>22} {'ratio':>6} {'ours GB/s':>10} {'torch GB/s':>11} {'ours/torch':>11} "
          f"{'ours/copy_':>11}  torch primitive")
    copy = statistics.median(r.copy_seconds for r in rows)
    print(f" {'copy_':>22} {1.0:>6.1f} {rows[0].nbytes / copy / 1e9:>10.2f} {'':>11} {'':>11} {1.0:>11.2f}  "
          f"y.copy_(x), the memory bound (median over the rows' runs)")
    for r in rows:
        print(f" {r.name:>22} {r.nbytes / max(r.payload_nbytes, 1):>6.1f} {r.gb_per_s:>10.2f} "
              f"{r.primitive_gb_per_s:>11.2f} {r.ratio:>11.2f} {r.copy_ratio:>11.2f}  {r.primitive}")
    worst = max(rows, key=lambda r: r.ratio)
    print(f"# slowest against its primitive: {worst.name}, {worst.ratio:.2f} (aim: <= 1.5)")
    t = bench_powersgd_ddp(world_size)
    print(f"# DDP step, MLP 64-1024-1024-10, PowerSGD rank 2, {world_size} gloo ranks, median of 20 steps")
    print(f"#{'hook':>20} {'ms/step':>9}")
    print(f" {'commlab powersgd':>20} {t['ours'] * 1e3:>9.2f}")
    print(f" {'torch powerSGD':>20} {t['torch'] * 1e3:>9.2f}")
    print(f"# ours / torch: {t['ours'] / t['torch']:.2f} (aim: <= 1.2)")
    return 0
