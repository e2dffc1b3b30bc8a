"""Pipeline schedules as plain data: which stage runs which forward or backward, in what order.

A model cut into ``p`` stages processes a batch of ``m`` micro-batches; a schedule lists, per stage, its
:class:`Op` s (``F j``, ``B j``, and ``W j`` for zero-bubble). :func:`gpipe_schedule` (Huang et al. 2019,
NeurIPS, §2.2), :func:`one_f_one_b_schedule` (PipeDream-Flush, Narayanan et al. 2021, ICML §3 and SC'21
§2.2.1), :func:`interleaved_schedule` (v chunks per stage, SC'21 §2.2.2, Megatron-LM's order) and
:func:`zb_h1_schedule` (Qi et al. 2024, ICLR, §2.1); :func:`make_schedule` by name. Their bubbles:
:func:`bubble_fraction` ``(p-1)/(m+p-1)`` of the step, :func:`bubble_time_ratio` ``(p-1)/m`` of the ideal
time (``(p-1)/(v·m)`` interleaved, a third of that for ZB-H1, :func:`compare_bubbles`);
:func:`ideal_timeline` replays a schedule with equal stages and free communication, and the tests check
its idle time against the formulas. Pure Python, so the book's figures and
:mod:`commlab.parallel.pipeline.engine` use the very same lists.

Book: chapter 10, §10.10 (schedules and the bubble; interleaving and zero-bubble schedules).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from commlab import checks

__all__ = ["Op", "TimedOp", "FORWARD", "BACKWARD", "WEIGHT", "SCHEDULES", "gpipe_schedule", "one_f_one_b_schedule",
           "interleaved_schedule", "interleaved_warmup", "zb_h1_schedule", "make_schedule", "check_schedule",
           "in_flight", "max_in_flight", "ideal_timeline", "bubble_fraction", "bubble_time_ratio",
           "interleaved_bubble_time_ratio", "zb_h1_bubble_time_ratio", "compare_bubbles", "idle_fraction",
           "stage_busy_idle", "virtual_dependencies"]

FORWARD = "F"
BACKWARD = "B"  # in a schedule with WEIGHT ops: the input gradient only (the zero-bubble B)
WEIGHT = "W"  # the weight gradient of a micro-batch, split off its backward (Qi et al. 2024, §2)


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of a schedule: ``kind`` (``"F"``, ``"B"``, or ``"W"`` in a zero-bubble schedule) of
    ``microbatch`` on ``stage`` (0-based), on model chunk ``chunk`` of that stage (0 unless the schedule is
    interleaved, see :func:`interleaved_schedule`)."""

    stage: int
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        tail = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}@{self.stage}{tail}"


@dataclasses.dataclass(frozen=True)
class TimedOp:
    """An operation with its start and end, in seconds (ideal: in units of one forward's time).

    Measured timelines from the engine use seconds since the stage's start of the step; ideal ones from
    :func:`ideal_timeline` use the forward time as the unit. ``end_s >= start_s`` always.
    """

    stage: int
    kind: str
    microbatch: int
    start_s: float
    end_s: float
    chunk: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def _check_pm(p: int, m: int) -> None:
    checks.integer("p", p, note="pipeline stages")
    checks.integer("m", m, note="micro-batches")


def gpipe_schedule(p: int, m: int) -> list[list[Op]]:
    """GPipe: on every stage, forwards of micro-batches 0..m-1, then backwards 0..m-1.

    Backwards run in the order the micro-batches arrived (0 first); any order gives the same bubble, and
    this one lets the last stage start backward on micro-batch 0 as soon as its forwards are done.

    Returns:
        ``schedule[s]`` = the ordered list of :class:`Op` of stage s (``2m`` each).

    Raises:
        ValueError: p < 1 or m < 1.
    """
    _check_pm(p, m)
    return [[Op(s, FORWARD, j) for j in range(m)] + [Op(s, BACKWARD, j) for j in range(m)] for s in range(p)]


