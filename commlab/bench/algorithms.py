"""Every AllReduce algorithm measured side by side, beside ``dist.all_reduce`` and beside the α-β model.

Two measurements:

* :func:`measure_algorithms` -- ring, halving-doubling, recursive doubling, binomial tree and torch's own
  on the real transport, over message sizes (chapter 3's lab plots them against the model);
* :func:`measure_emulated` -- on an :class:`~commlab.topology.EmulatedTopology` (say 2 nodes × 4 ranks
  with a slow inter-node link): a ring ordered against the topology, a ring in topology order, and the
  hierarchical algorithm, beside :meth:`EmulatedTopology.predict_ring_seconds` and
  :meth:`~EmulatedTopology.predict_hierarchical_seconds`.

Method (as :mod:`commlab.bench.allreduce` and :mod:`commlab.bench.calibrate`): ``rounds`` rounds, each one
launch that times every (algorithm, size) once -- a correctness check against ``dist.all_reduce`` on
random data, a warm-up call, a barrier, then enough back-to-back calls to carry about 2 MiB, on a zero-filled
buffer reduced in place; a round's time is the slowest rank's; the reported time is the median over rounds.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from commlab.collectives import (hierarchical_all_reduce, make_hierarchy_groups, recursive_doubling_all_reduce,
                                 rhd_all_reduce, ring_all_reduce, tree_all_reduce)
from commlab.bench.timing import calls_per_round, count_wrong, time_calls
from commlab.launch import launch
from commlab.topology.emulated import EmulatedTopology
from commlab.topology.links import Link
from commlab.topology.ring_order import topology_aware_ring

#: name -> in-place AllReduce of a float32 buffer, run inside a rank.
# The benchmarks all-reduce float32 tensors; bytes per element from the dtype.
_DTYPE = torch.float32
_ITEMSIZE = torch.empty((), dtype=_DTYPE).element_size()

ALGORITHMS: dict[str, Callable[[torch.Tensor], object]] = {
    "ring": lambda buf: ring_all_reduce(buf, inplace=True, check=False),
    "halving-doubling": lambda buf: rhd_all_reduce(buf, inplace=True, check=False),
    "recursive doubling": lambda buf: recursive_doubling_all_reduce(buf, inplace=True, check=False),
    "binomial tree": lambda buf: tree_all_reduce(buf, inplace=True, check=False),
    "torch": lambda buf: dist.all_reduce(buf),
}

EMULATED_VARIANTS = ("ring, round-robin order", "ring, topology order", "hierarchical")


@dataclasses.dataclass(frozen=True)
class AlgorithmTime:
    """One algorithm at one size: median seconds over rounds, the fastest and slowest round, and how many
    elements disagreed with ``dist.all_reduce`` (relative 1e-5)."""

    algorithm: str
    nbytes: int
    world_size: int
    seconds: float
    min_s: float
    max_s: float
    wrong: int


def _wrong(fn: Callable[[torch.Tensor], object], count: int) -> int:
    data = torch.randn(count, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=_DTYPE)
    ref = data.clone()
    dist.all_reduce(ref)
    fn(data)
    return count_wrong(data, ref)


def _algorithms_round(names: Sequence[str], sizes: Sequence[int]):
    out = {}
    for nbytes in sizes:
        count = nbytes // _ITEMSIZE
        for name in names:
            fn = ALGORITHMS[name]
            wrong = _wrong(fn, count)
            buf = torch.zeros(count, dtype=_DTYPE)
            fn(buf)  # warm-up
            out[(name, nbytes)] = (time_calls(lambda: fn(buf), calls_per_round(nbytes, 2 * 2**20, 50)), wrong)
    return out


def measure_algorithms(world_size: int = 4, sizes: Iterable[int] = tuple(4**k * 1024 for k in range(8)),
                       algorithms: Sequence[str] = tuple(ALGORITHMS), rounds: int = 3,
                       progress: bool = True, timeout: float = 300.0) -> list[AlgorithmTime]:
    """Time each algorithm at each size on ``world_size`` gloo ranks.

    Args:
        world_size: ranks (>= 1). sizes: bytes (>= 4 each; float32 elements). algorithms: names from
        :data:`ALGORITHMS`. rounds: >= 1. progress: print a line per round. timeout: seconds per round.

    Returns:
        One :class:`AlgorithmTime` per (algorithm, size), sizes in the order given.

    Raises:
        KeyError: an unknown algorithm (the message lists the known ones). ValueError: bad sizes/rounds.
    """
    sizes, names = list(sizes), list(algorithms)
    unknown = [a for a in names if a not in ALGORITHMS]
    if unknown:
        raise KeyError(f"unknown algorithms {unknown}; known: {list(ALGORITHMS)}")
    if not sizes or min(sizes) < 4 or rounds < 1:
        raise ValueError(f"need sizes >= 4 bytes and rounds >= 1, got sizes={sizes}, rounds={rounds}")
    samples: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for r in range(rounds):
        if progress:
            print(f"round {r + 1}/{rounds}: {len(names)} algorithms x {len(sizes)} sizes on {world_size} ranks",
                  flush=True)
        result = launch(_algorithms_round, world_size, names, sizes, timeout=timeout, print_output=False)[0]
        for key, value in result.items():
            samples.setdefault(key, []).append(value)
    rows = []
    for nbytes in sizes:
        for name in names:
            times = [t for t, _ in samples[(name, nbytes)]]
            rows.append(AlgorithmTime(name, nbytes // _ITEMSIZE * _ITEMSIZE, world_size, statistics.median(times),
                                      min(times), max(times), max(w for _, w in samples[(name, nbytes)])))
    return rows


def _emulated_round(topology: EmulatedTopology, nbytes: int, variants: Sequence[str]):
    groups = make_hierarchy_groups(topology.placement)
    placement = list(topology.placement)
    orders = {"ring, round-robin order": topology.round_robin_ring(),
              "ring, topology order": topology_aware_ring(placement)}
    count = nbytes // _ITEMSIZE
    out = {}
    for variant in variants:
        if variant == "hierarchical":
            def fn(buf):
                return hierarchical_all_reduce(buf, groups, inplace=True, check=False, emulate=topology)
        else:
            order = orders[variant]

            def fn(buf, order=order):
                return ring_all_reduce(buf, ring=order, inplace=True, check=False, emulate=topology)
        wrong = _wrong(fn, count)
        buf = torch.zeros(count, dtype=_DTYPE)
        fn(buf)  # warm-up
        dist.barrier()
        if dist.get_rank() == 0:
            topology.reset()  # queued NIC time from the warm-up is not this measurement's
        out[variant] = (time_calls(lambda: fn(buf), 1), wrong)
    return out


def measure_emulated(topology: EmulatedTopology, nbytes: int = 16 * 2**20,
                     variants: Sequence[str] = EMULATED_VARIANTS, rounds: int = 3, progress: bool = True,
                     timeout: float = 300.0) -> dict[str, AlgorithmTime]:
    """Time each variant of :data:`EMULATED_VARIANTS` on ``topology`` (one rank per emulated device).

    Returns:
        ``{variant: AlgorithmTime}`` (median of ``rounds`` rounds).

    Raises:
        KeyError: an unknown variant. ValueError: ``nbytes < 4`` or ``rounds < 1``.
    """
    unknown = [v for v in variants if v not in EMULATED_VARIANTS]
    if unknown:
        raise KeyError(f"unknown variants {unknown}; known: {list(EMULATED_VARIANTS)}")
    if nbytes < 4 or rounds < 1:
        raise ValueError(f"need nbytes >= 4 and rounds >= 1, got {nbytes}, {rounds}")
    samples: dict[str, list[tuple[float, int]]] = {v: [] for v in variants}
    for r in range(rounds):
        if progress:
            print(f"round {r + 1}/{rounds}: {len(variants)} variants on {topology}", flush=True)
        result = launch(_emulated_round, topology.world_size, topology, nbytes, list(variants), timeout=timeout,
                        print_output=False)[0]
        for v, value in result.items():
            samples[v].append(value)
    return {v: AlgorithmTime(v, nbytes // _ITEMSIZE * _ITEMSIZE, topology.world_size,
                             statistics.median(t for t, _ in s), min(t for t, _ in s), max(t for t, _ in s),
                             max(w for _, w in s))
            for v, s in samples.items()}


def predict_emulated(topology: EmulatedTopology, nbytes: int, local: Link,
                     variants: Sequence[str] = EMULATED_VARIANTS) -> dict[str, float]:
    """The model's seconds for each variant of :func:`measure_emulated` (``local``: the machine's own
    calibrated link)."""
    placement = list(topology.placement)
    out = {}
    for v in variants:
        if v == "hierarchical":
            out[v] = topology.predict_hierarchical_seconds(nbytes, local)
        elif v == "ring, topology order":
            out[v] = topology.predict_ring_seconds(nbytes, topology_aware_ring(placement), local)
        elif v == "ring, round-robin order":
            out[v] = topology.predict_ring_seconds(nbytes, topology.round_robin_ring(), local)
        else:
            raise KeyError(f"unknown variant {v!r}; known: {list(EMULATED_VARIANTS)}")
    return out
