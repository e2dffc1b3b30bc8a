"""Parallelism on a device mesh (layer 5): one module or folder per parallel dimension, every function taking
the mesh or group it communicates over (no global process-group manager).

* :mod:`~commlab.parallel.mesh` -- rank <-> (dp, pp, tp) arithmetic and the DeviceMesh with its groups;
* :mod:`~commlab.parallel.tensor` -- Megatron-LM's f and g, sequence parallelism's pair, the TP layers;
* :mod:`~commlab.parallel.context` -- ring attention, DeepSpeed-Ulysses, all-gathered K/V, their costs;
* :mod:`~commlab.parallel.pipeline` -- schedules, their communication plans, and the engine;
* :mod:`~commlab.parallel.expert` -- a top-k MoE with AllToAll dispatch and combine, EP carved out of DP;
* :mod:`~commlab.parallel.data_parallel` -- DP on a DP group and ZeRO-1 (:class:`ZeroOneOptimizer`);
* :mod:`~commlab.parallel.sharded` -- ZeRO-2/3 and HSDP (:class:`ShardedDataParallel`), measured by
  :mod:`~commlab.parallel.sharded_profile`;
* :mod:`~commlab.parallel.planner` -- which layout to use.

Book: chapters 10 to 13.
"""

from commlab.parallel.mesh import (MESH_DIMS, ParallelLayout, build_mesh, check_layout, check_order,
                                   cross_node_groups, mesh_groups, order_report)
from commlab.parallel.tensor import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear,
                                     SelfAttention, TransformerMLP, block_allreduce_nbytes)

__all__: list[str] = [
    "MESH_DIMS", "ParallelLayout", "build_mesh", "check_layout", "check_order", "cross_node_groups",
    "mesh_groups", "order_report",
    "TransformerMLP", "SelfAttention", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP",
    "ParallelSelfAttention",
    "block_allreduce_nbytes",
]

# Other dimensions (pipeline, data_parallel) append their own import lines here and extend __all__.

from commlab.parallel.pipeline import (PipelineResult, bubble_fraction, ideal_timeline, make_schedule,
                                       pipeline_step, split_sequential)
from commlab.parallel.data_parallel import ZeroOneOptimizer, ZeroStepStats

__all__ += ["PipelineResult", "bubble_fraction", "ideal_timeline", "make_schedule", "pipeline_step",
            "split_sequential", "ZeroOneOptimizer", "ZeroStepStats"]

from commlab.parallel.sharded import (MixedPrecisionPolicy, ShardedDataParallel, ShardedStepStats, dim0_shard_rows,
                                      held_memory_bytes, sharded_step_nbytes, zero_memory_bytes)

__all__ += ["MixedPrecisionPolicy", "ShardedDataParallel", "ShardedStepStats", "dim0_shard_rows",
            "held_memory_bytes", "sharded_step_nbytes", "zero_memory_bytes"]

from commlab.parallel.planner import Layout as PlanLayout, search as plan_search, validate_published

__all__ += ["PlanLayout", "plan_search", "validate_published"]

from commlab.parallel.expert import ExpertParallelMoE, MoE, moe_alltoall_cost

__all__ += ["ExpertParallelMoE", "MoE", "moe_alltoall_cost"]

from commlab.parallel.context import all_gather_attention, ring_attention, ulysses_attention

__all__ += ["all_gather_attention", "ring_attention", "ulysses_attention"]
