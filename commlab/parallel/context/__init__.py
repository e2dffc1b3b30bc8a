"""Context parallelism (layer 5): attention over a sequence split across the ranks of a CP group.

* :mod:`~commlab.parallel.context.layout` -- which tokens each rank holds (contiguous or load-balanced) and
  ring attention's block schedule, as pure arithmetic.
* :mod:`~commlab.parallel.context.communications` -- the operators: the ring pass, Ulysses' AllToAlls, the
  all-gather of K/V.
* :mod:`~commlab.parallel.context.ring` -- ring attention (Liu et al. 2023), online softmax, explicit backward.
* :mod:`~commlab.parallel.context.ulysses` -- DeepSpeed-Ulysses (Jacobs et al. 2023).
* :mod:`~commlab.parallel.context.attention` -- the shared input check, the single-process reference and the
  all-gathered-K/V baseline (Llama 3).
* :mod:`~commlab.parallel.context.cost` -- bytes and α-β time of each, side by side, and which wins where.

Every function takes its CP group explicitly.
"""

from commlab.parallel.context.attention import all_gather_attention, attention, check_inputs
from commlab.parallel.context.layout import (BlockPlan, block_plan, chunk_indices, covered_pairs, positions,
                                             shard_sequence, unshard_sequence)
from commlab.parallel.context.ring import RingAttentionStats, ring_attention
from commlab.parallel.context.ulysses import ulysses_attention

__all__ = ["all_gather_attention", "attention", "check_inputs", "BlockPlan", "block_plan", "chunk_indices",
           "covered_pairs", "positions", "shard_sequence", "unshard_sequence", "RingAttentionStats",
           "ring_attention", "ulysses_attention"]
