"""Layer 4: syncing less often. Local SGD, DiLoCo and Streaming DiLoCo, beside the every-step DP path.

:class:`LocalSGD` averages the parameters every H steps (torch's ``PeriodicModelAverager`` schedule);
:class:`DiLoCo` averages the pseudo-gradient every H steps and takes an outer Nesterov step, per fragment on a
staggered schedule (:func:`fragment_schedule`) with its AllReduce overlapped with tau inner steps, dense or
through the course's compressors. :mod:`commlab.sync.cost` prices an outer step and its overlap.
:class:`FaultTolerantDP` (:mod:`commlab.sync.fault_tolerant`) averages every step over whichever replicas are
alive, healing the ones that come back (chapter "When it goes wrong", section "Survive a failure").

Book: chapter 8b, §8b.1–§8b.4.
"""

from commlab.sync.schedule import FragmentSync, fragment_schedule, split_fragments
from commlab.sync.local_sgd import LocalSGD
from commlab.sync.diloco import DiLoCo, outer_sgd_step
from commlab.sync.fault_tolerant import FaultTolerantDP, Quorum, StepRecord

__all__ = ["LocalSGD", "DiLoCo", "outer_sgd_step", "FragmentSync", "fragment_schedule", "split_fragments",
           "FaultTolerantDP", "Quorum", "StepRecord"]