def one_f_one_b_schedule(p: int, m: int) -> list[list[Op]]:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward / one backward, then the remaining backwards.

    Stage s first runs ``w = min(p - s - 1, m)`` forwards: exactly as many as are needed before the first
    gradient can come back from the last stage. Then it alternates ``F (w+k)``, ``B k`` for
    ``k = 0..m-w-1``, and finishes with the last w backwards. The last stage (w = 0) alternates from the
    start. At most ``w + 1 = p - s`` micro-batches are in flight on stage s.

    Returns:
        ``schedule[s]`` = the ordered list of :class:`Op` of stage s (``2m`` each).

    Raises:
        ValueError: p < 1 or m < 1.
    """
    _check_pm(p, m)
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        ops = [Op(s, FORWARD, j) for j in range(warmup)]
        for k in range(m - warmup):
            ops += [Op(s, FORWARD, warmup + k), Op(s, BACKWARD, k)]
        ops += [Op(s, BACKWARD, j) for j in range(m - warmup, m)]
        schedule.append(ops)
    return schedule


def interleaved_schedule(p: int, m: int, v: int) -> list[list[Op]]:
    """Interleaved 1F1B (Narayanan et al. 2021, SC'21, §2.2.2, Fig. 4 bottom): each stage holds v model
    chunks, chunk c of stage s being virtual stage ``c·p + s`` of ``p·v``; a stage runs ``2·m·v`` operations.

    The order of Megatron-LM's ``forward_backward_pipelining_with_interleaving``: stage s walks
    ``k = 0 .. m·v - 1`` virtual micro-batches in groups of p; the k-th forward is on chunk
    ``(k mod p·v) // p`` and micro-batch ``(k // (p·v))·p + k mod p``, the k-th backward on chunk ``v - 1 -``
    that. :func:`interleaved_warmup` forwards first, then forward ``w + k`` / backward ``k``, then the drain.
    Dependencies run across chunks (:func:`virtual_dependencies`). It takes v, so it is not in
    :data:`SCHEDULES`.

    Returns:
        ``schedule[s]``: stage s's :class:`Op` s in order (``2·m·v`` each, ``chunk`` set).

    Raises:
        ValueError: p < 2, m < 1, v < 1 (each not an int), or m not a multiple of p; the message names
            the value.
    """
    _check_pm(p, m)
    checks.integer("v", v, note="model chunks per stage")
    if p < 2:
        raise ValueError(f"interleaving needs p >= 2 pipeline stages, got p={p!r}")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the m={m} micro-batches to be a multiple of p={p} "
                         "(Megatron-LM asserts it); choose m from "
                         f"{[p * k for k in range(1, 4)]}, ...")
    total = m * v

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def micro_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    schedule = []
    for s in range(p):
        warmup = interleaved_warmup(p, m, v, s)
        fwd = [Op(s, FORWARD, micro_of(k), chunk_of(k, True)) for k in range(total)]
        bwd = [Op(s, BACKWARD, micro_of(k), chunk_of(k, False)) for k in range(total)]
        ops = fwd[:warmup]
        for k in range(total - warmup):
            ops += [fwd[warmup + k], bwd[k]]
        ops += bwd[total - warmup:]
        schedule.append(ops)
    return schedule


def interleaved_warmup(p: int, m: int, v: int, s: int) -> int:
    """Warm-up forwards of stage s in :func:`interleaved_schedule`: ``min(2·(p - s - 1) + (v - 1)·p, m·v)``,
    all ``m·v`` when ``m == p`` (Megatron-LM's ``num_warmup_microbatches``). The communication plan groups
    the messages of the steady state's forward-backward pairs after this many forwards."""
    total = m * v
    return total if m == p else min(2 * (p - s - 1) + (v - 1) * p, total)


def zb_h1_schedule(p: int, m: int) -> list[list[Op]]:
    """ZB-H1, the memory-efficient zero-bubble schedule (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
    ICLR 2024, §2.1, Fig. 3 top): 1F1B with each backward split into B (input gradient) and W (weight gradient).

    Stage s runs 1F1B's order (:func:`one_f_one_b_schedule`): ``w = min(p - s - 1, m)`` warm-up forwards,
    then ``F (w+k), B k`` for ``k = 0 .. m-w-1`` with the W's delayed: stage s starts its W's only after its
    first ``s`` steady B's (then one ``W (k - s)`` after each ``B k``), so every stage reaches the same
    ``min(p, m)`` micro-batches in flight -- 1F1B's peak, stage 0's -- and its B's start as early as the
    pipeline allows. The drain runs
    each remaining B followed by the oldest pending W, then the W's left. B depends on the next stage's B
    only (not on its W), so the W's delayed into the drain fill the idle time 1F1B leaves there.

    With ``T_F = T_B = T_W`` (the paper's simplest case) the bubble is ``(p - 1) / (3m)`` of the ideal time,
    a third of 1F1B's ``(p - 1) / m`` (:func:`zb_h1_bubble_time_ratio`, checked on :func:`ideal_timeline`).
    The order is built from the paper's description (1F1B's warm-up; W's started later the fewer warm-up
    forwards a stage has, so that every stage holds as many micro-batches as stage 0); its bubble and peak
    memory are the ones the paper states, but it was not compared op by op with the paper's figure.

    Returns:
        ``schedule[s]``: stage s's ops in order, ``3m`` each (``F``, ``B``, ``W`` of every micro-batch).

    Raises:
        ValueError: p < 1 or m < 1.
    """
    schedule = []
    for s, one_f_one_b in enumerate(one_f_one_b_schedule(p, m)):
        # W's start after B s (delayed by s steady steps: stage s then holds p micro-batches, as stage 0 does),
        # or at the drain's first B where the steady state is shorter than that.
        first = min(s, m - min(p - s - 1, m))
        ops, pending = [], 0  # pending: the oldest micro-batch whose W has not run yet
        for op in one_f_one_b:
            ops.append(op)
            if op.kind == BACKWARD and op.microbatch >= first:
                ops.append(Op(s, WEIGHT, pending))
                pending += 1
        ops += [Op(s, WEIGHT, j) for j in range(pending, m)]
        schedule.append(ops)
    return schedule


def virtual_dependencies(op: Op, p: int, v: int) -> list[tuple[int, str, int, int]]:
    """``(stage, kind, microbatch, chunk)`` of the ops on other virtual stages that ``op`` waits for.

    Virtual stage ``c·p + s`` (chunk c of stage s): a forward needs the forward of the virtual stage before
    it, a backward the backward of the one after it; the last virtual stage's backward needs only its own
    forward, which comes earlier in its stage's order. With v = 1 these are the dependencies of GPipe and
    1F1B. A ``W`` waits for its own stage's ``B``, which comes earlier in the
    stage's order, so it has none here either.
    """
    vs = op.chunk * p + op.stage
    if op.kind == WEIGHT:
        return []
    if op.kind == FORWARD:
        if vs == 0:
            return []
        prev = vs - 1
        return [(prev % p, FORWARD, op.microbatch, prev // p)]
    if vs == p * v - 1:
        return []
    nxt = vs + 1
    return [(nxt % p, BACKWARD, op.microbatch, nxt // p)]


#: Schedule generators by name, as accepted by :func:`make_schedule` and the engine.
SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def make_schedule(name: str, p: int, m: int) -> list[list[Op]]:
    """The schedule called ``name`` (``"gpipe"`` or ``"1f1b"``) for p stages and m micro-batches.

    Raises:
        ValueError: unknown name, p < 1 or m < 1.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m)


def _chunks(schedule: Sequence[Sequence[Op]]) -> int:
    """v: the number of model chunks per stage a schedule uses (1 + its largest chunk index)."""
    return 1 + max((op.chunk for ops in schedule for op in ops), default=0)


def _dependencies(op: Op, p: int, v: int = 1) -> list[tuple[int, str, int, int]]:
    """Ops on *other* stages that must finish before ``op`` starts (same-stage order is the schedule's), as
    ``(stage, kind, microbatch, chunk)``: :func:`virtual_dependencies` (v = 1: stage s-1's forward, s+1's
    backward)."""
    return virtual_dependencies(op, p, v)


def check_schedule(schedule: Sequence[Sequence[Op]]) -> None:
    """Check that a schedule is complete and runnable.

    Complete: stage s lists exactly one ``F j`` and one ``B j`` for every micro-batch j (on each of its v
    model chunks, if the schedule is interleaved), all with ``stage == s``, and ``F j`` before ``B j``; a
    zero-bubble schedule (one with ``W`` ops) also one ``W j`` after each ``B j``. Runnable: replaying it
    with :func:`ideal_timeline` never waits on an operation that can no longer happen (no deadlock).

    Raises:
        ValueError: naming the stage and the missing, repeated or misordered operation.
    """
    p = len(schedule)
    if p < 1:
        raise ValueError("a schedule needs at least one stage")
    v = _chunks(schedule)
    split = any(op.kind == WEIGHT for ops in schedule for op in ops)
    kinds = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
    m = sum(op.kind == FORWARD for op in schedule[0]) // v
    for s, ops in enumerate(schedule):
        seen: dict[tuple[str, int, int], int] = {}
        for i, op in enumerate(ops):
            if op.stage != s:
                raise ValueError(f"stage {s}'s list holds {op}, an operation of stage {op.stage}")
            if op.kind not in kinds:
                raise ValueError(f"stage {s}: operation kind must be one of {list(kinds)}, got {op.kind!r}")
            if (op.kind, op.microbatch, op.chunk) in seen:
                raise ValueError(f"stage {s} runs {op} twice")
            if op.kind == BACKWARD and (FORWARD, op.microbatch, op.chunk) not in seen:
                raise ValueError(f"stage {s} runs {op} before the forward of micro-batch {op.microbatch}")
            if op.kind == WEIGHT and (BACKWARD, op.microbatch, op.chunk) not in seen:
                raise ValueError(f"stage {s} runs {op} before the input-gradient backward B of micro-batch "
                                 f"{op.microbatch}")
            seen[(op.kind, op.microbatch, op.chunk)] = i
        expected = {(k, j, c) for k in kinds for j in range(m) for c in range(v)}
        if set(seen) != expected or len(ops) != len(kinds) * m * v:
            def names(keys):
                return sorted(str(Op(s, k, j, c)) for k, j, c in keys)
            on_chunks = f" on each of its {v} chunks" if v > 1 else ""
            raise ValueError(f"stage {s} must run {'/'.join(kinds)} of micro-batches 0..{m - 1} once each"
                             f"{on_chunks}; missing {names(expected - set(seen))}, "
                             f"extra {names(set(seen) - expected)}")
    ideal_timeline(schedule)  # raises on a deadlock


def in_flight(ops: Sequence[Op]) -> list[int]:
    """Micro-batches whose activations a stage holds after each of its ops (forwards done minus backwards
    done; in a zero-bubble schedule minus W's done, since the weight gradient still reads the activations)."""
    release = WEIGHT if any(op.kind == WEIGHT for op in ops) else BACKWARD
    count, out = 0, []
    for op in ops:
        count += 1 if op.kind == FORWARD else (-1 if op.kind == release else 0)
        out.append(count)
    return out


def max_in_flight(schedule: Sequence[Sequence[Op]]) -> list[int]:
    """Per stage, the most micro-batches whose activations are stored at once (GPipe: m; 1F1B: ``min(p-s, m)``;
    ZB-H1: ``min(p, m)`` on every stage; interleaved: chunk activations, each 1/v of a stage's)."""
    return [max(in_flight(ops), default=0) for ops in schedule]


def ideal_timeline(schedule: Sequence[Sequence[Op]], forward_s: float = 1.0,
                   backward_ratio: float = 2.0, weight_share: float = 0.5) -> list[TimedOp]:
    """Replay a schedule with fixed op times and free communication; every op starts as early as it can.

    An op starts when both the previous op of its stage and its dependencies on other stages
    (:func:`virtual_dependencies`) have finished. The times are those of a whole stage's share of the
    model: in an interleaved schedule with v chunks per stage each op takes 1/v of them (the same model cut
    into v times more pieces), so schedules of the same model compare at equal compute.

    Args:
        schedule: per-stage op lists (as from :func:`make_schedule`, :func:`interleaved_schedule` or
            :func:`zb_h1_schedule`).
        forward_s: time of one stage's forward of one micro-batch (> 0); 1.0 makes the unit "one forward".
        backward_ratio: backward time / forward time (> 0). 2.0 is the usual estimate: a backward computes
            the gradients of both the inputs and the weights, two matrix products for one of the forward.
        weight_share: in a schedule with ``W`` ops, the share of the backward the weight gradient W takes
            (0 < share < 1); B takes the rest. The defaults give ``T_F = T_B = T_W = 1``, the zero-bubble
            paper's simplest case (Qi et al. 2024, §2), with the same total compute as 1F1B's.

    Returns:
        All ops as :class:`TimedOp` (``chunk`` kept), sorted by (stage, start).

    Raises:
        ValueError: non-positive times, a weight share outside (0, 1), or a schedule that deadlocks (names
            the stuck ops).
    """
    if not forward_s > 0 or not backward_ratio > 0:
        raise ValueError(f"forward_s and backward_ratio must be > 0, got {forward_s!r}, {backward_ratio!r}")
    if not 0 < weight_share < 1:
        raise ValueError(f"weight_share must be in (0, 1), got {weight_share!r}")
    p = len(schedule)
    v = _chunks(schedule)
    split = any(op.kind == WEIGHT for ops in schedule for op in ops)
    backward_s = forward_s * backward_ratio
    duration = {FORWARD: forward_s / v,
                BACKWARD: backward_s * ((1 - weight_share) if split else 1.0) / v,
                WEIGHT: backward_s * weight_share / v}
    end: dict[tuple[int, str, int, int], float] = {}
    nxt = [0] * p
    clock = [0.0] * p
    out: list[TimedOp] = []
    total = sum(len(ops) for ops in schedule)
    while len(out) < total:
        progressed = False
        for s in range(p):
            # Run as many of stage s's ops as are ready; the sweep over stages repeats until all are done.
            while nxt[s] < len(schedule[s]):
                op = schedule[s][nxt[s]]
                deps = _dependencies(op, p, v)
                if any(d not in end for d in deps):
                    break
                start = max([clock[s]] + [end[d] for d in deps])
                finish = start + duration[op.kind]
                end[(s, op.kind, op.microbatch, op.chunk)] = finish
                clock[s] = finish
                out.append(TimedOp(s, op.kind, op.microbatch, start, finish, op.chunk))
                nxt[s] += 1
                progressed = True
        if not progressed:
            stuck = [str(schedule[s][nxt[s]]) for s in range(p) if nxt[s] < len(schedule[s])]
            raise ValueError(f"the schedule deadlocks: every stage waits ({', '.join(stuck)} cannot start)")
    out.sort(key=lambda t: (t.stage, t.start_s))
    return out


def bubble_fraction(p: int, m: int) -> float:
    """Fraction of a pipeline step that a stage is idle: ``(p - 1) / (m + p - 1)``.

    Holds for GPipe and 1F1B alike under the model of :func:`ideal_timeline` (equal stages, free
    communication), for any backward/forward ratio. Huang et al. 2019 (GPipe, §2.2); Narayanan et al. 2021
    (SC'21, §2.2.1). p = 4, m = 8: 3/11 = 27 % of the step is bubble.

    Raises:
        ValueError: p < 1 or m < 1.
    """
    _check_pm(p, m)
    return (p - 1) / (m + p - 1)


def bubble_time_ratio(p: int, m: int) -> float:
    """Bubble time over *ideal* compute time, ``(p - 1) / m``: Narayanan et al. 2021 (SC'21), §2.2.1.

    The same bubble as :func:`bubble_fraction`, measured against ``m (t_f + t_b)`` instead of the whole
    step; ``f / (1 + f)`` of this ratio f is the bubble fraction.

    Raises:
        ValueError: p < 1 or m < 1.
    """
    _check_pm(p, m)
    return (p - 1) / m


def interleaved_bubble_time_ratio(p: int, m: int, v: int) -> float:
    """Bubble time over ideal compute time of interleaved 1F1B, ``(p - 1) / (v·m)``: Narayanan et al. 2021
    (SC'21), §2.2.2 (each of the ``p - 1`` fill and drain steps is one chunk's work, 1/v of a stage's).

    Raises:
        ValueError: p < 1, m < 1 or v < 1.
    """
    _check_pm(p, m)
    checks.integer("v", v, note="model chunks per stage")
    return (p - 1) / (v * m)


def zb_h1_bubble_time_ratio(p: int, m: int) -> float:
    """Bubble time over ideal compute time of ZB-H1 with ``T_F = T_B = T_W``: ``(p - 1) / (3m)``, a third of
    1F1B's ``(p - 1) / m`` (Qi et al. 2024, §2.1: a bubble one third of 1F1B's; the authors' own project
    description tabulates the bubble rate "assuming T_F=T_B=T_W" as ``(p-1)/m`` for 1F1B and ``(p-1)/3m``
    for ZB1P, their name for ZB-H1). Each stage idles ``(p - 1)·T_F`` of the ``3m·T_F`` it computes.

    Raises:
        ValueError: p < 1 or m < 1.
    """
    _check_pm(p, m)
    return (p - 1) / (3 * m)


def compare_bubbles(p: int, m: int, v: int = 2) -> list[dict]:
    """1F1B, interleaved 1F1B (v chunks) and ZB-H1 side by side, as data: each one's ideal timeline
    (:func:`ideal_timeline` with its defaults: ``T_F = 1``, backward 2, split into ``T_B = T_W = 1``) and
    its bubble measured on it beside the paper's formula.

    Returns:
        One dict per schedule, keys ``name``, ``schedule`` (the op lists), ``timeline``, ``step`` (the step
        time, in forward times), ``idle_fraction`` (idle / (p × step)), ``bubble_time_ratio`` (idle /
        busy, measured) and ``formula`` (the source's bubble time ratio), ``max_in_flight`` (per stage, in
        ops' activations: a chunk's in the interleaved schedule) and ``peak_activations`` (the largest, in
        one stage's activations of one micro-batch: interleaved divides by v, giving Megatron-LM's
        ``p·(1 + (p-1)/(p·v))`` on stage 0 for m > p).

    Raises:
        ValueError: what the schedules raise (interleaved: p < 2 or m not a multiple of p).
    """
    rows = []
    for name, schedule, formula, chunks in (
            ("1F1B", one_f_one_b_schedule(p, m), bubble_time_ratio(p, m), 1),
            (f"interleaved 1F1B, v = {v}", interleaved_schedule(p, m, v), interleaved_bubble_time_ratio(p, m, v), v),
            ("ZB-H1", zb_h1_schedule(p, m), zb_h1_bubble_time_ratio(p, m), 1)):
        timeline = ideal_timeline(schedule)
        idle = idle_fraction(timeline)
        held = max_in_flight(schedule)
        rows.append({"name": name, "schedule": schedule, "timeline": timeline,
                     "step": max(t.end_s for t in timeline) - min(t.start_s for t in timeline),
                     "idle_fraction": idle, "bubble_time_ratio": idle / (1 - idle), "formula": formula,
                     "max_in_flight": held, "peak_activations": max(held) / chunks})
    return rows


def stage_busy_idle(timeline: Sequence[TimedOp]) -> dict[int, tuple[float, float]]:
    """Per stage, ``(busy_s, idle_s)``: the sum of its op durations, and the rest of the step.

    The step runs from the earliest start to the latest end over all stages, so a stage that starts late
    or finishes early is idle for that time too (that is the bubble).
    """
    if not timeline:
        return {}
    t0 = min(t.start_s for t in timeline)
    t1 = max(t.end_s for t in timeline)
    busy: dict[int, float] = {}
    for t in timeline:
        busy[t.stage] = busy.get(t.stage, 0.0) + t.duration_s
    return {s: (b, (t1 - t0) - b) for s, b in sorted(busy.items())}


def idle_fraction(timeline: Sequence[TimedOp]) -> float:
    """Idle time over all stages divided by ``stages × step time`` (0 = no bubble); 0.0 for an empty timeline."""
    per_stage = stage_busy_idle(timeline)
    if not per_stage:
        return 0.0
    busy = sum(b for b, _ in per_stage.values())
    total = sum(b + i for b, i in per_stage.values())
    return 0.0 if total <= 0 else 1.0 - busy / total
