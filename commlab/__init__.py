"""commlab: the communication side of distributed deep-learning training, implemented from primitives.

Layers, bottom to top (each imports only the ones below it):

* :mod:`commlab.launch` -- N ranks (gloo or NCCL) from a notebook or a script, or a torchrun/SLURM job;
* :mod:`commlab.arithmetic`, :mod:`commlab.hardware` -- units, compute versus communication (chapter 1);
* :mod:`commlab.topology` -- links (α, β), cluster presets, ring orders, an emulated multi-node topology;
* :mod:`commlab.collectives` -- ring, halving-doubling, tree, hierarchical, AllToAll, cost models (2-3);
* :mod:`commlab.compress` -- compressors behind one protocol, error feedback, aggregation, DDP hooks (4-7);
* :mod:`commlab.overlap` -- bucketed data parallelism overlapped with backward, and its profile (chapter 9);
* :mod:`commlab.parallel` -- mesh, TP, SP, CP, EP, PP, ZeRO and the layout planner (chapters 10-13);
* :mod:`commlab.train`, :mod:`commlab.experiments` -- small models, recorded runs, time-to-accuracy (8);
* :mod:`commlab.bench`, :mod:`commlab.viz`, :mod:`commlab.widgets`, :mod:`commlab.exercises` --
  measurements, figures, calculators, graders.
"""

from commlab.launch import LaunchError, LaunchTimeout, RankError, launch

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankError"]
__version__ = "0.1.0"
