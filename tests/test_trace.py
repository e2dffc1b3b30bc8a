"""The overlap checker (commlab.overlap.trace): traces built with known intervals, whose report must match their
construction exactly (a gloo CPU step; CUDA steps with NCCL kernels on the compute stream and on a second
stream: constructed, as no GPU runs the tests), bad input, the CLI, two recorded real gloo traces (tests/data), and a
real gloo DP step with overlap on and off.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from commlab.__main__ import main
from commlab.launch import launch
from commlab.overlap.profile import trace_dp_step
from commlab.overlap.trace import (TraceError, check_overlap, classify_op, condensed_path, format_report, kind_of,
                                   load_trace)

MS = 1e-3


def _x(name, start_ms, end_ms, tid=1, cat="cpu_op", pid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


def _gloo_trace():
    """One 100 ms step on thread 1; gloo workers are threads 2 and 3 (times in ms)."""
    ann = "user_annotation"
    ev = [_x("overlap::step", 0, 100, cat=ann),
          _x("aten::forward_ops", 0, 20), _x("autograd::backward_ops", 20, 60), _x("aten::optimizer", 90, 100),
          _x("aten::mm", 0, 5), _x("aten::mm", 6, 20), _x("aten::mm", 20, 30), _x("aten::mm", 31, 59),
          _x("aten::add_", 90, 92), _x("aten::add_", 93, 96), _x("aten::add_", 97, 100),
          _x("sharded::all_gather::unit0", 4.5, 6.5, cat=ann), _x("c10d::_allgather_base_", 5, 6),
          _x("gloo:all_gather", 6, 15, tid=3, cat=ann),
          _x("overlap::launch::bucket0", 29.5, 31.5, cat=ann), _x("c10d::allreduce_", 30, 31),
          _x("record_param_comms", 30.2, 30.8), _x("gloo:all_reduce", 31, 50, tid=2, cat=ann),
          _x("overlap::done::bucket0", 49, 49.5, tid=2, cat=ann),
          _x("overlap::launch::bucket1", 58.5, 60.5, cat=ann), _x("c10d::allreduce_", 59, 60),
          _x("gloo:all_reduce", 60, 85, tid=3, cat=ann), _x("overlap::wait", 60.5, 88, cat=ann),
          _x("c10d::broadcast_", 92, 93), _x("gloo:broadcast", 93, 95, tid=2, cat=ann),
          _x("c10d::send", 96, 97)]
    meta = {"ph": "M", "name": "thread_name", "pid": 100, "tid": 2, "args": {"name": "pt_gloo_runloop"}}
    return {"traceEvents": [meta] + ev, "distributedInfo": {"backend": "gloo", "rank": 1, "world_size": 2}}


def _rows(report):
    return {r.kind: (r.count, r.total_s, r.hidden_s, r.exposed_s, r.on_compute_stream) for r in report.rows}


def _approx(rows):
    return {k: (c, pytest.approx(t * MS, abs=1e-9), pytest.approx(h * MS, abs=1e-9), pytest.approx(e * MS, abs=1e-9), f)
            for k, (c, t, h, e, f) in rows.items()}


def _path(report):
    return [(s.label, pytest.approx(s.start_s / MS, abs=1e-6), pytest.approx(s.end_s / MS, abs=1e-6))
            for s in report.critical_path]


def test_gloo_trace_report_matches_its_construction():
    r = check_overlap(_gloo_trace())
    assert (r.timeline, r.rank, r.world_size, r.step, r.steps, r.marker) == ("cpu", 1, 2, 0, 1, "overlap::step")
    assert r.step_s == pytest.approx(0.1, abs=1e-9)
    # compute: the operators minus the c10d calls inside them (5 + 24 + 28 + 2 + 3 + 3 ms)
    assert r.compute_s == pytest.approx(65 * MS, abs=1e-9)
    assert _rows(r) == _approx({"DP AllReduce": (2, 46, 19, 27, 0), "ZeRO/FSDP AllGather": (1, 10, 9, 1, 0),
                                "unknown Broadcast": (1, 3, 2, 1, 0), "PP send/recv": (1, 1, 0, 1, 0)})
    assert [r.kind for r in r.rows][0] == "DP AllReduce"   # the most exposed first
    assert (r.all_comm.count, r.all_comm.total_s, r.all_comm.exposed_s) == \
        (5, pytest.approx(60 * MS), pytest.approx(30 * MS))
    assert _path(r) == [("compute", 0, 5), ("ZeRO/FSDP AllGather", 5, 6), ("compute", 6, 30), ("DP AllReduce", 30, 31),
                        ("compute", 31, 59), ("DP AllReduce", 59, 85), ("idle", 85, 90), ("compute", 90, 92),
                        ("unknown Broadcast", 92, 93), ("compute", 93, 96), ("PP send/recv", 96, 97),
                        ("compute", 97, 100)]
    assert r.path_totals() == pytest.approx({"compute": 65 * MS, "DP AllReduce": 27 * MS, "idle": 5 * MS,
                                             "ZeRO/FSDP AllGather": MS, "unknown Broadcast": MS, "PP send/recv": MS})
    runs = condensed_path(r.critical_path, min_s=2 * MS)   # the 1 ms pieces count into the compute around them
    assert [(label, round(a / MS, 6), round(z / MS, 6)) for label, a, z, _ in runs] == \
        [("compute", 0, 59), ("DP AllReduce", 59, 85), ("compute", 85, 100)]
    assert any("unknown Broadcast" in w for w in r.warnings)
    text = format_report(r)
    assert "DP AllReduce      2   0.046000   0.019000   0.027000       58.7" in text
    assert "all      5   0.060000   0.030000   0.030000       50.0" in text


def test_an_operator_waiting_for_its_collective_is_not_compute():
    """A TP backward that all-reduces and waits inside one autograd operator (0-10 ms): compute only where its
    children run."""
    ann = "user_annotation"
    trace = [_x("ProfilerStep#0", 0, 10, cat=ann), _x("autograd::engine::evaluate_function: TPBackward", 0, 10),
             _x("aten::mm", 0, 2), _x("tp::all_reduce", 2, 3.5, cat=ann), _x("c10d::allreduce_", 2, 3),
             _x("gloo:all_reduce", 3, 8, tid=2, cat=ann), _x("aten::add", 8, 10)]
    r = check_overlap(trace)
    assert r.compute_s == pytest.approx(4 * MS)
    assert _rows(r) == _approx({"TP": (1, 6, 0, 6, 0)})
    assert _path(r) == [("compute", 0, 2), ("TP", 2, 8), ("compute", 8, 10)]


def test_compressor_work_is_its_own_kind_and_not_compute():
    """A compressor range (2-5 ms) on the training thread inside a 0-10 ms operator: its seconds are the
    compressor's, exposed, since the training thread does nothing else meanwhile."""
    trace = [_x("ProfilerStep#0", 0, 10, cat="user_annotation"), _x("aten::backward_ops", 0, 10),
             _x("compress::powersgd", 2, 5, cat="user_annotation"), _x("aten::mm", 2, 5)]
    r = check_overlap(trace)
    assert r.compute_s == pytest.approx(7 * MS)
    assert _rows(r) == _approx({"compressor": (1, 3, 0, 3, 0)})


