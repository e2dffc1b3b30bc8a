"""Graders for the labs' exercises: run the learner's code on real ranks and say what is wrong.

An unfilled exercise (its stub still returns ``None``) gets a one-line report, "not attempted yet: fill in
...", and a wrong answer the input it fails on and what is wrong with it, never the expected answer
(:class:`commlab.exercises.report.CheckReport`).
"""

from commlab.exercises.report import CheckReport
from commlab.exercises.ring import check_all_gather, check_reduce_scatter

__all__ = ["CheckReport", "check_reduce_scatter", "check_all_gather"]
from commlab.exercises.compression import check_error_feedback

__all__ += ["check_error_feedback"]
from commlab.exercises.quantizer import check_qsgd

__all__ += ["check_qsgd"]
from commlab.exercises.powersgd_bytes import check_bytes_per_step

__all__ += ["check_bytes_per_step"]
from commlab.exercises.pay import check_step_time

__all__ += ["check_step_time"]
from commlab.exercises.buckets import check_buckets

__all__ += ["check_buckets"]
from commlab.exercises.mesh import check_coords_and_groups

__all__ += ["check_coords_and_groups"]
from commlab.exercises.planner import check_memory_per_gpu, check_step_seconds

__all__ += ["check_memory_per_gpu", "check_step_seconds"]
from commlab.exercises.capstone import check_step_budget

__all__ += ["check_step_budget"]
from commlab.exercises.all_to_all import check_all_to_all_bytes

__all__ += ["check_all_to_all_bytes"]
from commlab.exercises.sharded import check_prefetch, check_zero3_bytes

__all__ += ["check_zero3_bytes", "check_prefetch"]
from commlab.exercises.moe_bytes import check_dispatch_bytes
from commlab.exercises.ring_schedule import check_ring_schedule

__all__ += ["check_ring_schedule", "check_dispatch_bytes"]
from commlab.exercises.schedules import check_schedule_bubbles

__all__ += ["check_schedule_bubbles"]
from commlab.exercises.sync import check_fragment_schedule, check_hiding_tau, check_sync_bytes_per_step

__all__ += ["check_fragment_schedule", "check_hiding_tau", "check_sync_bytes_per_step"]
from commlab.exercises.diagnose import (check_failure_price, check_failure_reading, check_flight_recorder,
                                        check_hang_diagnosis, check_straggler, check_trace_reading)

__all__ += ["check_hang_diagnosis", "check_flight_recorder", "check_trace_reading", "check_straggler",
            "check_failure_reading", "check_failure_price"]
