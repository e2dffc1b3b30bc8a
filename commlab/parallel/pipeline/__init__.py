"""Pipeline parallelism: schedules as data, point-to-point stage communication, and a step engine.

* :mod:`~commlab.parallel.pipeline.schedules`: GPipe, 1F1B, interleaved 1F1B and ZB-H1 op orders, the ideal
  timeline and the bubble.
* :mod:`~commlab.parallel.pipeline.plan`: which messages each stage exchanges between its computations, in
  which groups, and a simulator of NCCL's rendezvous rules that checks the plan cannot deadlock.
* :mod:`~commlab.parallel.pipeline.communications`: one group of the plan as one grouped exchange.
* :mod:`~commlab.parallel.pipeline.engine`: one training step of a model cut into stages (or v chunks per
  stage, interleaved), timed per op.
"""

from commlab.parallel.pipeline.schedules import (BACKWARD, FORWARD, SCHEDULES, WEIGHT, Op, TimedOp, bubble_fraction,
                                                 bubble_time_ratio, check_schedule, compare_bubbles, gpipe_schedule,
                                                 ideal_timeline, idle_fraction, in_flight,
                                                 interleaved_bubble_time_ratio, interleaved_schedule,
                                                 interleaved_warmup, make_schedule, max_in_flight,
                                                 one_f_one_b_schedule, stage_busy_idle, virtual_dependencies,
                                                 zb_h1_bubble_time_ratio, zb_h1_schedule)
from commlab.parallel.pipeline.plan import (ACTIVATION, GRADIENT, CommGroup, Message, RendezvousDeadlock,
                                            communication_plan, simulate_plan, ungrouped_plan)
from commlab.parallel.pipeline.communications import (Boundary, PendingSends, agree_boundary_shapes,
                                                      agree_chunk_boundaries, agree_step, communicate)
from commlab.parallel.pipeline.engine import PipelineResult, pipeline_step, split_interleaved, split_sequential

__all__ = ["Op", "TimedOp", "FORWARD", "BACKWARD", "SCHEDULES", "gpipe_schedule", "one_f_one_b_schedule",
           "interleaved_schedule", "virtual_dependencies", "make_schedule", "check_schedule", "in_flight", "max_in_flight", "ideal_timeline", "bubble_fraction",
           "bubble_time_ratio", "idle_fraction", "stage_busy_idle",
           "ACTIVATION", "GRADIENT", "Message", "CommGroup", "RendezvousDeadlock", "communication_plan",
           "ungrouped_plan", "simulate_plan",
           "PendingSends", "Boundary", "agree_step", "agree_boundary_shapes", "communicate", "PipelineResult",
           "pipeline_step",
           "split_sequential", "split_interleaved", "WEIGHT", "zb_h1_schedule", "interleaved_warmup",
           "interleaved_bubble_time_ratio", "zb_h1_bubble_time_ratio", "compare_bubbles", "agree_chunk_boundaries"]