def _cuda_trace(two_streams: bool):
    """ProfilerStep#3, 0-10 ms on the CPU; kernels on device 0 (pid 0), streams 7 (compute) and 13, 20."""
    ev = [_x("ProfilerStep#2", -20, -10, cat="user_annotation"), _x("ProfilerStep#3", 0, 10, cat="user_annotation"),
          _x("tp::row_parallel", 0.6, 0.9, cat="user_annotation"),
          _x("FSDP::all_gather", 0.3, 0.5, cat="user_annotation")]
    corr = [0]

    def kernel(name, start, end, stream, at, **args):
        corr[0] += 1
        ev.append(_x("cudaLaunchKernel", at, at + 0.05, cat="cuda_runtime", correlation=corr[0]))
        ev.append(_x(name, start, end, tid=stream, pid=0, cat="kernel", device=0, stream=stream,
                     correlation=corr[0], **args))

    kernel("ampere_sgemm_128x64_nn", 1, 4, 7, 0.1)
    kernel("ampere_sgemm_128x64_tn", 4, 8, 7, 0.2)
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 8, 10, 7, 0.7)      # launched inside tp::: on the compute stream
    if two_streams:
        kernel("ncclDevKernel_AllGather_RING_LL", 2, 6, 13, 0.4)           # launched inside FSDP::all_gather
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 9, 11, 13, 1.0,
               **{"Process Group Description": "mesh_dp"})                # named by its group
        kernel("ncclDevKernel_SendRecv", 10, 10.5, 20, 1.1)              # no context: point-to-point
        kernel("ampere_sgemm_late", 40, 41, 7, 15)                       # launched in no step: ignored
    return {"traceEvents": ev}


def test_cuda_trace_with_nccl_on_the_compute_stream_hides_nothing():
    r = check_overlap(_cuda_trace(two_streams=False))
    assert (r.timeline, r.step, r.steps, r.marker) == ("cuda", 1, 2, "ProfilerStep#3")
    assert r.compute_s == pytest.approx(7 * MS) and r.step_s == pytest.approx(10 * MS)
    assert _rows(r) == _approx({"TP": (1, 2, 0, 2, 1)})
    assert any("TP: 1 NCCL kernel(s) ran on a stream that also runs compute" in w for w in r.warnings)
    assert _path(r) == [("idle", 0, 1), ("compute", 1, 8), ("TP", 8, 10)]


