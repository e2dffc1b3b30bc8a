"""Which communication a profiled training step hid under compute, which it exposed, and what its end waited on.

:func:`check_overlap` reads a ``torch.profiler`` trace (Chrome JSON as ``prof.export_chrome_trace`` writes it, or
gzip'd) with :func:`load_trace`, picks one step (a ``ProfilerStep#N``, ``overlap::step``, ``sharded::step`` or
``capstone::stepN`` range) and returns an :class:`OverlapReport`: per kind of communication (:data:`KIND_TABLE`,
the one place names are classified), the seconds hidden under compute and exposed, and the step's critical path.
:func:`format_report` prints it as a table; ``python -m commlab overlap-check TRACE`` runs both.

Two timelines. With GPU kernels in the step: compute = the non-NCCL kernels, communication = the NCCL kernels
(``ncclDevKernel_*``, ``ncclKernel_*``), and an NCCL kernel on a stream that also runs compute is flagged (it hides
nothing). Without: compute = the operators on the training threads but where one waits for a collective it
launched, communication = gloo's events on its worker threads with the ``c10d::`` calls that launched them. Per
kind K with U_K the union of its intervals and C the union of compute: hidden = |U_K ∩ C|, exposed = |U_K| - hidden.
Book: chapter 9, §9.6 (the profile of a DP step it reads) and chapter 12 (sharded steps).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
from typing import Sequence

from commlab import checks
from commlab.overlap.profile import intersection_of_unions, merged_intervals, union_length

__all__ = ["TraceError", "TraceEvent", "Trace", "KindRow", "PathSegment", "OverlapReport", "KIND_TABLE",
           "OP_TABLE", "STEP_MARKERS", "load_trace", "check_overlap", "format_report", "condensed_path", "classify_op",
           "kind_of"]

DP, ZERO_AG, ZERO_RS, TP, PP, COMPRESS = ("DP AllReduce", "ZeRO/FSDP AllGather", "ZeRO/FSDP ReduceScatter", "TP",
                                          "PP send/recv", "compressor")
MEASURE = "step statistics"

#: The one table of kinds: a regular expression on a range's name (the event's own, an enclosing range on the
#: thread that launched it, or its process group's description) and the kind it names. The first match wins.
#: Communication matching no row is reported as ``"unknown <op>"``, but for point-to-point, which is ``PP send/recv``.
KIND_TABLE: tuple[tuple[str, str], ...] = (
    (r"^overlap::(launch|done)::bucket\d+$", DP),              # commlab.overlap.BucketedDataParallel
    (r"^sharded::(wait_)?all_gather::unit\d+$", ZERO_AG),      # commlab.parallel.ShardedDataParallel
    (r"^sharded::(reduce_scatter::unit\d+|wait_reduce_scatter)$", ZERO_RS),
    (r"^sharded::all_reduce::unit\d+$", DP),                   # HSDP's AllReduce of a shard across replicas
    (r"^FSDP::.*all_gather", ZERO_AG),                         # torch's fully_shard
    (r"^FSDP::.*reduce", ZERO_RS),
    (r"^(compress|compressor)::|powersgd|PowerSGD", COMPRESS),
    (r"^(tp|TP)(::|$)|^mesh_tp$|tensor_parallel", TP),
    (r"^(pp|PP)(::|$)|^mesh_pp$|pipeline", PP),
    (r"^(dp|DP)(::|$)|^mesh_dp$|^DistributedDataParallel", DP),
    (r"^stats::", MEASURE),                                     # the capstone's per-rank StepStats AllGather
)

#: Collective of a communication event, from its name (gloo worker events ``gloo:all_reduce``, ``c10d::`` calls,
#: NCCL kernels ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``). The first match wins.
OP_TABLE: tuple[tuple[str, str], ...] = (
    (r"reduce_?scatter", "ReduceScatter"),
    (r"all_?gather", "AllGather"),
    (r"all_?reduce", "AllReduce"),
    (r"all_?to_?all", "AllToAll"),
    (r"send|recv", "Send/Recv"),
    (r"broadcast", "Broadcast"),
    (r"barrier", "Barrier"),
    (r"reduce", "Reduce"),
    (r"gather", "Gather"),
    (r"scatter", "Scatter"),
)

#: Ranges that delimit a step, in the order they are looked for.
STEP_MARKERS: tuple[str, ...] = (r"ProfilerStep#\d+", r"overlap::step", r"sharded::step", r"capstone::step\d+")

_NCCL_KERNEL = re.compile(r"^nccl\w*Kernel", re.IGNORECASE)   # ncclDevKernel_*, ncclKernel_*, ncclAllReduceRingLLKernel
_GLOO_WORKER = re.compile(r"^gloo:")
_CPU_COMM = re.compile(r"^(c10d::|record_param_comms$|nccl:)")
_KINDS = tuple((re.compile(p), k) for p, k in KIND_TABLE)
_OPS = tuple((re.compile(p, re.IGNORECASE), o) for p, o in OP_TABLE)
_CPU_CATS = ("cpu_op", "user_annotation")
_EPS = 1e-9


class TraceError(ValueError):
    """A file that is not a usable ``torch.profiler`` trace: not JSON, no events, no step, no such step."""


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One complete (``"ph": "X"``) event: seconds on the trace's clock; ``lane`` is ``("cpu", pid, tid)`` or
    ``("gpu", device, stream)``."""

    name: str
    cat: str
    lane: tuple
    start_s: float
    end_s: float
    args: dict


