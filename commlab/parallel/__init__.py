"""Parallelism on a device mesh (layer 5): the mesh and its process groups, tensor parallelism,
pipeline schedules, data parallelism.

One folder or module per parallel dimension. Nothing here keeps a global process-group manager:
every function takes the mesh or the group it communicates over.

* :mod:`commlab.parallel.mesh` -- :class:`ParallelLayout` (pure rank <-> (dp, pp, tp) arithmetic),
  :func:`build_mesh` (every rank creates every group, in one fixed order), :func:`mesh_groups`,
  :func:`cross_node_groups` and :func:`order_report` (what a different dimension order does to
  which groups cross nodes).
* :mod:`commlab.parallel.tensor` -- Megatron-LM's f and g operators, sequence parallelism's all-gather /
  reduce-scatter pair, and the tensor-parallel layers built from them.
* :mod:`commlab.parallel.context` -- context parallelism: ring attention (load-balanced or not), DeepSpeed-Ulysses,
  all-gathered K/V, and their communication costs side by side.
* :mod:`commlab.parallel.pipeline` -- pipeline schedules (GPipe, 1F1B) and the engine that runs them.
* :mod:`commlab.parallel.expert` -- expert parallelism: a top-k MoE layer with AllToAll dispatch and combine
  over an EP group, its bytes per step, and EP carved out of DP (DeepSeek-V3 as the worked example).
* :mod:`commlab.parallel.data_parallel` -- DP inside a DP group (it is
  :class:`commlab.overlap.BucketedDataParallel` with ``process_group=dp_group``) and ZeRO-1's sharded
  optimizer, :class:`ZeroOneOptimizer`.
* :mod:`commlab.parallel.sharded` -- ZeRO-2 and ZeRO-3 / FSDP (with HSDP), :class:`ShardedDataParallel`, and
  the model-state memory per rank of ZeRO-0..3, computed (:func:`zero_memory_bytes`) and measured
  (:func:`held_memory_bytes`); :mod:`commlab.parallel.sharded_profile` measures a ZeRO-3 step's compute,
  communication and overlap with ``torch.profiler``.
"""

from commlab.parallel.mesh import (MESH_DIMS, ParallelLayout, build_mesh, check_layout, check_order,
                                   cross_node_groups, mesh_groups, order_report)
from commlab.parallel.tensor import (MLP, ColumnParallelLinear, ParallelMLP, ParallelSelfAttention,
                                     RowParallelLinear, SelfAttention, block_allreduce_nbytes)

__all__: list[str] = [
    "MESH_DIMS", "ParallelLayout", "build_mesh", "check_layout", "check_order", "cross_node_groups",
    "mesh_groups", "order_report",
    "MLP", "SelfAttention", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention",
    "block_allreduce_nbytes",
]

# Other dimensions (pipeline, data_parallel) append their own import lines here and extend __all__.

from commlab.parallel.pipeline import (PipelineResult, bubble_fraction, ideal_timeline, make_schedule,
                                       pipeline_step, split_sequential)
from commlab.parallel.data_parallel import ZeroOneOptimizer, ZeroStepStats

__all__ += ["PipelineResult", "bubble_fraction", "ideal_timeline", "make_schedule", "pipeline_step",
            "split_sequential", "ZeroOneOptimizer", "ZeroStepStats"]

from commlab.parallel.sharded import (ShardedDataParallel, ShardedStepStats, held_memory_bytes,
                                      zero_memory_bytes)

__all__ += ["ShardedDataParallel", "ShardedStepStats", "held_memory_bytes", "zero_memory_bytes"]

from commlab.parallel.planner import Layout as PlanLayout, search as plan_search, validate_published

__all__ += ["PlanLayout", "plan_search", "validate_published"]

from commlab.parallel.expert import ExpertParallelMoE, MoE, moe_alltoall_cost

__all__ += ["ExpertParallelMoE", "MoE", "moe_alltoall_cost"]

from commlab.parallel.context import all_gather_attention, ring_attention, ulysses_attention

__all__ += ["all_gather_attention", "ring_attention", "ulysses_attention"]
