"""Starting ranks and finding their devices: the one layer of commlab that knows about processes.

Two doors into one world; everything above them sees only an initialised process group:

* :func:`launch` (:mod:`commlab.launch.local`) forks N ranks from a notebook cell or a script and returns their
  results in rank order, failing fast and naming the failing rank; under torchrun or srun it runs the function
  in this process, as this rank of the job (:mod:`commlab.launch.inprocess`).
* :func:`init_from_env` (:mod:`commlab.launch.env`) initialises a torchrun or Slurm job's rank from its
  environment; :mod:`commlab.launch.torchrun` is the per-node command of a multi-node job.

:mod:`commlab.launch.device` says on which device a group's tensors live and times work there, and
:mod:`commlab.launch.inflight` keeps a rank's sends until they are delivered; :func:`run_replicas`
(:mod:`commlab.launch.replicas`) runs data-parallel replicas that a :class:`Fault` kills and brings back.
Chapter 2 (section 2.4) shows the first door, chapter 14 (sections 14.2 and 14.4) the second.
"""

from commlab.launch.device import Clock, group_device
from commlab.launch.env import (DEFAULT_ENV_TIMEOUT_S, DistContext, LauncherEnvError, detect_launcher,
                                exit_process, init_from_env, read_env)
from commlab.launch.errors import LaunchError, LaunchTimeout, RankError
from commlab.launch.inprocess import UnfinishedSendsError
from commlab.launch.local import DEFAULT_TIMEOUT_S, launch
from commlab.launch.replicas import (Fault, ReplicaContext, ReplicaError, ReplicaRun, ReplicaTimeout,
                                     run_replicas)

__all__ = ["launch", "RankError", "LaunchTimeout", "LaunchError", "UnfinishedSendsError", "DEFAULT_TIMEOUT_S",
           "init_from_env", "read_env", "detect_launcher", "DistContext", "LauncherEnvError",
           "DEFAULT_ENV_TIMEOUT_S", "group_device", "Clock", "exit_process", "run_replicas", "Fault", "ReplicaRun",
           "ReplicaContext", "ReplicaError", "ReplicaTimeout"]