@dataclasses.dataclass(frozen=True)
class Trace:
    """A loaded trace: its complete events, and the rank and world size it names (None when it names none)."""

    source: str
    events: tuple[TraceEvent, ...]
    rank: int | None
    world_size: int | None
    groups: dict


@dataclasses.dataclass(frozen=True)
class KindRow:
    """One kind of communication in the step: operations, seconds of its union, hidden and exposed; and how many
    of its NCCL kernels ran on a stream that also ran compute."""

    kind: str
    count: int
    total_s: float
    hidden_s: float
    exposed_s: float
    on_compute_stream: int = 0

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_s / self.total_s if self.total_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class PathSegment:
    """A piece of the critical path: ``label`` is ``compute``, ``idle`` or a kind; seconds from the step's start;
    ``name``, the event it waited on (communication only)."""

    label: str
    start_s: float
    end_s: float
    name: str | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclasses.dataclass(frozen=True)
class OverlapReport:
    """The checker's answer for one step of one trace (module docstring for the definitions).

    Attributes:
        source, rank, world_size: the trace. step, steps, marker: which step (0-based) of how many, its range's name.
        timeline: ``"cuda"`` or ``"cpu"``. step_s: the window (the step, stretched to its last kernel). compute_s: |C|.
        rows: one :class:`KindRow` per kind, by exposed seconds (largest first). all_comm: the union of every kind.
        critical_path: :class:`PathSegment` from the step's start to its end. warnings: lines to print.
    """

    source: str
    rank: int | None
    world_size: int | None
    step: int
    steps: int
    marker: str
    timeline: str
    step_s: float
    compute_s: float
    rows: tuple[KindRow, ...]
    all_comm: KindRow
    critical_path: tuple[PathSegment, ...]
    warnings: tuple[str, ...] = ()

    def path_totals(self) -> dict[str, float]:
        """Seconds of the critical path per label, largest first."""
        out: dict[str, float] = {}
        for seg in self.critical_path:
            out[seg.label] = out.get(seg.label, 0.0) + seg.duration_s
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def classify_op(name: str) -> str | None:
    """The collective a communication event's name says (:data:`OP_TABLE`), or None."""
    for pat, op in _OPS:
        if pat.search(name):
            return op
    return None


