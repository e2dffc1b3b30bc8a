"""Chapter 9, and commlab's one data-parallel path: the gradient AllReduce overlapped with backward.

* :mod:`commlab.overlap.bucketed` -- :class:`BucketedDataParallel`, DDP's bucketed, overlapped gradient
  averaging written from primitives (buckets, post-accumulate-grad hooks, in-order async launches, comm hooks,
  ``no_sync`` and an explicit :meth:`~BucketedDataParallel.sync_gradients` for pipelines), :func:`train_step`,
  and :func:`all_reduce_fn_hook`, the comm hook that sums each bucket with a function of your own. The
  trainers, the experiments, the labs and DP on a device mesh all use it.
* :mod:`commlab.overlap.profile` -- ``torch.profiler`` measurement of a step: overlap fraction, exposed
  communication, step time, and the timeline that :func:`commlab.viz.plot_overlap_timeline` draws.
* :mod:`commlab.overlap.trace` -- the overlap checker: reads any ``torch.profiler`` Chrome trace (gloo or CUDA/NCCL)
  and reports hidden and exposed seconds per kind of communication and the step's critical path
  (``python -m commlab overlap-check TRACE``).
"""

from commlab.overlap.bucketed import (DEFAULT_BUCKET_CAP_BYTES, AllReduceFnState, Bucket, BucketedDataParallel,
                                      BucketSpec, BucketTiming, StepRecord, StepTimes,
                                      UnusedParametersError, all_reduce_fn_hook, assign_buckets, completed_future,
                                      data_parallel_of, train_step)

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "AllReduceFnState", "Bucket", "BucketedDataParallel", "BucketSpec",
           "BucketTiming", "StepRecord", "StepTimes", "UnusedParametersError",
           "all_reduce_fn_hook", "assign_buckets", "completed_future", "data_parallel_of", "train_step"]
