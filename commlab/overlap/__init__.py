"""Chapter 9: overlapping the gradient AllReduce with the backward pass, and measuring how much is hidden.

* :mod:`commlab.overlap.bucketed` -- :class:`BucketedDataParallel`, DDP's bucketed, overlapped gradient
  averaging written from primitives (buckets, post-accumulate-grad hooks, in-order async launches, comm hooks,
  ``no_sync``), and :func:`train_step`.
* :mod:`commlab.overlap.profile` -- ``torch.profiler`` measurement of a step: overlap fraction, exposed
  communication, step time, and the timeline that :func:`commlab.viz.plot_overlap_timeline` draws.
"""

from commlab.overlap.bucketed import (DEFAULT_BUCKET_CAP_BYTES, Bucket, BucketedDataParallel, BucketSpec,
                                      BucketTiming, LayoutMismatchError, StepRecord, StepTimes,
                                      UnusedParametersError, assign_buckets, train_step)

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "Bucket", "BucketedDataParallel", "BucketSpec", "BucketTiming",
           "LayoutMismatchError", "StepRecord", "StepTimes", "UnusedParametersError", "assign_buckets", "train_step"]