def kind_of(name: str) -> str | None:
    """The kind a range's (or process group's) name says (:data:`KIND_TABLE`), or None."""
    for pat, kind in _KINDS:
        if pat.search(name):
            return kind
    return None


def load_trace(source: str | os.PathLike | dict | list) -> Trace:
    """Read a Chrome trace: a path (JSON, or gzip'd JSON), or the parsed object (``{"traceEvents": [...]}`` or a
    bare list of events). Times become seconds.

    Raises:
        TraceError: the file is missing or not JSON, not a trace object, or holds no complete events.
    """
    name = str(source) if isinstance(source, (str, os.PathLike)) else "<trace>"
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise TraceError(f"cannot read trace {name!r}: {e.strerror or e}") from e
        try:
            if raw[:2] == b"\x1f\x8b":
                raw = gzip.decompress(raw)
            data = json.loads(raw.decode("utf-8"))
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TraceError(f"{name} is not a Chrome trace: not (gzip'd) JSON ({e})") from e
    else:
        data = source
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        raw_events, meta = data["traceEvents"], data
    elif isinstance(data, list):
        raw_events, meta = data, {}
    else:
        keys = f" with keys {sorted(data)[:6]}" if isinstance(data, dict) else ""
        raise TraceError(f"{name} is not a Chrome trace: expected an object with a 'traceEvents' list or a list of "
                         f"events, got {type(data).__name__}{keys}")
    events = []
    for e in raw_events:
        if not isinstance(e, dict) or e.get("ph") != "X" or not checks.is_number(e.get("ts")) \
                or not checks.is_number(e.get("dur")):
            continue
        cat = str(e.get("cat", "")).lower()
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        if cat == "kernel" or cat.startswith("gpu_"):
            lane = ("gpu", args.get("device", e.get("pid")), args.get("stream", e.get("tid")))
        else:
            lane = ("cpu", e.get("pid"), e.get("tid"))
        start = float(e["ts"]) * 1e-6
        events.append(TraceEvent(str(e.get("name", "")), cat, lane, start, start + max(0.0, float(e["dur"])) * 1e-6,
                                 args))
    if not events:
        raise TraceError(f"{name} holds no complete ('ph': 'X') events: an empty trace (was the profiler running "
                         "around the step?)")
    dist_info = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    groups = {str(g.get("pg_name")): str(g.get("pg_desc", "")) for g in dist_info.get("pg_config", []) or []
              if isinstance(g, dict)}
    rank, world = dist_info.get("rank"), dist_info.get("world_size")
    return Trace(name, tuple(sorted(events, key=lambda ev: (ev.start_s, -ev.end_s))),
                 rank if checks.is_int(rank) else None, world if checks.is_int(world) else None, groups)


def _steps(trace: Trace) -> tuple[str, list[TraceEvent]]:
    for marker in STEP_MARKERS:
        pat = re.compile(marker + "$")
        found = [e for e in trace.events if e.lane[0] == "cpu" and pat.match(e.name)]
        if found:
            return marker, found
    raise TraceError(f"{trace.source} has no step marker: no range named "
                     f"{', '.join(m.replace(chr(92) + 'd+', 'N') for m in STEP_MARKERS)}; wrap each step in "
                     "record_function('overlap::step') or call prof.step() under a profiler schedule")


def _enclosing_kind(e: TraceEvent, contexts: dict[tuple, list[tuple[TraceEvent, str]]]) -> str | None:
    """The kind of the innermost kind-naming range on ``e``'s lane that contains it (``e`` itself included)."""
    best = None
    for c, kind in contexts.get(e.lane, ()):
        if c.start_s <= e.start_s + _EPS and e.end_s <= c.end_s + _EPS:
            if best is None or c.end_s - c.start_s <= best[0].end_s - best[0].start_s:
                best = (c, kind)
    return best[1] if best else None