def test_cuda_trace_with_two_streams_hides_the_other_streams_kernels():
    r = check_overlap(_cuda_trace(two_streams=True))
    assert r.step_s == pytest.approx(11 * MS)   # the step's window reaches its last kernel
    assert r.compute_s == pytest.approx(7 * MS)
    assert _rows(r) == _approx({"TP": (1, 2, 0, 2, 1), "ZeRO/FSDP AllGather": (1, 4, 4, 0, 0),
                                "ZeRO/FSDP ReduceScatter": (1, 2, 0, 2, 0), "PP send/recv": (1, 0.5, 0, 0.5, 0)})
    assert (r.all_comm.total_s, r.all_comm.hidden_s, r.all_comm.exposed_s) == \
        (pytest.approx(7 * MS), pytest.approx(4 * MS), pytest.approx(3 * MS))
    assert _path(r) == [("idle", 0, 1), ("compute", 1, 8), ("TP", 8, 9), ("ZeRO/FSDP ReduceScatter", 9, 11)]
    first = check_overlap(_cuda_trace(two_streams=True), step=0)   # step 0 launched nothing: the CPU timeline
    assert first.timeline == "cpu" and first.rows == ()


def test_name_tables():
    names = ("gloo:all_reduce", "c10d::_reduce_scatter_base_", "c10d::_allgather_base_", "ncclKernel_SendRecv",
             "c10d::recv_", "gloo:broadcast", "c10d::alltoall_base_")
    assert [classify_op(n) for n in names] == \
        ["AllReduce", "ReduceScatter", "AllGather", "Send/Recv", "Send/Recv", "Broadcast", "AllToAll"]
    trace = [_x("ProfilerStep#0", 0, 10, cat="user_annotation")] + [
        _x(name, i, i + 1, tid=9, pid=0, cat="kernel", device=0, stream=9) for i, name in enumerate((
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "ncclKernel_AllGather_RING_LL_Sum_int8_t", "ncclAllReduceRingLLKernel_sum_f32", "ncclDevKernel_Generic"))]
    assert {r.kind: r.count for r in check_overlap(trace).rows} == \
        {"unknown AllReduce": 2, "unknown AllGather": 1, "unknown communication": 1}
    # No "correlation": the kernel's "External id" names its operator, here inside a tp:: range
    trace += [_x("tp::all_reduce", 0.1, 0.3, cat="user_annotation"),
              _x("c10d::allreduce_", 0.15, 0.2, **{"External id": 5}),
              _x("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 5, 6, tid=9, pid=0, cat="Kernel", stream=9,
                 **{"External id": 5})]
    assert {r.kind: r.count for r in check_overlap(trace).rows}["TP"] == 1
    assert kind_of("stats::all_gather") == "step statistics"   # the capstone's per-rank StepStats gather
    assert kind_of("overlap::launch::bucket12") == "DP AllReduce"
    assert kind_of("sharded::wait_reduce_scatter") == "ZeRO/FSDP ReduceScatter"
    assert kind_of("mesh_tp") == "TP" and kind_of("aten::mm") is None


def test_gzip_and_bare_list_traces_read_alike(tmp_path):
    data = _gloo_trace()
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(json.dumps(data).encode()))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data["traceEvents"]))
    a, b, c = check_overlap(data), check_overlap(gz), check_overlap(str(bare))
    assert a.rows == b.rows and a.critical_path == b.critical_path and b.rank == 1
    assert a.rows == c.rows and c.rank is None


