"""Measurements printed the way nccl-tests prints them: ours beside torch's own, in one run; and the
α-β calibration of this machine (:mod:`commlab.bench.calibrate`)."""

from commlab.bench.metrics import BUSBW_FACTORS, algbw_bytes_per_s, busbw_bytes_per_s, parse_size
from commlab.bench.allreduce import BenchRow, bench_all_reduce, format_table
from commlab.bench.all_to_all import bench_all_to_all
# calibrate() itself stays in commlab.bench.calibrate: re-exported here it would shadow the module.
from commlab.bench.calibrate import (AlphaBetaFit, RingModelReport, RingModelRow, fit_alpha_beta, pingpong,
                                     ring_exchange, ring_model_error)

__all__ = ["BUSBW_FACTORS", "algbw_bytes_per_s", "busbw_bytes_per_s", "parse_size",
           "BenchRow", "bench_all_reduce", "bench_all_to_all", "format_table",
           "AlphaBetaFit", "RingModelReport", "RingModelRow", "fit_alpha_beta", "pingpong", "ring_exchange",
           "ring_model_error"]