def _group_kind(e: TraceEvent, groups: dict, op: str | None) -> str | None:
    """The kind the event's process group's description names (a DP group's AllGather or ReduceScatter is ZeRO's)."""
    desc = next((e.args[k] for k in ("Process Group Description", "pg_desc") if isinstance(e.args.get(k), str)), None)
    name = e.args.get("Process Group Name", e.args.get("pg_name"))
    if desc is None and name is not None:
        desc = groups.get(str(name))
    kind = kind_of(desc) if desc else None
    if kind == DP and op in ("AllGather", "ReduceScatter"):
        return ZERO_AG if op == "AllGather" else ZERO_RS
    return kind


def _default_kind(op: str | None) -> str:
    if op == "Send/Recv":
        return PP
    return f"unknown {op or 'communication'}"


@dataclasses.dataclass
class _Item:
    kind: str
    name: str
    intervals: list
    on_compute_stream: bool = False


def _subtract(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(∪ a) minus (∪ b), merged."""
    out, b = [], merged_intervals(b)
    for s, e in merged_intervals(a):
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out


def _blocked(ops: Sequence[TraceEvent]) -> list[tuple[float, float]]:
    """Where an operator waits for a collective it launched: from a communication call among its children to
    its next other child (or its end). Not compute (an autograd function of TP that all-reduces and waits)."""
    out: list[tuple[float, float]] = []
    children: dict[int, list[TraceEvent]] = {}
    stacks: dict[tuple, list[TraceEvent]] = {}
    for e in ops:   # sorted by start, the outer first
        stack = stacks.setdefault(e.lane, [])
        while stack and stack[-1].end_s <= e.start_s + _EPS:
            stack.pop()
        if stack:
            children.setdefault(id(stack[-1]), []).append(e)
        stack.append(e)
    for e in ops:
        kids = children.get(id(e), [])
        for i, c in enumerate(kids):
            if _CPU_COMM.match(c.name) and not _CPU_COMM.match(e.name):
                nxt = next((k.start_s for k in kids[i + 1:] if not _CPU_COMM.match(k.name)), e.end_s)
                if nxt > c.end_s:
                    out.append((c.end_s, nxt))
    return out


def _cpu_timeline(trace, s0, s1, contexts):
    """Compute intervals and communication items of a CPU (gloo) step inside [s0, s1]."""
    ev = [e for e in trace.events if e.lane[0] == "cpu"]   # the whole trace: a launch may precede the step
    # gloo's worker threads run its collectives; a training thread makes c10d:: calls (and runs gloo's send/recv)
    calling = {e.lane for e in ev if e.name.startswith("c10d::")}
    worker_lanes = {e.lane for e in ev if _GLOO_WORKER.match(e.name)} - calling
    train = [e for e in ev if e.lane not in worker_lanes]
    comm_calls = [e for e in train if _CPU_COMM.match(e.name) and e.cat == "cpu_op"]
    compress = [e for e in train if kind_of(e.name) == COMPRESS]
    ops = [e for e in train if e.cat == "cpu_op"]
    compute = _subtract([(e.start_s, e.end_s) for e in ops],
                        [(e.start_s, e.end_s) for e in comm_calls + compress] + _blocked(ops))
    items: list[_Item] = []
    launches = [e for e in comm_calls if e.name.startswith("c10d::") and classify_op(e.name) != "Send/Recv"]
    by_call: dict[int, _Item] = {}
    outer: dict[tuple, float] = {}
    for e in comm_calls:   # in start order, the outer call first
        if e.end_s <= outer.get(e.lane, float("-inf")) + _EPS:
            continue   # record_param_comms inside its c10d:: call: one operation
        outer[e.lane] = e.end_s
        op = classify_op(e.name)
        kind = _enclosing_kind(e, contexts) or _group_kind(e, trace.groups, op) or _default_kind(op)
        by_call[id(e)] = _Item(kind, e.name, [(e.start_s, e.end_s)])
        items.append(by_call[id(e)])
    launches = [c for c in launches if id(c) in by_call]
    last_call: dict[tuple, _Item] = {}
    for e in sorted(comm_calls + [e for e in train if _GLOO_WORKER.match(e.name)], key=lambda e: e.start_s):
        if id(e) in by_call:
            last_call[e.lane] = by_call[id(e)]
        elif _GLOO_WORKER.match(e.name):   # gloo's send/recv, run by the calling thread: part of its call
            item = last_call.get(e.lane)
            if item is not None and classify_op(item.name) == classify_op(e.name):
                item.intervals.append((e.start_s, e.end_s))
            else:
                items.append(_Item(_default_kind(classify_op(e.name)), e.name, [(e.start_s, e.end_s)]))
    nxt = 0
    for w in (e for e in ev if _GLOO_WORKER.match(e.name) and e.lane in worker_lanes):
        if nxt < len(launches) and launches[nxt].start_s <= w.start_s + _EPS:
            # gloo runs the calls in the order they were made: a worker event is the oldest unmatched call's
            by_call[id(launches[nxt])].intervals.append((w.start_s, w.end_s))
            nxt += 1
        else:
            op = classify_op(w.name)
            items.append(_Item(_group_kind(w, trace.groups, op) or _default_kind(op), w.name,
                               [(w.start_s, w.end_s)]))
    for e in compress:
        items.append(_Item(COMPRESS, e.name, [(e.start_s, e.end_s)]))
    return compute, items, s1


def _gpu_timeline(trace, s0, s1, contexts):
    """Compute intervals and communication items of a CUDA step: kernels launched from inside [s0, s1]."""
    launch_at = {e.args["correlation"]: e for e in trace.events
                 if e.lane[0] == "cpu" and "correlation" in e.args}
    op_at = {e.args["External id"]: e for e in trace.events   # a kernel's "External id" is its operator's
             if e.lane[0] == "cpu" and e.cat == "cpu_op" and "External id" in e.args}
    kernels = []
    for e in trace.events:
        if e.cat != "kernel":
            continue
        launch = launch_at.get(e.args.get("correlation")) or op_at.get(e.args.get("External id"))
        when = launch.start_s if launch is not None else e.start_s
        if s0 <= when <= s1:
            kernels.append((e, launch))
    if not kernels:
        return None
    compute_lanes = set()
    compute, items = [], []
    for e, launch in kernels:
        ctx = _enclosing_kind(launch, contexts) if launch is not None else None
        if _NCCL_KERNEL.match(e.name):
            continue
        if ctx == COMPRESS:
            items.append(_Item(COMPRESS, e.name, [(e.start_s, e.end_s)]))
        else:
            compute.append((e.start_s, e.end_s))
            compute_lanes.add(e.lane)
    for e, launch in kernels:
        if not _NCCL_KERNEL.match(e.name):
            continue
        ctx = _enclosing_kind(launch, contexts) if launch is not None else None
        op = classify_op(re.sub(r"^nccl(Dev)?Kernel_?", "", e.name, flags=re.IGNORECASE))
        kind = ctx or _group_kind(e, trace.groups, op) or _default_kind(op)
        items.append(_Item(kind, e.name, [(e.start_s, e.end_s)], e.lane in compute_lanes))
    end = max([s1] + [e.end_s for e, _ in kernels])
    return merged_intervals(compute), items, end


def _critical_path(w0: float, w1: float, compute, items) -> list[PathSegment]:
    """Walk back from the window's end: compute running just before t is on the path (back to its block's start);
    else the communication running just before t that ends last, back to its start or to the last compute before
    t; else an idle gap back to the last end. Seconds from ``w0``."""
    comm = [(max(s, w0), min(e, w1), it) for it in items for s, e in it.intervals if min(e, w1) > max(s, w0)]
    blocks = [(max(s, w0), min(e, w1)) for s, e in merged_intervals(compute) if min(e, w1) > max(s, w0)]
    path, t = [], w1
    while t > w0 + _EPS:
        c = next(((s, e) for s, e in blocks if s < t - _EPS and e >= t - _EPS), None)
        if c is not None:
            path.append(PathSegment("compute", c[0] - w0, t - w0))
            t = c[0]
            continue
        last_compute = max([e for _, e in blocks if e < t - _EPS], default=w0)
        running = [(e, s, it) for s, e, it in comm if s < t - _EPS and e >= t - _EPS]
        if running:
            e, s, it = max(running, key=lambda r: (r[0], r[1]))
            lo = max(s, last_compute)
            path.append(PathSegment(it.kind, lo - w0, t - w0, it.name))
            t = lo
            continue
        lo = max([last_compute] + [e for _, e, _ in comm if e < t - _EPS])
        path.append(PathSegment("idle", lo - w0, t - w0))
        t = lo
    path.reverse()
    merged: list[PathSegment] = []
    for seg in path:   # consecutive pieces of one label (and one event) are one segment
        if merged and merged[-1].label == seg.label and merged[-1].name == seg.name:
            merged[-1] = PathSegment(seg.label, merged[-1].start_s, seg.end_s, seg.name)
        else:
            merged.append(seg)
    return merged


def condensed_path(path: Sequence[PathSegment], min_s: float = 0.0) -> list[tuple[str, float, float, float]]:
    """The critical path as runs: each communication segment of at least ``min_s`` seconds alone (shorter ones
    and idle gaps count into the stretch around them), and each stretch between them as one ``compute`` run.
    ``(label, start_s, end_s, idle_s)``, idle_s being the idle seconds inside a compute run."""
    runs: list[list] = []
    for seg in path:
        comm = seg.label not in ("compute", "idle") and seg.duration_s >= min_s
        if runs and not comm and runs[-1][0] == "compute":
            runs[-1][2] = seg.end_s
            runs[-1][3] += seg.duration_s if seg.label != "compute" else 0.0
        elif comm and runs and runs[-1][0] == seg.label:
            runs[-1][2] = seg.end_s
        else:
            runs.append([seg.label if comm else "compute", seg.start_s, seg.end_s,
                         seg.duration_s if not comm and seg.label != "compute" else 0.0])
    return [tuple(r) for r in runs]


def check_overlap(trace: Trace | str | os.PathLike | dict | list, step: int | None = None) -> OverlapReport:
    """Hidden and exposed seconds per kind of communication, and the critical path, of one step of a trace.

    Args:
        trace: a :class:`Trace` or anything :func:`load_trace` reads.
        step: which step, 0-based in time order (default: the last, the warmest).

    Returns:
        :class:`OverlapReport` (the module docstring defines its figures).

    Raises:
        TraceError: what :func:`load_trace` raises; no step marker; ``step`` out of range.
    """
    if not isinstance(trace, Trace):
        trace = load_trace(trace)
    marker, steps = _steps(trace)
    if step is None:
        step = len(steps) - 1
    try:
        step = checks.integer("step", step, least=0, most=len(steps) - 1,
                              note=f"{trace.source} has {len(steps)} '{marker}' steps")
    except ValueError as e:
        raise TraceError(str(e)) from None
    st = steps[step]
    s0, s1 = st.start_s, st.end_s
    contexts: dict[tuple, list] = {}
    for e in trace.events:
        if e.lane[0] == "cpu" and (k := kind_of(e.name)):
            contexts.setdefault(e.lane, []).append((e, k))
    gpu = _gpu_timeline(trace, s0, s1, contexts)
    timeline = "cuda" if gpu is not None else "cpu"
    compute, items, w1 = gpu if gpu is not None else _cpu_timeline(trace, s0, s1, contexts)
    compute = [(max(s, s0), min(e, w1)) for s, e in compute if min(e, w1) > max(s, s0)]

    def row(kind, its):
        iv = [(max(s, s0), min(e, w1)) for it in its for s, e in it.intervals if min(e, w1) > max(s, s0)]
        total = union_length(iv)
        hidden = intersection_of_unions(iv, compute)
        return KindRow(kind, len(its), total, hidden, total - hidden, sum(it.on_compute_stream for it in its))

    # an operation belongs to the step it started in (gloo's last event may end after its step)
    kept = [it for it in items if s0 - _EPS <= min(s for s, _ in it.intervals) < w1]
    kinds = sorted({it.kind for it in kept})
    rows = sorted((row(k, [it for it in kept if it.kind == k]) for k in kinds), key=lambda r: (-r.exposed_s, r.kind))
    warnings = []
    for r in rows:
        if r.on_compute_stream:
            warnings.append(f"{r.kind}: {r.on_compute_stream} NCCL kernel(s) ran on a stream that also runs compute "
                            "kernels: they hide nothing there (run communication on its own stream)")
        if r.kind.startswith("unknown"):
            warnings.append(f"{r.kind}: no range names its kind (commlab.overlap.trace.KIND_TABLE); wrap the call "
                            "in record_function('tp::...'), ('dp::...'), ('pp::...') to name it")
    if timeline == "cpu" and not any(_GLOO_WORKER.match(e.name) for e in trace.events):
        warnings.append("no gloo worker events: profile with experimental_config=_ExperimentalConfig("
                        "profile_all_threads=True) (commlab.overlap.profile.all_threads_config), or only the "
                        "c10d:: launches are seen")
    return OverlapReport(source=trace.source, rank=trace.rank, world_size=trace.world_size, step=step,
                         steps=len(steps), marker=st.name, timeline=timeline, step_s=w1 - s0,
                         compute_s=union_length(compute), rows=tuple(rows), all_comm=row("all", kept),
                         critical_path=tuple(_critical_path(s0, w1, compute, kept)), warnings=tuple(warnings))


def format_report(report: OverlapReport, tail: int = 6) -> str:
    """The report as nccl-tests prints its table: a ``#`` header, one row per kind, then the critical path
    (seconds per label, and its last ``tail`` runs, communication under 1 % of the step counted into the compute
    around it: what the step's end waited on)."""
    who = f"rank {report.rank}/{report.world_size}" if report.rank is not None else "rank ?"
    lines = [f"# overlap-check {report.source}: {who}, step {report.step} of {report.steps} ({report.marker}), "
             f"{report.timeline} timeline",
             f"# step {report.step_s:.6f} s, compute {report.compute_s:.6f} s, communication "
             f"{report.all_comm.total_s:.6f} s of which exposed {report.all_comm.exposed_s:.6f} s",
             "#",
             f"# {'kind':>24} {'count':>6} {'total(s)':>10} {'hidden(s)':>10} {'exposed(s)':>10} {'exposed(%)':>10}"]
    for r in report.rows + (report.all_comm,):
        lines.append(f"  {r.kind:>24} {r.count:>6} {r.total_s:>10.6f} {r.hidden_s:>10.6f} {r.exposed_s:>10.6f} "
                     f"{100 * r.exposed_fraction:>10.1f}")
    totals = ", ".join(f"{k} {v:.6f} s" for k, v in report.path_totals().items())
    runs = condensed_path(report.critical_path, min_s=0.01 * report.step_s)
    lines += ["#", f"# critical path: {totals}",
              f"# the step's end waited on (last {min(tail, len(runs))} of {len(runs)} runs, seconds from the "
              "step's start):"]
    for label, a, z, idle in runs[-tail:]:
        within = f" (not computing {idle:.6f} s within)" if idle > 0 else ""
        lines.append(f"#   {a:>10.6f} .. {z:>10.6f}  {label}{within}")
    lines += [f"# warning: {w}" for w in report.warnings]
    return "\n".join(lines)

