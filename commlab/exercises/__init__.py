"""Graders for the labs' exercises: run the learner's code on real ranks and say what is wrong."""

from commlab.exercises.report import CheckReport
from commlab.exercises.ring import check_all_gather, check_reduce_scatter

__all__ = ["CheckReport", "check_reduce_scatter", "check_all_gather"]
