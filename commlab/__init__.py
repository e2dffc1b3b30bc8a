"""commlab: the communication side of distributed deep-learning training, implemented from primitives.

Layers, bottom to top (each imports only the ones below it):

* :mod:`commlab.launch` -- run a function on N ranks (gloo or NCCL) from a notebook or a script.
* :mod:`commlab.arithmetic` -- units and the arithmetic of compute versus communication (chapter 1).
* :mod:`commlab.collectives` -- ring ReduceScatter / AllGather / AllReduce from point-to-point (chapter 2).
* :mod:`commlab.train` -- a small model on real offline data, for real gradients.
* :mod:`commlab.bench`, :mod:`commlab.viz`, :mod:`commlab.exercises` -- measurements, figures, graders.
"""

from commlab.launch import LaunchError, LaunchTimeout, RankError, launch

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankError"]
__version__ = "0.1.0"
