"""Benchmark helpers and the command line (the benchmark's speed is not a test; its correctness is)."""

import subprocess
import sys

import pytest
import torch

from commlab.__main__ import main
from tests.helpers import exit_status
from commlab.bench import BenchRow, algbw_bytes_per_s, bench_all_reduce, busbw_bytes_per_s, format_table, parse_size


def test_busbw_factors_follow_nccl_tests():
    assert busbw_bytes_per_s(1e9, 1.0, 4, "all_reduce") == pytest.approx(1.5e9)
    assert busbw_bytes_per_s(1e9, 1.0, 8, "all_gather") == pytest.approx(0.875e9)
    assert busbw_bytes_per_s(1e9, 2.0, 8, "broadcast") == pytest.approx(0.5e9)
    # AlltoAll: nccl-tests' src/alltoall.cu, S = one rank's whole send buffer, factor (n-1)/n.
    assert busbw_bytes_per_s(1e9, 1.0, 4, "all_to_all") == pytest.approx(0.75e9)
    assert busbw_bytes_per_s(1e9, 1.0, 1, "all_to_all") == 0.0
    assert algbw_bytes_per_s(10, 2) == 5
    with pytest.raises(ValueError, match="collective must be one of"):
        busbw_bytes_per_s(1, 1, 2, "alltoall")
    with pytest.raises(ValueError):
        algbw_bytes_per_s(1, 0)


