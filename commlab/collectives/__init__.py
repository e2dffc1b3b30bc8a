"""Collectives built from point-to-point sends, each with its α-β cost function beside it."""

from commlab.collectives.common import SUPPORTED_DTYPES, chunk_bounds, ring_geometry
from commlab.collectives.agreement import CollectiveMismatchError, agree
from commlab.collectives.ring import (ring_all_gather, ring_all_gather_seconds, ring_all_reduce,
                                      ring_all_reduce_seconds, ring_bytes_sent_per_rank,
                                      ring_reduce_scatter, ring_reduce_scatter_seconds)

__all__ = [
    "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
    "ring_reduce_scatter_seconds", "ring_all_gather_seconds", "ring_all_reduce_seconds",
    "ring_bytes_sent_per_rank", "chunk_bounds", "ring_geometry", "CollectiveMismatchError", "agree",
    "SUPPORTED_DTYPES",
]
from commlab.collectives.halving_doubling import (rhd_all_reduce, rhd_all_reduce_seconds,
                                                  recursive_doubling_all_reduce,
                                                  recursive_doubling_all_reduce_seconds)
from commlab.collectives.tree import (binomial_tree_all_reduce_seconds,
                                      double_binary_tree_all_reduce_seconds, optimal_pipeline_chunks,
                                      pipelined_binary_tree_all_reduce_seconds, tree_all_reduce)
from commlab.collectives.all_to_all import (all_to_all, all_to_all_seconds, all_to_all_v, all_to_all_v_seconds,
                                            two_level_all_to_all_seconds)
from commlab.collectives.hierarchical import (HierarchyGroups, hierarchical_all_reduce,
                                              hierarchical_all_reduce_seconds, make_hierarchy_groups,
                                              ring_all_reduce_seconds_on)

__all__ += [
    "rhd_all_reduce", "recursive_doubling_all_reduce", "rhd_all_reduce_seconds",
    "recursive_doubling_all_reduce_seconds",
    "tree_all_reduce", "binomial_tree_all_reduce_seconds", "pipelined_binary_tree_all_reduce_seconds",
    "double_binary_tree_all_reduce_seconds", "optimal_pipeline_chunks",
    "HierarchyGroups", "make_hierarchy_groups", "hierarchical_all_reduce",
    "hierarchical_all_reduce_seconds", "ring_all_reduce_seconds_on", "all_to_all", "all_to_all_seconds",
    "all_to_all_v", "all_to_all_v_seconds", "two_level_all_to_all_seconds",
]
