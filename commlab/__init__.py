"""commlab: the communication side of distributed deep-learning training, implemented from primitives.

Layers, bottom to top (each imports only the ones below it):

* :mod:`commlab.launch` -- run a function on N ranks (gloo or NCCL) from a notebook or a script, or as the
  ranks of a torchrun/SLURM job (``init_from_env``, the per-node torchrun command).
* :mod:`commlab.arithmetic`, :mod:`commlab.hardware` -- units, the arithmetic of compute versus
  communication, vendor figures (chapter 1).
* :mod:`commlab.topology` -- links (α, β), cluster presets, ring orders, an emulated multi-node topology.
* :mod:`commlab.collectives` -- ring ReduceScatter / AllGather / AllReduce (chapter 2), halving-doubling,
  trees and hierarchical AllReduce (chapter 3), all from point-to-point sends, with their cost models.
* :mod:`commlab.compress` -- gradient compressors behind one protocol, error feedback, aggregation and
  DDP comm hooks (chapters 4-7).
* :mod:`commlab.overlap` -- DDP-style bucketed data parallelism that overlaps each bucket's AllReduce with
  backward, and its profiler measurement (chapter 9).
* :mod:`commlab.parallel` -- device mesh, tensor and pipeline parallelism, DP groups, ZeRO-1 and the
  layout planner (chapters 10-11).
* :mod:`commlab.train` -- a small model on real offline data, for real gradients.
* :mod:`commlab.experiments` -- does compression pay? Recorded training runs with every compressor, the
  time-to-accuracy and break-even model, and its check on an emulated slow link (chapter 8).
* :mod:`commlab.bench`, :mod:`commlab.viz`, :mod:`commlab.widgets`, :mod:`commlab.exercises` --
  measurements and calibration, figures, the cost calculator, graders.
"""

from commlab.launch import LaunchError, LaunchTimeout, RankError, launch

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankError"]
__version__ = "0.1.0"