@pytest.mark.parametrize("text, value", [("1024", 1024), ("64K", 65536), ("16MiB", 16 * 2**20),
                                         ("1g", 2**30), (512, 512)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_nonsense():
    with pytest.raises(ValueError, match="cannot read"):
        parse_size("12 parsecs")


@pytest.mark.slow
def test_a_small_benchmark_runs_and_finds_nothing_wrong(capsys):
    rows = bench_all_reduce(world_size=3, sizes=[4096, 12], rounds=1)
    assert [r.nbytes for r in rows] == [4096, 12] and all(r.wrong == 0 for r in rows)
    assert all(r.ours_s > 0 and r.torch_s > 0 and r.ratio > 0 for r in rows)
    out = capsys.readouterr().out
    assert "busbw ours/torch" in out and out.count("float32") == 2
    assert "#wrong" in format_table(rows)


def _forgets_to_reduce(buf):
    pass


def test_the_benchmark_checks_the_function_it_times():
    # An "AllReduce" that leaves the buffer alone is wrong everywhere except where all ranks' sum equals
    # this rank's value, so nearly every element on every rank is counted.
    row = bench_all_reduce(2, [4000], rounds=1, ours=_forgets_to_reduce, progress=False)[0]
    assert row.wrong > 1900


def test_ratio_and_table_of_a_row():
    row = BenchRow(nbytes=8, count=2, dtype="float32", world_size=2, ours_s=1.0, torch_s=2.0, wrong=1)
    assert row.ratio == pytest.approx(2.0)
    assert format_table([row]).splitlines()[-1].split()[6] == "1"


def test_an_all_to_all_row_uses_the_all_to_all_factor_and_heading():
    row = BenchRow(nbytes=1000, count=250, dtype="float32", world_size=4, ours_s=1e-6, torch_s=2e-6, wrong=0,
                   collective="all_to_all")
    assert row.ours_busbw == pytest.approx(row.ours_algbw * 3 / 4) and row.ratio == pytest.approx(2.0)
    table = format_table([row])
    assert table.startswith("# AlltoAll, 4 ranks") and "dist.all_to_all_single" in table


def test_command_line_all_to_all_bench(capsys):
    assert main(["bench", "--all-to-all", "-n", "3", "-b", "1K", "-e", "1K", "-r", "1", "--check"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if "float32" in line]
    assert "# AlltoAll, 3 ranks" in out and "with check=True" in out and "out of bounds values: 0 OK" in out
    # 1K rounded down to whole blocks of one float32 per rank; no element differed from torch's.
    assert [(r[0], r[1], r[6]) for r in rows] == [("1020", "255", "0")]
    assert all(float(r[-1]) > 0 for r in rows)


def test_bench_rejects_bad_arguments():
    with pytest.raises(ValueError, match=">= 4 bytes"):
        bench_all_reduce(2, [2])
    with pytest.raises(ValueError, match="rounds"):
        bench_all_reduce(2, [16], rounds=0)


@pytest.mark.slow
def test_command_line_bench(capsys):
    assert main(["bench", "-n", "2", "-b", "1K", "-e", "4K", "-f", "4", "-r", "1", "--check"]) == 0
    out = capsys.readouterr().out
    assert "out of bounds values: 0 OK" in out and out.count("float32") == 2


def test_one_rank_gives_a_table_not_a_crash(capsys):
    assert main(["bench", "-n", "1", "-b", "1K", "-e", "1K", "-r", "1"]) == 0
    assert "float32" in capsys.readouterr().out


def test_two_phase_bench_prints_bytes_and_times_side_by_side(capsys):
    assert main(["bench", "--two-phase", "-n", "2", "-e", "4K", "-r", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("   2 ")]
    assert [r[1] for r in rows] == ["sign", "INT8", "Top-K"] and "differed from rank 0's: 0 OK" in out
    with pytest.raises(SystemExit):
        main(["bench", "--two-phase", "-n", "1"])
    assert "--two-phase needs --world-size >= 2" in capsys.readouterr().err


def _usage_error(flags, capsys):
    """``python -m commlab bench FLAGS`` in this process: (exit status, stderr)."""
    return exit_status(main, ["bench", *flags], capsys)


@pytest.mark.parametrize("flags", [["-n", "0"], ["-r", "0"]])
def test_command_line_rejects_bad_counts(flags, capsys):
    code, err = _usage_error(flags, capsys)
    assert code == 2 and "need --world-size >= 1 and --rounds >= 1" in err


@pytest.mark.slow
def test_command_line_rejects_bad_sizes():
    # Through the real entry point once (the others call main() in this process, the same code).
    proc = subprocess.run([sys.executable, "-m", "commlab", "bench", "-b", "1X"], capture_output=True, text=True)
    assert proc.returncode == 2 and "cannot read '1X' as a size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--overlap", "--compressors"], "separate benchmarks"),
    (["--emulate", "2x2", "--algorithms", "all"], "separate benchmarks"),
    (["--overlap", "--backend", "nccl"], "--backend and --check do not apply"),
    (["--overlap", "--check"], "--backend and --check do not apply"),
    (["--sharded", "--overlap"], "separate benchmarks"),
    (["--sharded", "--backend", "nccl"], "--sharded runs on gloo CPU ranks"),
    # Before, these ran on gloo and printed a gloo table as if nothing had been asked.
    (["--algorithms", "ring", "--backend", "nccl"], "--algorithms starts its own gloo ranks; --backend and --check "
     "apply to the AllReduce table only"),
    (["--emulate", "2x2", "--backend", "nccl"], "--emulate starts its own gloo ranks"),
    (["--algorithms", "all", "--check"], "--algorithms starts its own gloo ranks"),
    (["--compressors", "--backend", "nccl"], "--compressors starts its own gloo ranks"),
    (["--all-to-all", "--two-phase"], "separate benchmarks"),
    (["--all-to-all", "--torchrun", "1x2"], "--all-to-all starts its own ranks")])
def test_command_line_rejects_flags_that_would_be_ignored(flags, message, capsys):
    code, err = _usage_error(flags, capsys)
    assert code == 2 and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("flags", [[], ["--torchrun", "1x2"], ["--all-to-all"]])
def test_bench_on_nccl_without_a_gpu_is_a_usage_error_not_a_traceback(flags, capsys):
    code, err = _usage_error(["--backend", "nccl", *flags], capsys)
    assert code == 2 and "--backend nccl needs CUDA GPUs" in err and "use --backend gloo" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_compressors_on_cuda_without_a_gpu_is_a_usage_error_not_a_traceback(capsys):
    code, err = _usage_error(["--compressors", "--device", "cuda"], capsys)
    assert code == 2 and "--device cuda needs CUDA GPUs" in err


