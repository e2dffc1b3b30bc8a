"""Graders for the labs' exercises: run the learner's code on real ranks and say what is wrong."""

from commlab.exercises.report import CheckReport
from commlab.exercises.ring import check_all_gather, check_reduce_scatter

__all__ = ["CheckReport", "check_reduce_scatter", "check_all_gather"]
from commlab.exercises.compression import check_error_feedback

__all__ += ["check_error_feedback"]
from commlab.exercises.pay import check_step_time

__all__ += ["check_step_time"]
from commlab.exercises.capstone import check_step_budget

__all__ += ["check_step_budget"]
