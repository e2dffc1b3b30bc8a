"""Starting ranks and finding their devices: the one layer of commlab that knows about processes.

Two doors into one world, and everything above them sees only an initialised process group:

* :func:`launch` (:mod:`commlab.launch.local`) forks N ranks from a notebook cell or a script, runs a
  function on each and returns the results in rank order, failing fast and naming the failing rank.
* Under ``torchrun`` or SLURM the environment already describes the job; the cluster entry reads it
  (see the package's README for the torchrun and SLURM how-to).

:mod:`commlab.launch.device` answers the one question the layers above ask: on which device must a tensor
live to travel through this group (the CPU under gloo, ``cuda:LOCAL_RANK`` under NCCL), and how to time
work on that device (the host clock on the CPU, CUDA events on a GPU).
"""

from commlab.launch.device import Clock, group_device
from commlab.launch.local import DEFAULT_TIMEOUT_S, LaunchError, LaunchTimeout, RankError, launch

__all__ = ["launch", "RankError", "LaunchTimeout", "LaunchError", "DEFAULT_TIMEOUT_S", "group_device", "Clock"]
