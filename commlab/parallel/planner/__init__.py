"""The 3D-parallelism planner: which TP × PP × DP layout to use on a cluster, and why.

* :mod:`~.memory` -- model configs and bytes per GPU of a :class:`Layout` (weights, gradients, optimizer
  states, ZeRO 0-3 and HSDP, activations by recomputation policy);
* :mod:`~.software` -- software profiles: what the training stack does and overlaps, each field sourced;
* :mod:`~.counting` -- FLOP per token (executed, and in published definitions) and bytes per message;
* :mod:`~.communication` -- collective seconds and the overlap arithmetic, each rule written once;
* :mod:`~.time_model` -- seconds per step, term by term;
* :mod:`~.kernels` -- compute priced from a layer's kernels (the default where the GPU has the data);
* :mod:`~.timeline` -- one step replayed in the schedule's order, per pipeline stage;
* :mod:`~.search` and :mod:`~.validation` -- the search over layouts; :func:`validate_published` against runs.

``python -m commlab plan --model llama3-405b --preset dgx-h100-ndr --gpus 16384 --global-batch 2048``
prints the top layouts. Book: chapter 11 (all of it) and chapter 12, §12.4.
"""

from types import ModuleType as _ModuleType

from commlab.parallel.planner.software import (DEFAULT_SOFTWARE, OPTIMIZER_DTYPES, RECOMPUTE_POLICIES, ZERO_STAGES,
                                               OptimizerDtypes, SoftwareProfile, list_software, load_software)
from commlab.parallel.planner.memory import (ADAM_STATE_BYTES_PER_PARAM, DEFAULT_FRAGILE_MARGIN, DEFAULT_MEMORY_RESERVE,
                                             Layout, MemoryBreakdown, ModelConfig, activation_bytes_per_layer,
                                             interleave_memory_factor, is_fragile, layer_params, list_models,
                                             load_model, memory_breakdown, model_state_bytes_per_param,
                                             parameter_count, stage_params, usable_memory_bytes)
from commlab.parallel.planner.counting import (FLOP_DEFINITIONS, attention_flops_per_token, dp_gradient_nbytes,
                                               executed_flops_per_token, korthikanti_eq7_flops, megatron_2024_flops,
                                               megatron_eq3_flops, model_flops_per_step, model_flops_per_token,
                                               pp_message_nbytes, tp_all_reduce_nbytes)
from commlab.parallel.planner.communication import (dp_all_reduce_seconds, dp_exposed_seconds, dp_last_bucket_share,
                                                    fsdp_head_share, fsdp_units, group_all_reduce_seconds,
                                                    op_times)
from commlab.parallel.planner.time_model import (AUTO, DEFAULT_ACHIEVABLE_FRACTION, KERNELS, TimeBreakdown, compute_model,
                                                 loss_seconds, step_time)
from commlab.parallel.planner.timeline import (StepCosts, StageCosts, StepTimeline, step_costs, step_timeline,
                                               timeline_from_costs)
from commlab.parallel.planner.search import (TIMELINE_TOP_K, Plan, Rejected, SearchResult, divisors, load_published,
                                             make_cluster, search)
from commlab.parallel.planner.validation import (WITHIN_PCT, ValidationRow, validate_published, validation_summary,
                                                 validation_table)

__all__ = sorted(n for n, v in globals().items() if not n.startswith("_") and not isinstance(v, _ModuleType))
