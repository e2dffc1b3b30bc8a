"""Measurements printed the way nccl-tests prints them: ours beside torch's own, in one run."""

from commlab.bench.metrics import BUSBW_FACTORS, algbw_bytes_per_s, busbw_bytes_per_s, parse_size
from commlab.bench.allreduce import BenchRow, bench_all_reduce, format_table

__all__ = ["BUSBW_FACTORS", "algbw_bytes_per_s", "busbw_bytes_per_s", "parse_size",
           "BenchRow", "bench_all_reduce", "format_table"]
