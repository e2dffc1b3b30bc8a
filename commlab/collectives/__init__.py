"""Collectives built from point-to-point sends, each with its α-β cost function beside it."""

from commlab.collectives._common import (SUPPORTED_DTYPES, CollectiveMismatchError, chunk_bounds,
                                         ring_geometry)
from commlab.collectives.ring import (ring_all_gather, ring_all_gather_seconds, ring_all_reduce,
                                      ring_all_reduce_seconds, ring_bytes_sent_per_rank,
                                      ring_reduce_scatter, ring_reduce_scatter_seconds)

__all__ = [
    "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
    "ring_reduce_scatter_seconds", "ring_all_gather_seconds", "ring_all_reduce_seconds",
    "ring_bytes_sent_per_rank", "chunk_bounds", "ring_geometry", "CollectiveMismatchError",
    "SUPPORTED_DTYPES",
]
