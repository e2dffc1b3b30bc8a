"""Chapter 8: does compression pay? Training experiments, their records, and the time-to-accuracy model.

* :mod:`~commlab.experiments.corpus`, :mod:`~commlab.experiments.charlm`, :mod:`~commlab.experiments.tasks`:
  the two tasks (digits MLP; character-level transformer on Python's own documentation).
* :mod:`~commlab.experiments.methods`: gradient averaging by spec (``"topk:0.01"``), timed, as a comm hook of
  the data-parallel path (:class:`commlab.overlap.BucketedDataParallel`).
* :mod:`~commlab.experiments.harness`: one data-parallel run, recorded step by step.
* :mod:`~commlab.experiments.grid`: the grids and ``python -m commlab experiments run``.
* :mod:`~commlab.experiments.slow_link`, :mod:`~commlab.experiments.sync_link`: the time model against runs on an
  emulated slow link; the second sets the compressors against syncing every H steps (``RunConfig.sync``).
* :mod:`~commlab.experiments.stragglers`: one slow DP rank sets everyone's step; per-rank timings name it.
* :mod:`~commlab.experiments.lost_work`: a replica killed at a step; the work a checkpoint restart and per-step
  fault tolerance lose, and their time, beside :mod:`commlab.sync.recovery_cost`.
"""

from commlab.experiments.harness import RunConfig, RunRecord, run
from commlab.experiments.methods import describe, make_method, parse_spec

__all__ = ["RunConfig", "RunRecord", "run", "describe", "make_method", "parse_spec"]
