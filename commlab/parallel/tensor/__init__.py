"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, §3): the f and g operators and sequence parallelism's
all-gather / reduce-scatter pair (Korthikanti et al. 2022, §4.2.2) in :mod:`~commlab.parallel.tensor.communications`,
and the layers built from them (:mod:`~commlab.parallel.tensor.layers`; ``sequence_parallel=True`` on the blocks).
Every layer takes its TP process group explicitly."""

from commlab.parallel.tensor.communications import (f, g, gather_last_dim, gather_sequence, reduce_scatter_sequence,
                                                    split_last_dim)
from commlab.parallel.tensor.layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention,
                                            RowParallelLinear, SelfAttention, TransformerMLP,
                                            block_allreduce_nbytes, tp_sharded_parameters)

__all__ = ["f", "g", "gather_last_dim", "split_last_dim", "gather_sequence", "reduce_scatter_sequence",
           "TransformerMLP",
           "SelfAttention", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention", "block_allreduce_nbytes",
           "tp_sharded_parameters"]
