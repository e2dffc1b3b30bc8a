"""Starting ranks and finding their devices: the one layer of commlab that knows about processes.

Two doors into one world, and everything above them sees only an initialised process group:

* :func:`launch` (:mod:`commlab.launch.local`) forks N ranks from a notebook cell or a script, runs a
  function on each and returns the results in rank order, failing fast and naming the failing rank.
  Started under ``torchrun`` or ``srun``, the same call runs the function in-process as this rank of the
  job (:mod:`commlab.launch.inprocess`), so one function serves both.
* :func:`init_from_env` (:mod:`commlab.launch.env`) is the cluster entry for scripts: it reads torchrun's or
  Slurm's variables, binds ``cuda:LOCAL_RANK`` under NCCL and initialises with ``env://``; with no launcher
  it makes a world of one. :func:`exit_process` ends such a script without CPython's last garbage
  collection, which costs each torch process seconds of CPU at exit.
* :mod:`commlab.launch.torchrun` is the per-node command of a multi-node job (torchrun with a named
  rendezvous, a preflight and a deadline); ``scripts/slurm/commlab.sbatch`` runs it under SLURM.

:mod:`commlab.launch.device` answers the one question the layers above ask: on which device must a tensor
live to travel through this group (the CPU under gloo, ``cuda:LOCAL_RANK`` under NCCL), and how to time
work on that device (the host clock on the CPU, CUDA events on a GPU). :mod:`commlab.launch.inflight` keeps
the point-to-point sends a rank has started until they are delivered.
"""

from commlab.launch.device import Clock, group_device
from commlab.launch.env import (DEFAULT_ENV_TIMEOUT_S, DistContext, LauncherEnvError, detect_launcher,
                                exit_process, init_from_env, read_env)
from commlab.launch.errors import LaunchError, LaunchTimeout, RankError
from commlab.launch.inprocess import UnfinishedSendsError
from commlab.launch.local import DEFAULT_TIMEOUT_S, launch

__all__ = ["launch", "RankError", "LaunchTimeout", "LaunchError", "UnfinishedSendsError", "DEFAULT_TIMEOUT_S",
           "init_from_env", "read_env", "detect_launcher", "DistContext", "LauncherEnvError",
           "DEFAULT_ENV_TIMEOUT_S", "group_device", "Clock", "exit_process"]
