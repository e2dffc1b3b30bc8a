"""algbw and busbw exactly as nccl-tests defines them.

Source: NVIDIA nccl-tests, ``doc/PERFORMANCE.md``. For a collective on S bytes that takes t seconds:
``algbw = S / t``; ``busbw = algbw * factor``, where the factor makes busbw comparable to the
per-direction link bandwidth a ring would need: AllReduce 2(n-1)/n, ReduceScatter and AllGather (n-1)/n
(S being the full, gathered size), Broadcast and Reduce 1.

AlltoAll, which ``PERFORMANCE.md`` does not list: nccl-tests' ``src/alltoall.cu`` (``AlltoAllGetBw``) takes S
as one rank's whole send buffer (N blocks, ``count * nranks * typesize``) and the factor (n-1)/n, since
each rank's own block does not cross a link: every rank sends (n-1)/n of S and receives as much.
"""

from __future__ import annotations

import re

BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # S: one rank's whole send buffer (nccl-tests, src/alltoall.cu)
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def algbw_bytes_per_s(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth S/t in bytes/s. Raises ValueError if ``seconds <= 0`` or ``nbytes < 0``."""
    if seconds <= 0 or nbytes < 0:
        raise ValueError(f"need seconds > 0 and nbytes >= 0, got seconds={seconds}, nbytes={nbytes}")
    return nbytes / seconds


def busbw_bytes_per_s(nbytes: float, seconds: float, n: int, collective: str = "all_reduce") -> float:
    """Bus bandwidth in bytes/s: algbw times the collective's factor for ``n`` ranks.

    Raises:
        ValueError: unknown ``collective``, ``n < 1``, or bad ``nbytes``/``seconds``.
    """
    if collective not in BUSBW_FACTORS:
        raise ValueError(f"collective must be one of {sorted(BUSBW_FACTORS)}, got {collective!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return algbw_bytes_per_s(nbytes, seconds) * BUSBW_FACTORS[collective](n)


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """Parse ``"64K"``, ``"16MiB"``, ``"1024"`` into bytes (K/M/G are binary, as in nccl-tests' -b/-e).

    Raises:
        ValueError: the text is not a number with an optional K/M/G suffix.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?I?B?)\s*", str(text).upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 1024, 64K, 16M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2)]
