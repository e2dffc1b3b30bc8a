"""Figures of the course, drawn from the same functions the code runs."""

from commlab.viz.ring import ring_states, plot_ring_schedule, plot_bench, bench_table

__all__ = ["ring_states", "plot_ring_schedule", "plot_bench", "bench_table"]

from commlab.viz.pipeline import plot_schedule_comparison, plot_timeline

__all__ += ["plot_timeline", "plot_schedule_comparison"]

from commlab.viz.overlap import plot_overlap_timeline

__all__ += ["plot_overlap_timeline"]

from commlab.viz.p2p import plot_rendezvous

__all__ += ["plot_rendezvous"]

from commlab.viz.collectives import (halving_doubling_transfers, hierarchical_transfers, plot_transfers,
                                     ring_transfers, tree_transfers)

__all__ += ["ring_transfers", "tree_transfers", "halving_doubling_transfers", "hierarchical_transfers",
            "plot_transfers"]

from commlab.viz.topology import plot_node_rails, plot_switch_tree

__all__ += ["plot_node_rails", "plot_switch_tree"]

from commlab.viz.compression import plot_compressed_paths

__all__ += ["plot_compressed_paths"]

from commlab.viz.timeline import plot_step_timeline

__all__ += ["plot_step_timeline"]
