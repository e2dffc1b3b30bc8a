"""Ring attention beside all-gathered attention (and Ulysses), at a few sequence lengths.

``python -m commlab bench --ring-attention`` runs causal attention, forward and backward, on N gloo ranks
(default 2; ``--backend nccl``: one GPU per rank) three ways: :func:`commlab.parallel.context.ring_attention`
and :func:`commlab.parallel.context.all_gather_attention` (both load-balanced, the same arithmetic per rank,
so their ratio compares the communication schemes) and :func:`commlab.parallel.context.ulysses_attention`
(torch's fused attention, so also a faster kernel). The table: median over rounds of the slowest rank's
time (methods interleaved), ring / all-gather, bytes sent per rank, and ``#wrong`` (ring vs all-gather
elements beyond float32 rounding; must be 0). On a laptop the times measure mostly arithmetic and memory;
the bytes are what a network would carry.

Book: chapter 13, §13.2.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.bench.timing import count_wrong, time_calls
from commlab.launch import launch

__all__ = ["RingAttentionRow", "DEFAULT_SEQS", "bench_ring_attention", "print_ring_attention_bench"]

#: Sequence lengths (tokens, whole sequence) measured by default.
DEFAULT_SEQS = (512, 1024, 2048, 4096)
METHODS = ("ring", "all-gather", "ulysses")


@dataclasses.dataclass(frozen=True)
class RingAttentionRow:
    """One sequence length: seconds per forward + backward call (median, slowest rank) and bytes per rank.

    Attributes:
        seq, world_size, batch, heads, head_dim: the shape (float32). seconds, nbytes: method -> value.
        wrong: elements (over all ranks) where ring attention's output or gradients differ from the
            all-gather's (0 when correct).
    """

    seq: int
    world_size: int
    batch: int
    heads: int
    head_dim: int
    seconds: dict
    nbytes: dict
    wrong: int

    @property
    def ratio(self) -> float:
        """ring / all-gather time (below 1: the ring is faster)."""
        return self.seconds["ring"] / self.seconds["all-gather"]


def _rank(seqs, batch, heads, head_dim, rounds):
    from commlab.launch.device import group_device
    from commlab.parallel.context import (RingAttentionStats, all_gather_attention, ring_attention, shard_sequence,
                                          ulysses_attention)
    from commlab.parallel.context.cost import all_gather_attention_nbytes, ulysses_nbytes

    n, rank = dist.get_world_size(), dist.get_rank()
    device = group_device()   # the rank's own GPU under NCCL, the CPU under gloo
    out = []
    for seq in seqs:
        g = torch.Generator().manual_seed(seq)
        full = [torch.randn(batch, heads, seq, head_dim, generator=g).to(device) for _ in range(4)]
        lb = [shard_sequence(t, rank, n, True) for t in full]
        plain = [shard_sequence(t, rank, n, False) for t in full]
        stats = RingAttentionStats()

        def run(fn, tensors, **kw):
            q, k, v = (t.clone().requires_grad_() for t in tensors[:3])
            o = fn(q, k, v, causal=True, **kw)
            o.backward(tensors[3])
            return [o.detach(), q.grad, k.grad, v.grad]

        calls = {"ring": lambda: run(ring_attention, lb, load_balance=True, stats=stats),
                 "all-gather": lambda: run(all_gather_attention, lb, load_balance=True),
                 "ulysses": lambda: run(ulysses_attention, plain)}
        ring, ag = calls["ring"](), calls["all-gather"]()   # warm-up, bytes and the check
        ring_nbytes = stats.forward_nbytes_sent + stats.backward_nbytes_sent
        calls["ulysses"]()
        wrong = sum(count_wrong(a, b) for a, b in zip(ring, ag))
        times = {m: [] for m in METHODS}
        for _ in range(rounds):
            for m in METHODS:
                times[m].append(time_calls(calls[m], 1, device))
        shape = (batch, seq, heads, head_dim, n, 4)
        out.append(dict(seq=seq, seconds={m: statistics.median(t) for m, t in times.items()},
                        nbytes={"ring": ring_nbytes, "all-gather": sum(all_gather_attention_nbytes(*shape).values()),
                                "ulysses": sum(ulysses_nbytes(*shape).values())}, wrong=wrong))
    return out


def bench_ring_attention(world_size: int = 2, seqs: Sequence[int] = DEFAULT_SEQS, batch: int = 1, heads: int = 4,
                         head_dim: int = 64, rounds: int = 3, timeout: float = 600.0,
                         backend: str = "gloo") -> list[RingAttentionRow]:
    """Measure the three methods at each sequence length on ``world_size`` ranks of ``backend`` (one launch;
    under NCCL each rank on its own GPU).

    Raises:
        ValueError: ``world_size < 2``, ``rounds < 1``, a sequence length not a positive multiple of
            ``2 * world_size``, or ``heads`` not a multiple of ``world_size`` (Ulysses).
    """
    checks.integer("world_size", world_size, 2, note="one rank passes nothing round a ring")
    checks.integer("rounds", rounds)
    bad = [s for s in seqs if not checks.is_int(s) or s < 1 or s % (2 * world_size)]
    if not seqs or bad:
        raise ValueError(f"sequence lengths must be positive multiples of 2N = {2 * world_size} (the load-balanced "
                         f"layout's chunks), got {list(seqs)}")
    if heads % world_size:
        raise ValueError(f"heads ({heads}) must be a multiple of world_size ({world_size}) for Ulysses")
    res = launch(_rank, world_size, list(seqs), batch, heads, head_dim, rounds, timeout=timeout,
                 print_output=False, backend=backend)[0]
    return [RingAttentionRow(d["seq"], world_size, batch, heads, head_dim, d["seconds"], d["nbytes"], d["wrong"])
            for d in res]


def print_ring_attention_bench(world_size: int = 2, seqs: Sequence[int] = DEFAULT_SEQS, rounds: int = 3,
                               backend: str = "gloo") -> int:
    """Print :func:`bench_ring_attention`'s table; return 0, or 1 if ring attention disagreed with the all-gather."""
    rows = bench_ring_attention(world_size, seqs, rounds=rounds, backend=backend)
    r0 = rows[0]
    print(f"# causal attention, forward + backward: batch {r0.batch}, {r0.heads} heads of {r0.head_dim}, float32, "
          f"{world_size} {backend} ranks; median of {rounds} calls (slowest rank); ring and all-gather load-balanced, "
          "Ulysses contiguous", flush=True)
    print(f"#{'':>6} | {'time per call (ms)':^40} | {'bytes sent per rank (KiB)':^32} |")
    print(f"#{'seq':>6} | {'ring':>8} {'all-gather':>10} {'ulysses':>8} {'ring/ag':>8} | {'ring':>10} "
          f"{'all-gather':>10} {'ulysses':>10} | {'#wrong':>6}")
    wrong = 0
    for r in rows:
        ms = {m: r.seconds[m] * 1e3 for m in METHODS}
        kib = {m: r.nbytes[m] / 1024 for m in METHODS}
        print(f" {r.seq:>6} | {ms['ring']:>8.2f} {ms['all-gather']:>10.2f} {ms['ulysses']:>8.2f} {r.ratio:>8.2f} | "
              f"{kib['ring']:>10.1f} {kib['all-gather']:>10.1f} {kib['ulysses']:>10.1f} | {r.wrong:>6}")
        wrong += r.wrong
    print(f"# ring attention vs all-gathered attention, elements that differ: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return 0 if wrong == 0 else 1
