"""Figures of the course, drawn from the same functions the code runs."""

from commlab.viz.ring import ring_states, plot_ring_schedule, plot_bench

__all__ = ["ring_states", "plot_ring_schedule", "plot_bench"]