@pytest.mark.parametrize("flags, message", [
    (["--inter-gbps", "-1"], "--inter-gbps must be a finite number of Gb/s > 0, got -1"),
    (["--inter-gbps", "nan"], "--inter-gbps must be a finite number of Gb/s > 0, got nan"),
    (["--inter-alpha-us", "-5"], "--inter-alpha-us must be a finite number of microseconds >= 0, got -5"),
    ([], "--emulate takes NODESxDEVICES with both >= 1, e.g. 2x4, got '2x0'")])
def test_emulated_link_errors_name_the_option_in_its_own_unit(flags, message, capsys):
    """Before, a bad link was blamed on --emulate and shown in bytes/s or seconds."""
    emulate = "2x0" if not flags else "2x2"
    code, err = _usage_error(["--emulate", emulate, *flags], capsys)
    assert code == 2 and message in err


def test_compressor_throughput_rows_time_every_codec_beside_its_primitive_and_a_copy():
    from commlab.bench.compressors import bench_compressor_throughput

    # 3 * 1024 + 5 entries: not a multiple of QSGD's 512, so the primitive takes one bucket; timings not asserted.
    rows = bench_compressor_throughput(numel=3 * 1024 + 5, repeats=1)
    assert [r.name for r in rows] == ["cast-fp16", "cast-bf16", "topk(0.01)", "randomk(0.01)",
                                      "qsgd(s=7,4bit,d=512)", "int8", "sign"]
    for r in rows:
        assert r.nbytes == (3 * 1024 + 5) * 4 and 0 < r.payload_nbytes < r.nbytes
        assert r.seconds > 0 and r.primitive_seconds > 0 and r.copy_seconds > 0
        assert r.copy_gb_per_s == r.nbytes / r.copy_seconds / 1e9 and r.copy_ratio == r.seconds / r.copy_seconds
    assert rows[4].payload_nbytes == (3 * 1024 + 5 + 1) // 2 + 4 * 7  # 7 norms: 6 buckets of 512 and one of 5


def test_ring_attention_bench_prints_ring_beside_all_gather(capsys):
    assert main(["bench", "--ring-attention", "-n", "2", "--seq-lengths", "8,16", "-r", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [r[0] for r in rows] == ["8", "16"] and all(r[-1] == "0" for r in rows)
    assert "ring/ag" in out and "elements that differ: 0 OK" in out
    # bytes per rank, fwd + bwd, at seq 8: K block 1*4*4*64*4 = 4 KiB; ring 2*4 + (2*4 + 2*2*4) = 32 KiB.
    assert rows[0][7] == "32.0" and rows[0][8] == "16.0"


@pytest.mark.parametrize("flags, message", [
    (["--seq-lengths", "8"], "--seq-lengths applies to --ring-attention only"),
    (["--ring-attention", "-n", "1"], "--ring-attention needs --world-size >= 2"),
    (["--ring-attention", "-n", "2", "--seq-lengths", "8,10"], "multiples of 2 x --world-size = 4"),
    (["--ring-attention", "-n", "2", "--seq-lengths", "8,x"], "comma list of ints"),
    (["--ring-attention", "-n", "3", "--seq-lengths", "12"], "--world-size must divide 4"),
    (["--ring-attention", "--check"], "--check applies to the AllReduce table only"),
])
def test_ring_attention_bench_usage_errors(flags, message, capsys):
    code, err = _usage_error(flags, capsys)
    assert code == 2 and message in err, err


@pytest.mark.slow
def test_sharded_bench_runs_on_a_tiny_model():
    """bench --sharded's measurement (ours with and without prefetch beside FSDP2), on a model small enough to be
    cheap: the rows are complete; nothing is asserted on the times."""
    from commlab.bench.sharded import bench_sharded
    rows = bench_sharded(2, widths=(16, 8, 4), batch_size=4, steps=1, warmup=1, timeout=60)
    assert [r.prefetch for r in rows] == [True, False]
    for r in rows:
        assert r.ours_s > 0 and r.fsdp2_s > 0 and r.ratio > 0 and r.comm_s > 0 and 0 <= r.overlap_fraction <= 1
