"""The 3D-parallelism planner: which TP × PP × DP layout to use on a cluster, and why.

* :mod:`~commlab.parallel.planner.memory` -- model configs (``data/models.json``), parameter counts with
  embeddings, bytes per GPU of a :class:`Layout` (weights, gradients, Adam states by optimizer dtype option,
  ZeRO stages 0-3 and HSDP, activations after Korthikanti et al. 2022 by recompute policy), the memory reserve and the
  fragile flag.
* :mod:`~commlab.parallel.planner.software` -- software profiles (``data/software.json``): what the
  training stack overlaps, its pipeline message layout, gradient and optimizer-state bytes, recomputation
  policy and ZeRO stage, each field with its source.
* :mod:`~commlab.parallel.planner.time_model` -- seconds per step: compute from executed FLOP, TP
  AllReduces (bytes not divided by tp), PP sends (1/tp per rank with scatter/gather or sequence
  parallelism), bubble, DP ReduceScatter + AllGather on the links each group crosses, each hidden behind
  compute as far as the profile overlaps it; model FLOP in the definitions published runs use.
* :mod:`~commlab.parallel.planner.kernels` -- compute from a layer's kernels, the alternative to one share
  of peak: GEMM efficiency by shape (``data/gemm_efficiency.json``), memory-bound operations and the optimizer
  step at the device's memory bandwidth, a layer's kernels at the stack's share of those rates that measured
  single layers give (``data/published_layer_times.json``).
* :mod:`~commlab.parallel.planner.timeline` -- the step timeline of a plan: the real schedule (GPipe,
  1F1B, interleaved 1F1B) replayed per pipeline stage with the time model's durations, overlap as the
  profile says; its step time re-ranks the search's top candidates.
* :mod:`~commlab.parallel.planner.search` -- the search over layouts, and :func:`validate_published`
  against Megatron-LM (SC'21, Table 1) and Llama 3 405B (``python -m commlab plan --validate``).
* :mod:`~commlab.parallel.planner.tables` -- reads the data tables above, once per file.

``python -m commlab plan --model llama3-405b --preset dgx-h100-ndr --gpus 16384 --global-batch 2048``
prints the top layouts.
"""

from commlab.parallel.planner.software import (DEFAULT_SOFTWARE, OPTIMIZER_DTYPES, RECOMPUTE_POLICIES, ZERO_STAGES,
                                               OptimizerDtypes, SoftwareProfile, list_software, load_software)
from commlab.parallel.planner.memory import (ADAM_STATE_BYTES_PER_PARAM, DEFAULT_FRAGILE_MARGIN, DEFAULT_MEMORY_RESERVE,
                                             Layout, MemoryBreakdown, ModelConfig, activation_bytes_per_layer,
                                             interleave_memory_factor, is_fragile, layer_params, list_models,
                                             load_model, memory_breakdown, model_state_bytes_per_param,
                                             parameter_count, stage_params, usable_memory_bytes)
from commlab.parallel.planner.time_model import (AUTO, DEFAULT_ACHIEVABLE_FRACTION, FLOP_DEFINITIONS, KERNELS,
                                                 TimeBreakdown, attention_flops_per_token, compute_model, dp_all_reduce_seconds,
                                                 dp_exposed_seconds, dp_gradient_nbytes, dp_last_bucket_share,
                                                 executed_flops_per_token, loss_seconds,
                                                 fsdp_exposed_seconds, fsdp_head_share, korthikanti_eq7_flops,
                                                 megatron_eq3_flops,
                                                 megatron_2024_flops,
                                                 model_flops_per_step, model_flops_per_token,
                                                 pp_message_nbytes, step_time, tp_all_reduce_nbytes)
from commlab.parallel.planner.timeline import (StepCosts, StageCosts, StepTimeline, step_costs, step_timeline,
                                               timeline_from_costs)
from commlab.parallel.planner.search import (TIMELINE_TOP_K, WITHIN_PCT, Plan, Rejected, SearchResult, ValidationRow, divisors,
                                             load_published, make_cluster, search, validate_published,
                                             validation_summary, validation_table)

__all__ = [
    "SoftwareProfile", "DEFAULT_SOFTWARE", "RECOMPUTE_POLICIES", "ZERO_STAGES", "OPTIMIZER_DTYPES", "OptimizerDtypes",
    "load_software", "list_software",
    "ModelConfig", "Layout", "MemoryBreakdown", "ADAM_STATE_BYTES_PER_PARAM", "DEFAULT_MEMORY_RESERVE",
    "DEFAULT_FRAGILE_MARGIN", "load_model", "list_models", "layer_params", "parameter_count", "stage_params",
    "activation_bytes_per_layer", "interleave_memory_factor", "model_state_bytes_per_param", "usable_memory_bytes",
    "is_fragile", "memory_breakdown",
    "TimeBreakdown", "DEFAULT_ACHIEVABLE_FRACTION", "KERNELS", "AUTO", "compute_model", "model_flops_per_token",
    "executed_flops_per_token",
    "megatron_eq3_flops", "megatron_2024_flops", "korthikanti_eq7_flops", "model_flops_per_step",
    "attention_flops_per_token",
    "FLOP_DEFINITIONS",
    "dp_exposed_seconds", "dp_last_bucket_share", "loss_seconds", "fsdp_exposed_seconds", "fsdp_head_share",
    "tp_all_reduce_nbytes",
    "pp_message_nbytes", "dp_gradient_nbytes",
    "dp_all_reduce_seconds", "step_time",
    "StepCosts", "StageCosts", "StepTimeline", "step_costs", "step_timeline", "timeline_from_costs",
    "Plan", "Rejected", "SearchResult", "ValidationRow", "TIMELINE_TOP_K", "WITHIN_PCT", "divisors", "make_cluster", "search",
    "load_published", "validate_published", "validation_table", "validation_summary",
]