def test_bad_input_gets_clear_errors(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a trace\n")
    with pytest.raises(TraceError, match="notes.txt is not a Chrome trace: not \\(gzip'd\\) JSON"):
        load_trace(text)
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.json")
    with pytest.raises(TraceError, match="expected an object with a 'traceEvents' list"):
        load_trace({"a": 1})
    with pytest.raises(TraceError, match="empty trace"):
        load_trace({"traceEvents": []})
    with pytest.raises(TraceError, match="has no step marker: no range named ProfilerStep#N, overlap::step"):
        check_overlap({"traceEvents": [_x("aten::mm", 0, 1)]})
    with pytest.raises(TraceError, match="step must be an int in 0..0 .* got 3"):
        check_overlap(_gloo_trace(), step=3)


def test_cli_prints_the_table_and_refuses_bad_traces(tmp_path, capsys):
    (tmp_path / "rank1.json").write_text(json.dumps(_gloo_trace()))
    (tmp_path / "rank0.json").write_text(json.dumps(_cuda_trace(two_streams=True)))
    assert main(["overlap-check", str(tmp_path / "rank1.json"), "--step", "0"]) == 0
    out = capsys.readouterr().out
    assert "# overlap-check" in out and "exposed(%)" in out and "# critical path: compute 0.065000 s" in out
    assert main(["overlap-check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.index("cuda timeline") < out.index("cpu timeline")   # rank 0, then rank 1
    assert main(["overlap-check", str(tmp_path), "--rank", "1"]) == 0
    assert "cuda timeline" not in capsys.readouterr().out
    for argv, message in ((["--rank", "5"], "--rank must be one of [0, 1]"), (["--step", "9"], "step must be")):
        with pytest.raises(SystemExit) as e:
            main(["overlap-check", str(tmp_path)] + argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    with pytest.raises(SystemExit):
        main(["overlap-check", str(tmp_path / "empty.json")])
    assert "empty trace" in capsys.readouterr().err


# Real gloo traces, trimmed to one step (cpu_op and user_annotation events only, times rounded) and gzip'd:
# a ZeRO-3 step of commlab.parallel.ShardedDataParallel on 2 ranks (profile_all_threads), and rank 0 of the
# capstone at tp=2 pp=2 dp=1 (labs/capstone/train.py --profile DIR, 4 ranks), whose own log put that step at
# compute 10.2, TP 41.6, PP 44.1 and bubble 24.2 ms.
DATA = Path(__file__).parent / "data"


def test_real_sharded_trace_names_zero_gathers_and_reduce_scatters():
    r = check_overlap(DATA / "trace_sharded_zero3_rank0.json.gz")
    assert (r.timeline, r.rank, r.world_size, r.marker) == ("cpu", 0, 2, "sharded::step")
    assert {row.kind: row.count for row in r.rows} == {"ZeRO/FSDP AllGather": 8, "ZeRO/FSDP ReduceScatter": 4}
    for row in r.rows + (r.all_comm,):
        assert row.hidden_s + row.exposed_s == pytest.approx(row.total_s) and row.hidden_s > 0
    assert sum(r.path_totals().values()) == pytest.approx(r.step_s)


def test_real_capstone_trace_separates_waits_from_compute():
    r = check_overlap(DATA / "trace_capstone_tp2_pp2_rank0.json.gz")
    assert (r.rank, r.world_size, r.marker) == (0, 4, "capstone::step1")
    assert {row.kind: row.count for row in r.rows} == {"PP send/recv": 5, "unknown AllReduce": 21,
                                                       "unknown AllGather": 5, "unknown Broadcast": 1,
                                                       "DP AllReduce": 2}
    # TP's AllReduce is synchronous (launched and waited inside one autograd operator): nothing of it hides.
    tp = next(row for row in r.rows if row.kind == "unknown AllReduce")
    assert tp.hidden_s == 0 and tp.exposed_s == pytest.approx(0.0438, abs=1e-4)
    assert r.compute_s == pytest.approx(0.0103, abs=1e-4)   # the capstone's log: 10.2 ms
    assert any("unknown AllReduce: no range names its kind" in w for w in r.warnings)


# ------------------------------------------------------------------------------------------ a real gloo DP step

def _traced_steps(directory):
    torch.set_num_threads(1)
    return trace_dp_step(directory)


@pytest.mark.timing
def test_real_gloo_dp_step_exposes_more_with_overlap_off(tmp_path):
    reports = {"on": [], "off": []}
    for per_rank in launch(_traced_steps, 2, str(tmp_path), timeout=90):
        (on_path, on_buckets), (off_path, off_buckets) = per_rank["on"], per_rank["off"]
        on, off = check_overlap(on_path), check_overlap(off_path)
        assert on_buckets >= 3 and off_buckets == 1
        assert [r.kind for r in on.rows] == [r.kind for r in off.rows] == ["DP AllReduce"]
        assert (on.rows[0].count, off.rows[0].count) == (on_buckets, 1)   # launched in the step
        # One bucket after backward hides (almost) nothing; buckets overlapped with backward hide most of theirs.
        assert off.rows[0].exposed_fraction > on.rows[0].exposed_fraction, (format_report(on), format_report(off))
        assert off.rows[0].hidden_s < on.rows[0].hidden_s
        reports["on"].append(on)
        reports["off"].append(off)
    # The least over the ranks: a rank's exposed seconds include waiting for a late peer; the rank that arrived
    # last at each AllReduce waited for nobody.
    exposed = {k: min(r.rows[0].exposed_s for r in v) for k, v in reports.items()}
    on_path = {k: min(r.path_totals()["DP AllReduce"] for r in v) for k, v in reports.items()}
    assert exposed["off"] > exposed["on"], "\n".join(format_report(r) for v in reports.values() for r in v)
    assert on_path["off"] > on_path["on"]
