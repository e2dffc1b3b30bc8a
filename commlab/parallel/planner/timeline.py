"""The step timeline of a plan: what every pipeline stage does, second by second, during one training step.

:func:`step_timeline` replays the schedule's own order (GPipe, 1F1B or interleaved 1F1B,
:mod:`commlab.parallel.pipeline.schedules`) on one GPU of every stage, each op lasting what
:func:`~.communication.chunk_ops` says for the costs of :func:`~.time_model.step_costs` (the replay adds no
overlap rule), and returns a :class:`StepTimeline` of :class:`Interval` s. :func:`timeline_from_costs` replays
hand-made costs; :func:`rerank_by_timeline` is the search's final ranking. On uniform stages the replay equals
:func:`~.time_model.step_time` but for the messages' transit. Book: chapter 11, §11.5."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Sequence

from commlab.parallel.pipeline.schedules import (BACKWARD, FORWARD, Op, gpipe_schedule, interleaved_schedule,
                                                 one_f_one_b_schedule)
from commlab import checks
from commlab.parallel.planner.communication import (OpTimes, StageCosts, StepCosts, chunk_ops, dp_times, send_times,
                                                    slowdown_seconds)
from commlab.parallel.planner.memory import Layout, ModelConfig
from commlab.parallel.planner.software import SoftwareProfile
from commlab.parallel.planner.time_model import AUTO, TimeBreakdown, chunk_layers, step_costs
from commlab.topology import Cluster

__all__ = ["KINDS", "COMPUTE_LANE", "COMM_LANE", "TIMELINE_SCHEDULES", "Interval", "StageCosts", "StepCosts",
           "StepTimeline", "chunk_layers", "step_costs", "make_timeline_schedule", "timeline_from_costs", "step_timeline", "rerank_by_timeline", "RERANK_MAX_FACTOR"]

#: :func:`rerank_by_timeline` replays at most this many times ``k`` plans (a bound on the search's time).
RERANK_MAX_FACTOR = 4

#: Interval kinds, in drawing order.
KINDS = ("forward", "backward", "recompute", "slowdown", "tp", "pp_send", "pp_recv", "dp_reduce_scatter",
         "dp_all_gather", "optimizer", "bubble", "idle")

#: The lane of the stream that computes (and stalls on exposed communication).
COMPUTE_LANE = "compute"
#: The lane of communication running beside compute (hidden, or partly hidden).
COMM_LANE = "comm"

#: Schedules :func:`step_timeline` replays.
TIMELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True)
class Interval:
    """One bar: ``kind`` (of :data:`KINDS`) on ``stage`` from ``start_s`` to ``end_s`` (s from the step's start), for
    ``microbatch`` and ``chunk`` (None where not one micro-batch's), on ``lane``."""

    stage: int
    kind: str
    start_s: float
    end_s: float
    microbatch: int | None = None
    chunk: int | None = None
    lane: str = COMPUTE_LANE

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def make_timeline_schedule(name: str | None, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """The op order of ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (None: interleaved when v > 1, else 1F1B).

    Raises:
        ValueError: an unknown name; v < 1; v > 1 with GPipe or 1F1B; what the schedule raises.
    """
    checks.integer("v", v, note="interleave: model chunks per stage")
    if name is None:
        name = "interleaved" if v > 1 else "1f1b"
    if name not in TIMELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {list(TIMELINE_SCHEDULES)}")
    if name == "interleaved":
        return interleaved_schedule(p, m, v)
    if v != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per stage, got v={v}; use 'interleaved'")
    return gpipe_schedule(p, m) if name == "gpipe" else one_f_one_b_schedule(p, m)


@lru_cache(maxsize=256)  # one validation run asks for about 130 different (p, m, v)
def _encoded_schedule(name: str, p: int, m: int, v: int) -> tuple:
    """Per stage, ``(code, dependency code or -1, is_backward, chunk, microbatch, sends)`` of each op in order: the
    schedule as integers, so that a long pipeline replays in a tight loop."""
    last = p * v - 1
    out = []
    for ops in make_timeline_schedule(name, p, m, v):
        row = []
        for op in ops:
            vs = op.chunk * p + op.stage
            backward = op.kind == BACKWARD
            code = (vs * m + op.microbatch) * 2 + backward
            # virtual_dependencies in integers: a forward waits for virtual stage vs-1's forward (code - 2m), a
            # backward for vs+1's backward (code + 2m); the first forward and the last backward for nothing.
            if backward:
                dep, sends = (code + 2 * m if vs < last else -1), vs > 0
            else:
                dep, sends = (code - 2 * m if vs > 0 else -1), vs < last
            row.append((code, dep, backward, op.chunk, op.microbatch, sends))
        out.append(tuple(row))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Op:
    """One op relative to its begin: its bars, when its compute and exposed communication end (its message
    leaves), its send's bars (relative to that) and stream time."""

    bars: tuple
    compute_end: float
    send_bars: tuple
    send_stall: float
    message_s: float


def _op(op: OpTimes, parts: tuple, send: tuple, send_stall: float, message_s: float) -> _Op:
    """Lay out one op priced by :func:`~.communication.chunk_ops` (``parts``: its ``(kind, seconds)`` of compute)."""
    w = op.wait_s
    bars = [("dp_all_gather", 0.0, w, COMPUTE_LANE)] if w > 0 else []
    t = w
    for kind, d in parts:
        if d > 0:
            bars.append((kind, t, t + d, COMPUTE_LANE))
            t += d
    for kind, a, d in (("tp", w, op.tp_hidden_s), ("dp_all_gather", w, op.gather_hidden_s),
                       ("dp_reduce_scatter", w + op.gather_hidden_s, op.reduce_hidden_s)):
        if d > 0:
            bars.append((kind, a, a + d, COMM_LANE))
    for kind, d in (("slowdown", op.slowdown_s), ("tp", op.tp_exposed_s), ("dp_reduce_scatter", op.reduce_exposed_s)):
        if d > 0:
            bars.append((kind, t, t + d, COMPUTE_LANE))
            t += d
    return _Op(tuple(bars), t, send, send_stall, message_s)


def _templates(costs: StepCosts) -> dict:
    """``(stage, chunk, backward)`` -> :class:`_Op`."""
    exposed, slow = send_times(costs.pp_message_s, costs.overlap_pp, costs.compute_slowdown)
    send = tuple(b for b in (("pp_send", 0.0, exposed, COMPUTE_LANE), ("slowdown", exposed, exposed + slow, COMPUTE_LANE),
                             ("pp_send", exposed, costs.pp_message_s, COMM_LANE)) if b[2] > b[1])
    out = {}
    for s, sc in enumerate(costs.stages):
        for c in range(sc.chunks):
            fwd, bwd = chunk_ops(costs, s, c)
            out[(s, c, False)] = _op(fwd, (("forward", sc.forward_s[c]),), send, exposed + slow, costs.pp_message_s)
            out[(s, c, True)] = _op(bwd, (("recompute", sc.recompute_s[c]), ("backward", sc.backward_s[c])), send,
                                    exposed + slow, costs.pp_message_s)
    return out


def _lay(ivs: list | None, stage: int, pieces, t: float, lane: str = COMPUTE_LANE) -> float:
    for kind, d in pieces:
        if d > 0:
            if ivs is not None:
                ivs.append(Interval(stage, kind, t, t + d, None, None, lane))
            t += d
    return t


def timeline_from_costs(costs: StepCosts, schedule: str | None = None, analytical: TimeBreakdown | None = None,
                        layout: Layout | None = None, record: bool = True) -> StepTimeline:
    """Replay ``costs`` under ``schedule``: each op starts when its stage is free and its input has arrived and
    lasts what :func:`~.communication.chunk_ops` says; each stage opens with the exposed DP AllGather and closes
    with the DP reduction, the optimizer step and the rest of the AllGather (:func:`~.communication.dp_times`).
    ``record=False``: the step time only.

    Raises:
        ValueError: as :func:`make_timeline_schedule`; the schedule deadlocks (names the stuck stages).
    """
    p, v, m = costs.pp, costs.interleave, costs.micro_batches
    name = schedule or ("interleaved" if v > 1 else "1f1b")
    order = _encoded_schedule(name, p, m, v)
    dp = [dp_times(costs, s) for s in range(p)]
    late = (1 - costs.overlap_dp_param_gather) * costs.dp_gather_s  # the AllGather after the optimizer step
    tpl = _templates(costs)
    ivs = [] if record else None
    free = [0.0] * p
    for s, (g_exp, g_hid, _, _) in enumerate(dp):  # the overlapped AllGather opens the stage: its exposed part,
        # and its hidden part's slowdown of the first forward (where the stage waits for input, free)
        free[s] = _lay(ivs, s, [("dp_all_gather", max(0.0, g_exp - late)),
                                ("slowdown", slowdown_seconds(g_hid, costs.compute_slowdown))], 0.0)
        _lay(ivs, s, [("dp_all_gather", g_hid)], free[s], COMM_LANE)
    arrival, sent_at = [None] * (2 * m * p * v), [0.0] * (2 * m * p * v)
    done, sent, nxt = {}, {}, [0] * p
    total, ran = sum(len(ops) for ops in order), 0
    while ran < total:
        progressed = False
        for s in range(p):
            ops, i = order[s], nxt[s]
            while i < len(ops):
                code, dep, backward, c, j, sends = ops[i]
                if dep >= 0 and arrival[dep] is None:
                    break
                t = tpl[(s, c, backward)]
                begin = free[s] if dep < 0 else max(free[s], arrival[dep])
                mid = begin + t.compute_end
                end = mid + t.send_stall if sends else mid
                if record:
                    if begin > free[s]:  # waiting: for a message in flight (pp_recv), or for nothing yet (bubble)
                        in_flight = min(max(free[s], sent_at[dep]), begin) if dep >= 0 else begin
                        _lay(ivs, s, [("bubble", in_flight - free[s]), ("pp_recv", begin - in_flight)], free[s])
                    ivs.extend(Interval(s, kind, begin + a, begin + b, j, c, lane) for kind, a, b, lane in t.bars)
                    if sends:
                        ivs.extend(Interval(s, kind, mid + a, mid + b, j, c, lane) for kind, a, b, lane in t.send_bars)
                    key = (s, BACKWARD if backward else FORWARD, j, c)
                    done[key] = (begin, end)
                    if sends:
                        sent[key] = (mid, mid + t.message_s)
                    sent_at[code] = mid
                arrival[code] = mid + t.message_s if sends else end
                free[s] = end
                i, ran, progressed = i + 1, ran + 1, True
            nxt[s] = i
        if not progressed:
            stuck = [f"stage {s} at op {nxt[s]}" for s in range(p) if nxt[s] < len(order[s])]
            raise ValueError(f"the schedule deadlocks: every stage waits ({', '.join(stuck)})")
    ends = []
    for s, (_, _, r_exp, r_hid) in enumerate(dp):  # the reduction beside the last backward, then the step
        _lay(ivs, s, [("dp_reduce_scatter", r_hid)], max(0.0, free[s] - r_hid), COMM_LANE)
        share = [(k, r_exp * d / sum(x for _, x in costs.dp_reduce)) for k, d in costs.dp_reduce] if r_exp else []
        ends.append(_lay(ivs, s, [("slowdown", slowdown_seconds(r_hid, costs.compute_slowdown)), *share,
                                  ("optimizer", costs.optimizer_s), ("dp_all_gather", late)], free[s]))
    step = max(ends)
    if record:
        for s, e in enumerate(ends):
            _lay(ivs, s, [("idle", step - e)], e)
    out = tuple(sorted(ivs or (), key=lambda iv: (iv.stage, iv.lane != COMPUTE_LANE, iv.start_s)))
    return StepTimeline(intervals=out, step_s=step, schedule=name, costs=costs, ops=done, arrivals=sent,
                        analytical=analytical, layout=layout)


@dataclasses.dataclass(frozen=True)
class StepTimeline:
    """One training step, per pipeline stage: ``intervals`` sorted by (stage, lane, start); ``step_s``; ``schedule``;
    the ``costs`` replayed; ``ops`` and ``arrivals``: ``(stage, kind, microbatch, chunk)`` -> ``(start_s, end_s)``
    of each forward and backward, and of the message it sent; the plan's ``analytical`` breakdown and
    ``layout`` (None for hand-made costs)."""

    intervals: tuple
    step_s: float
    schedule: str
    costs: StepCosts
    ops: dict
    arrivals: dict
    analytical: TimeBreakdown | None = None
    layout: Layout | None = None

    @property
    def pp(self) -> int:
        return self.costs.pp

    def stage_intervals(self, stage: int, lane: str | None = COMPUTE_LANE) -> list:
        """The bars of one stage (of one lane; None: both)."""
        return [iv for iv in self.intervals if iv.stage == stage and (lane is None or iv.lane == lane)]

    def time_by_kind(self, stage: int | None = None, lane: str = COMPUTE_LANE) -> dict:
        """Seconds per kind on ``lane`` of one stage (None: all stages), in :data:`KINDS` order; on a stage's compute
        lane they add up to ``step_s``."""
        out = {k: 0.0 for k in KINDS}
        for iv in self.intervals:
            if iv.lane == lane and (stage is None or iv.stage == stage):
                out[iv.kind] += iv.duration_s
        return out


def step_timeline(m: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int,
                  software: SoftwareProfile | str | None = None, schedule: str | None = None,
                  achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
                  dtype: str = "bf16", grad_bytes: int | None = None, optimizer_s: float | None = None,
                  record: bool = True) -> StepTimeline:
    """The step timeline of a plan (book §11.5), arguments as :func:`~.time_model.step_time`; ``schedule`` as
    :func:`make_timeline_schedule`; ``optimizer_s``: the optimizer step (None: the time model's); ``record``:
    keep the bars.

    Raises:
        ValueError: what :func:`~.time_model.step_time` and :func:`make_timeline_schedule` raise.
    """
    costs, bd = step_costs(m, layout, cluster, global_batch, software, achievable_fraction, dp_overlap, dtype,
                           grad_bytes, optimizer_s)
    return timeline_from_costs(costs, schedule, bd, layout, record)


def rerank_by_timeline(plans: Sequence, k: int, m: ModelConfig, cluster: Cluster, global_batch: int,
                       software: SoftwareProfile | str | None = None,
                       achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
                       dtype: str = "bf16", grad_bytes: int | None = None) -> list:
    """The search's final ranking: its first ``k`` places all replayed plans (:func:`step_timeline`).

    ``plans``, sorted by the sum of terms: the ``k`` fastest are replayed; then, place by place, the best
    replayed plan takes the place unless one not yet replayed could still beat it (its sum times the smallest
    replay-to-sum ratio seen is not above it), which is replayed first, at most :data:`RERANK_MAX_FACTOR` ``· k``
    replays. The other plans follow by step time."""
    if k <= 0:
        return list(plans)

    def key(p):
        return p.step_s, p.memory.total_bytes

    ratio = 1.0  # the smallest replay-to-sum ratio seen so far

    def replayed(p):
        nonlocal ratio
        p = dataclasses.replace(p, timeline_step_s=step_timeline(
            m, p.layout, cluster, global_batch, software, None, achievable_fraction, dp_overlap, dtype, grad_bytes,
            record=False).step_s)
        if p.time.total_s > 0:
            ratio = min(ratio, p.timeline_step_s / p.time.total_s)
        return p

    cap = RERANK_MAX_FACTOR * k
    done = [replayed(p) for p in plans[:k]]
    nxt, out = len(done), []
    while len(out) < k and done:
        best = min(done, key=key)
        if nxt < len(plans) and nxt < cap and plans[nxt].step_s * ratio <= best.step_s:
            done.append(replayed(plans[nxt]))
            nxt += 1
            continue
        done.remove(best)
        out.append(best)
    return out + sorted(done + list(plans[nxt:]), key=key)
