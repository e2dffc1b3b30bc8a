"""The step timeline of a plan: what every pipeline stage does, second by second, during one training step.

:func:`step_timeline` replays the schedule's own order -- GPipe, 1F1B or interleaved 1F1B
(:mod:`commlab.parallel.pipeline.schedules`) -- for one GPU of every pipeline stage, with the durations of
the time model (:func:`~commlab.parallel.planner.time_model.step_time`, split per op by :func:`step_costs`),
and returns a :class:`StepTimeline`: intervals ``(stage, kind, start_s, end_s, microbatch, chunk, lane)`` in
seconds from the start of the step, and the step time. :func:`replay` runs hand-made
:class:`StepCosts`; :func:`rerank_by_timeline` is the search's final ranking.

Each stage holds its own layers (:func:`chunk_layers`), the last one the output layer and the loss; ops wait
for their input message; TP, PP, DP and ZeRO-3 collectives hide as far as the profile's overlap shares
allow, and compute beside them is slowed by ``overlap_compute_slowdown`` (``slowdown`` bars).

Book: chapter 11, §11.4 (the timeline of Llama 3 405B, and how the replay differs from the sum of terms).
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import Sequence

from commlab.parallel.pipeline.schedules import (BACKWARD, FORWARD, Op, gpipe_schedule, interleaved_schedule,
                                                 one_f_one_b_schedule)
from commlab import checks
from commlab.parallel.planner.communication import (backward_tp_hidden_seconds, beside_seconds, dp_last_bucket_share,
                                                    fsdp_head_share, slowdown_seconds)
from commlab.parallel.planner.counting import (LOSS_BACKWARD_BYTES_PER_LOGIT, LOSS_FORWARD_BYTES_PER_LOGIT,
                                               attention_flops_per_token, column_wgrad_flops_per_token,
                                               executed_flops_per_token)
from commlab.parallel.planner.memory import Layout, ModelConfig, layer_params, stage_layers
from commlab.parallel.planner.software import SoftwareProfile, load_software
from commlab.parallel.planner.time_model import AUTO, TimeBreakdown, step_time
from commlab.topology import Cluster

__all__ = ["KINDS", "COMPUTE_LANE", "COMM_LANE", "TIMELINE_SCHEDULES", "Interval", "StageCosts", "StepCosts",
           "StepTimeline", "ReplayState", "chunk_layers", "step_costs", "make_timeline_schedule", "replay",
           "finish_stage", "timeline_from_costs", "step_timeline", "rerank_by_timeline", "RERANK_MAX_FACTOR"]

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
    """One bar of the timeline: ``kind`` (one of :data:`KINDS`) on ``stage`` from ``start_s`` to ``end_s``
    (seconds from the step's start), for ``microbatch`` and ``chunk`` (None where not one micro-batch's), on
    ``lane`` (:data:`COMPUTE_LANE` or :data:`COMM_LANE`)."""

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


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per-micro-batch seconds of one GPU of a pipeline stage, one entry per model chunk (v of them).

    Attributes:
        forward_s, backward_s, recompute_s: computation of one micro-batch on the chunk.
        tp_forward_s, tp_backward_s, tp_recompute_s: the TP collectives of that computation, in full (the
            overlapped share is taken off by the replay).
        tp_backward_hidden_s: of ``tp_backward_s``, the seconds that hide behind the backward's computation
            (:func:`~.time_model.backward_tp_hidden_seconds` for each of the chunk's layers; 0 where nothing
            hides there); None: the ``overlap_tp`` share of ``tp_backward_s``, as for the forward.

    Raises:
        ValueError: a negative or non-finite time; the tuples of unequal length or empty.
    """

    forward_s: tuple
    backward_s: tuple
    recompute_s: tuple = ()
    tp_forward_s: tuple = ()
    tp_backward_s: tuple = ()
    tp_recompute_s: tuple = ()
    tp_backward_hidden_s: tuple | None = None

    def __post_init__(self):
        v = len(self.forward_s)
        if v < 1:
            raise ValueError("a stage needs the costs of at least one chunk")
        for f in dataclasses.fields(self):
            if f.name == "tp_backward_hidden_s" and self.tp_backward_hidden_s is None:
                continue
            vals = getattr(self, f.name) or (0.0,) * v
            if len(vals) != v:
                raise ValueError(f"{f.name} has {len(vals)} chunks, forward_s has {v}")
            object.__setattr__(self, f.name, tuple(checks.seconds(f.name, x) for x in vals))

    @property
    def chunks(self) -> int:
        return len(self.forward_s)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Everything the replay needs (seconds, shares), independent of how it was priced.

    Attributes:
        stages, micro_batches: one :class:`StageCosts` per pipeline stage (all with ``interleave`` chunks); m.
        pp_message_s: one pipeline message (activation forward or gradient backward), s.
        overlap_tp, overlap_pp: shares of TP and PP communication that may run beside compute.
        compute_slowdown: factor (>= 1) by which compute slows while communication runs beside it, drawn as
            ``slowdown`` bars on the compute lane.
        dp_reduce: ``((kind, seconds), ...)`` of the gradient reduction in order (``dp_reduce_scatter``, then
            ``dp_all_gather`` for an AllReduce); dp_gather_s: the distributed optimizer's AllGather (0: none).
        overlap_dp_grad_reduce, overlap_dp_param_gather: their overlapped shares; optimizer_s: the step, s.
        dp_reduce_tail, dp_gather_head: shares (0..1) of the last bucket reduced after the last backward
            (:func:`~.time_model.dp_last_bucket_share`) and of the AllGather the first forward waits for.
        fsdp_gather_s, fsdp_reduce_s, fsdp_head_share: ZeRO-3 per-chunk AllGather (before each forward and
            backward) and ReduceScatter (after each backward), s, and the share no prefetch hides
            (:func:`~.time_model.fsdp_head_share`); 0 without ZeRO-3.

    Raises:
        ValueError: no stage, stages with different chunk counts, m < 1, a negative time, a share outside
            [0, 1], a slowdown below 1, an unknown DP kind.
    """

    stages: tuple
    micro_batches: int
    pp_message_s: float = 0.0
    overlap_tp: float = 0.0
    overlap_pp: float = 0.0
    compute_slowdown: float = 1.0
    dp_reduce: tuple = ()
    dp_gather_s: float = 0.0
    overlap_dp_grad_reduce: float = 0.0
    overlap_dp_param_gather: float = 0.0
    optimizer_s: float = 0.0
    dp_reduce_tail: float = 0.0
    dp_gather_head: float = 0.0
    fsdp_gather_s: float = 0.0
    fsdp_reduce_s: float = 0.0
    fsdp_head_share: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("a timeline needs at least one pipeline stage")
        if len({s.chunks for s in self.stages}) != 1:
            raise ValueError(f"every stage must hold the same number of chunks, got "
                             f"{[s.chunks for s in self.stages]}")
        m = self.micro_batches
        checks.integer("micro_batches", m)
        for name in ("pp_message_s", "dp_gather_s", "optimizer_s", "fsdp_gather_s", "fsdp_reduce_s"):
            checks.seconds(name, getattr(self, name))
        for name in ("overlap_tp", "overlap_pp", "overlap_dp_grad_reduce", "overlap_dp_param_gather",
                     "dp_reduce_tail", "dp_gather_head", "fsdp_head_share"):
            object.__setattr__(self, name, checks.share(name, getattr(self, name)))
        if not self.compute_slowdown >= 1:
            raise ValueError(f"compute_slowdown must be >= 1, got {self.compute_slowdown!r}")
        pieces = tuple((str(k), float(d)) for k, d in self.dp_reduce)
        for k, d in pieces:
            if k not in ("dp_reduce_scatter", "dp_all_gather"):
                raise ValueError(f"dp_reduce kind must be dp_reduce_scatter or dp_all_gather, got {k!r}")
            checks.seconds(f"dp_reduce {k}", d)
        object.__setattr__(self, "dp_reduce", pieces)

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def interleave(self) -> int:
        return self.stages[0].chunks


# ----------------------------------------------------------------------------------------- pricing

def chunk_layers(layers: int, pp: int, interleave: int = 1) -> list[list[int]]:
    """Layers of each chunk of each stage: ``out[s][c]`` for virtual stage ``c·pp + s``.

    Every virtual stage gets ``ceil(L/(pp·v))`` layers, and the surplus is taken off one layer at a time
    from virtual stages 0, ``pp·v - 1``, 1, ``pp·v - 2``, ...: the first and last stages also carry the
    embedding and the output layer, and Llama 3 405B's training took its two surplus layers off exactly
    those (Llama 3 paper, §3.3.2). The heaviest stage then holds :func:`~.memory.stage_layers` layers, as
    the memory and time models assume.

    Raises:
        ValueError: as :func:`~.memory.stage_layers` (a count < 1, or ``pp·v > L``).
    """
    stage_layers(layers, pp, interleave)  # validates
    n = pp * interleave
    per = [math.ceil(layers / n)] * n
    surplus = sum(per) - layers
    order = [i // 2 if i % 2 == 0 else n - 1 - i // 2 for i in range(n)]
    for k in order[:surplus]:
        per[k] -= 1
    return [[per[c * pp + s] for c in range(interleave)] for s in range(pp)]


def step_costs(m: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int,
               software: SoftwareProfile | str | None = None,
               achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
               dtype: str = "bf16", grad_bytes: int | None = None,
               optimizer_s: float | None = None) -> tuple[StepCosts, TimeBreakdown]:
    """The per-stage, per-micro-batch durations of a plan, and the analytical breakdown they are read from.

    Arguments as :func:`~commlab.parallel.planner.time_model.step_time` (same defaults), plus
    ``optimizer_s``, the optimizer step's seconds (None: the time model's ``optimizer_s``).

    Raises:
        ValueError: what :func:`~commlab.parallel.planner.time_model.step_time` raises; a negative
            ``optimizer_s``.
    """
    bd = step_time(m, layout, cluster, global_batch, achievable_fraction, dp_overlap, dtype, grad_bytes, software)
    sw = load_software(software)
    L, pp, v = m.layers, layout.pp, layout.interleave
    micro = bd.micro_batches
    heavy = stage_layers(L, pp, v)
    # Seconds per executed FLOP on one GPU, as the time model prices it (compute_s is the heaviest stage's).
    sec_per_flop = bd.compute_s / (bd.executed_flop_per_step / bd.gpus * heavy * pp / L)
    tokens = layout.micro_batch * m.seq / layout.tp  # per GPU and micro-batch: the tp ranks split each matmul
    lp = layer_params(m)
    att_f, att_b = attention_flops_per_token(m, layout.flash_attention, True)
    none = executed_flops_per_token(m, "none", layout.flash_attention)
    full = executed_flops_per_token(m, layout.recompute, layout.flash_attention, True, layout.recompute_every)
    rec_layer = (full - none) / L  # every-k: the recomputed layers' FLOP spread evenly over the layers
    f_layer, b_layer = 2.0 * lp + att_f, 4.0 * lp + att_b
    out_f, out_b = 2.0 * m.vocab * m.hidden, 4.0 * m.vocab * m.hidden  # output layer, never recomputed
    # The loss over the vocabulary, after the output layer: the time model's seconds, split as its bytes are.
    loss_f = bd.loss_s / micro * LOSS_FORWARD_BYTES_PER_LOGIT / (LOSS_FORWARD_BYTES_PER_LOGIT
                                                                 + LOSS_BACKWARD_BYTES_PER_LOGIT)
    loss_b = bd.loss_s / micro - loss_f

    tp_one = 0.0
    if layout.tp > 1:
        rec_heavy = {"full": heavy, "every-k": heavy // layout.recompute_every}.get(layout.recompute, 0)
        tp_one = (bd.tp_s + bd.tp_hidden_s) / (micro * (4 * heavy + 2 * rec_heavy))
    rec_share = {"full": 1.0, "every-k": 1.0 / layout.recompute_every}.get(layout.recompute, 0.0)
    pp_one = (bd.pp_s + bd.pp_hidden_s) / (2 * micro * v) if pp > 1 else 0.0

    overlap_tp = sw.overlap_tp if layout.sequence_parallel else 0.0
    # Each layer's column-parallel weight gradients in this plan's seconds: its backward TP hides behind them.
    wgrad = tuple(w * tokens * sec_per_flop for w in column_wgrad_flops_per_token(m))
    hidden_layer = (backward_tp_hidden_seconds(tp_one, layout.sequence_parallel, overlap_tp, sw.overlap_tp_backward,
                                               wgrad, sw.overlap_compute_slowdown) if layout.tp > 1 else 0.0)
    stages = []
    for s, counts in enumerate(chunk_layers(L, pp, v)):
        f, b, r, tf, tb, tr, th = [], [], [], [], [], [], []
        for c, n in enumerate(counts):
            last = (c * pp + s) == pp * v - 1
            f.append((n * f_layer + (out_f if last else 0.0)) * tokens * sec_per_flop + (loss_f if last else 0.0))
            b.append((n * b_layer + (out_b if last else 0.0)) * tokens * sec_per_flop + (loss_b if last else 0.0))
            r.append(n * rec_layer * tokens * sec_per_flop)
            tf.append(2 * n * tp_one)
            tb.append(2 * n * tp_one)
            tr.append(2 * n * rec_share * tp_one)
            th.append(n * hidden_layer)
        stages.append(StageCosts(tuple(f), tuple(b), tuple(r), tuple(tf), tuple(tb), tuple(tr), tuple(th)))

    ov_grad = sw.overlap_dp_grad_reduce if dp_overlap is None else dp_overlap
    ov_param = sw.overlap_dp_param_gather if dp_overlap is None else dp_overlap
    fsdp_gather = fsdp_reduce = 0.0
    fsdp_head = 0.0
    if layout.zero_stage >= 3:
        # Per micro-batch the time model gathers the stage's parameters twice and reduce-scatters its
        # gradients once; each chunk holds 1/v of them, and each of its forwards and backwards carries its own.
        reduce, gather = (), 0.0
        fsdp_gather = bd.dp_all_gather_s / (2 * micro * v)
        fsdp_reduce = bd.dp_reduce_scatter_s / (micro * v)
        fsdp_head = fsdp_head_share(m, layout)
    elif layout.zero1:
        reduce = (("dp_reduce_scatter", bd.dp_reduce_scatter_s),)
        gather = bd.dp_all_gather_s
    else:
        reduce = (("dp_reduce_scatter", bd.dp_reduce_scatter_s), ("dp_all_gather", bd.dp_all_gather_s))
        gather = 0.0
    tail = dp_last_bucket_share(m, layout, sw.bucket_params(layout.dp)) if layout.zero_stage < 3 else 0.0
    costs = StepCosts(stages=tuple(stages), micro_batches=micro, pp_message_s=pp_one,
                      overlap_tp=overlap_tp,
                      overlap_pp=sw.pp_overlap(layout.interleave),
                      compute_slowdown=sw.overlap_compute_slowdown, dp_reduce=reduce, dp_gather_s=gather,
                      overlap_dp_grad_reduce=ov_grad, overlap_dp_param_gather=ov_param if layout.zero1 else 0.0,
                      optimizer_s=bd.optimizer_s if optimizer_s is None else optimizer_s,
                      dp_reduce_tail=tail, dp_gather_head=tail if layout.zero1 else 0.0,
                      fsdp_gather_s=fsdp_gather, fsdp_reduce_s=fsdp_reduce, fsdp_head_share=fsdp_head)
    return costs, bd


def make_timeline_schedule(name: str | None, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """The op order the replay follows: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (None: interleaved when
    v > 1, else 1F1B, as Megatron-LM chooses).

    Raises:
        ValueError: an unknown name; v < 1; v > 1 with GPipe or 1F1B; what the schedule itself raises
            (interleaved: p < 2, or m not a multiple of p).
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


# ----------------------------------------------------------------------------------------- replay

@dataclasses.dataclass
class ReplayState:
    """The replay's state, passed explicitly to the functions that advance it.

    Attributes:
        compute_free: per stage, when its compute stream is next free, s.
        next_op: per stage, the index of its next operation in the schedule.
        arrival: per op code (see :func:`_encoded_schedule`), when the message it sent has arrived, s (None
            before it ran).
        last_backward: ``(stage, chunk)`` -> ``(start, work)`` of that chunk's latest backward computation:
            when it starts (s) and the stage's seconds of computation before it (``work``).
        work: per stage, its seconds of computation so far (forward, backward, recomputation alone).
        gathered: per stage, whether its first forward has run (it waits for the overlapped AllGather).
        record: whether to keep bars and op times (False: step time only, for the search's ranking).
        done: ``(stage, kind, microbatch, chunk)`` -> ``(start_s, end_s)`` of each op (when recording).
        sent: the same key -> ``(send_start_s, arrival_s)`` of its message (when recording).
        intervals: the bars so far (when recording).
    """

    compute_free: list
    next_op: list
    arrival: list
    last_backward: dict
    gathered: list
    work: list = dataclasses.field(default_factory=list)
    record: bool = True
    done: dict = dataclasses.field(default_factory=dict)
    sent: dict = dataclasses.field(default_factory=dict)
    intervals: list = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, p: int, n_codes: int, record: bool = True) -> "ReplayState":
        return cls(compute_free=[0.0] * p, next_op=[0] * p, arrival=[None] * n_codes, last_backward={},
                   gathered=[False] * p, work=[0.0] * p, record=record)


@lru_cache(maxsize=256)  # one validation run asks for about 130 different (p, m, v)
def _encoded_schedule(name: str, p: int, m: int, v: int) -> tuple:
    """Per stage, ``(code, dependency code or -1, is_backward, chunk, microbatch, sends)`` of each op, in
    order: the schedule as integers, so that the replay of a long pipeline is a tight loop (cached)."""
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


def _slowdown_s(costs: StepCosts, overlapped_s: float) -> float:
    """What ``overlapped_s`` seconds of compute beside communication cost (:func:`~.time_model.
    slowdown_seconds` at the costs' ``compute_slowdown``)."""
    return slowdown_seconds(overlapped_s, costs.compute_slowdown)


def _beside_s(costs: StepCosts, comm_s: float, work_s: float) -> float:
    """Seconds of ``comm_s`` that run beside ``work_s`` seconds of compute (:func:`~.time_model.
    beside_seconds`: up to ``compute_slowdown·work_s``, the compute's length once slowed); none where
    ``comm_s`` is not positive (communication already over)."""
    return beside_seconds(comm_s, work_s, costs.compute_slowdown) if comm_s > 0 else 0.0


def _pieces(costs: StepCosts, kind: str, work_s: float, tp_s: float, t: float,
            backward_hidden_s: float | None = None) -> tuple[list, float]:
    """Bars ``(kind, start, end, lane)`` of one computation and its TP communication from t (relative
    times), and when the stream is free again: the ``overlap_tp`` share of TP beside it on the comm lane, up
    to the computation's length once slowed (:func:`_beside_s`), the rest after it; the computation takes
    ``hidden·(1 - 1/compute_slowdown)`` longer (a ``slowdown`` bar after it). A backward hides
    ``backward_hidden_s`` instead (the chunk's :attr:`StageCosts.tp_backward_hidden_s`)."""
    hidden = _beside_s(costs, costs.overlap_tp * tp_s if backward_hidden_s is None else backward_hidden_s, work_s)
    work = work_s + _slowdown_s(costs, hidden)
    exposed = tp_s - hidden
    bars = []
    if work_s > 0:
        bars.append((kind, t, t + work_s, COMPUTE_LANE))
    if work > work_s:
        bars.append(("slowdown", t + work_s, t + work, COMPUTE_LANE))
    if hidden > 0:
        bars.append(("tp", t, t + hidden, COMM_LANE))
    if exposed > 0:
        bars.append(("tp", t + work, t + work + exposed, COMPUTE_LANE))
    return bars, t + work + exposed


@dataclasses.dataclass(frozen=True)
class _OpTemplate:
    """One chunk's forward or backward relative to its start: compute bars, when its computation ends
    (``compute_end``), when its backward computation starts (``backward_at``), and its send; under ZeRO-3
    the exposed AllGather it opens with (``pre_wait``, which may run while its input is still in flight) and
    the exposed ReduceScatter it closes with (``tail_bars``, after the send leaves, ``tail_s`` long); its
    seconds of computation alone (``work_s``: forward, backward and recomputation, no communication, no
    slowdown), of which ``recompute_s`` come before ``backward_at``."""

    bars: tuple
    compute_end: float
    backward_at: float
    send_bars: tuple  # relative to compute_end
    send_stall: float
    message_s: float
    pre_wait: float = 0.0
    tail_bars: tuple = ()  # relative to the end of the send's stall
    tail_s: float = 0.0
    work_s: float = 0.0
    recompute_s: float = 0.0


def _with_fsdp(costs: StepCosts, bars: list, end: float, window: float,
               backward: bool) -> tuple[list, float, float, tuple, float]:
    """One op's bars with its ZeRO-3 / FSDP communication, as :func:`~.time_model.fsdp_exposed_seconds`
    prices it: the chunk's AllGather (and after a backward its ReduceScatter) hides behind the op's
    compute (``window``, s) up to the profile's shares (the compute slowed by what hides, a ``slowdown`` bar),
    less, in a forward's gather and a backward's
    ReduceScatter, the head share that no prefetch hides (every chunk's op pays its part of it, so a
    micro-batch pays it whole, as in the time model); the AllGather's exposed rest runs before the compute
    (the op waits for its parameters), the ReduceScatter's after it. Returns the bars, the new end of the
    computation, the exposed AllGather (the shift of the compute), and the exposed ReduceScatter's bars
    (relative to when the op's send has left) and seconds."""
    g, r = costs.fsdp_gather_s, costs.fsdp_reduce_s if backward else 0.0
    if g == 0 and r == 0:
        return bars, end, 0.0, (), 0.0
    head = 0.0 if backward else costs.fsdp_head_share  # the backward's first gather hides (fsdp_head_share)
    hide_g = _beside_s(costs, costs.overlap_dp_param_gather * (1 - head) * g, window)
    hide_r = _beside_s(costs, costs.overlap_dp_grad_reduce * (1 - costs.fsdp_head_share) * r + hide_g, window) - hide_g
    wait, after = g - hide_g, r - hide_r
    out = [("dp_all_gather", 0.0, wait, COMPUTE_LANE)] if wait > 0 else []
    out += [(kind, a + wait, b + wait, lane) for kind, a, b, lane in bars]
    if hide_g > 0:
        out.append(("dp_all_gather", wait, wait + hide_g, COMM_LANE))
    if hide_r > 0:
        out.append(("dp_reduce_scatter", wait + hide_g, wait + hide_g + hide_r, COMM_LANE))
    slow = _slowdown_s(costs, hide_g + hide_r)
    if slow > 0:
        out.append(("slowdown", end + wait, end + wait + slow, COMPUTE_LANE))
    tail = (("dp_reduce_scatter", 0.0, after, COMPUTE_LANE),) if after > 0 else ()
    return out, end + wait + slow, wait, tail, after


def _templates(costs: StepCosts) -> dict:
    exposed = (1 - costs.overlap_pp) * costs.pp_message_s
    # The hidden rest of a send runs beside the sender's next computation, which it slows: the sender's
    # stream pays that at once (after the exposed part), so the message itself is not delayed.
    slow = _slowdown_s(costs, costs.pp_message_s - exposed)
    send = []
    if exposed > 0:
        send.append(("pp_send", 0.0, exposed, COMPUTE_LANE))
    if slow > 0:
        send.append(("slowdown", exposed, exposed + slow, COMPUTE_LANE))
    if costs.pp_message_s > exposed:
        send.append(("pp_send", exposed, costs.pp_message_s, COMM_LANE))
    out = {}
    for s, sc in enumerate(costs.stages):
        for c in range(sc.chunks):
            bars, t = _pieces(costs, "forward", sc.forward_s[c], sc.tp_forward_s[c], 0.0)
            bars, t, wait, tail, after = _with_fsdp(costs, bars, t, sc.forward_s[c], False)
            out[(s, c, False)] = _OpTemplate(tuple(bars), t, 0.0, tuple(send), exposed + slow, costs.pp_message_s,
                                             wait, tail, after, sc.forward_s[c])
            bars, t = _pieces(costs, "recompute", sc.recompute_s[c], sc.tp_recompute_s[c], 0.0)
            at = t
            more, t = _pieces(costs, "backward", sc.backward_s[c], sc.tp_backward_s[c], t,
                              None if sc.tp_backward_hidden_s is None else sc.tp_backward_hidden_s[c])
            bars, t, wait, tail, after = _with_fsdp(costs, bars + more, t, sc.recompute_s[c] + sc.backward_s[c],
                                                    True)
            out[(s, c, True)] = _OpTemplate(tuple(bars), t, at + wait, tuple(send), exposed + slow, costs.pp_message_s,
                                            wait, tail, after, sc.recompute_s[c] + sc.backward_s[c],
                                            sc.recompute_s[c])
    return out


def _record_op(state: ReplayState, s: int, entry: tuple, tpl: _OpTemplate, start: float, mid: float,
               stall_from: float, msg: tuple | None, end: float, ready: float | None = None) -> None:
    """Bars of one op: its wait (``pp_recv`` while its input was in flight, ``bubble`` otherwise, up to
    ``ready``, when it could have started), a stall for the first gathered parameter bucket (``ready`` to
    ``start``), its computation, its slowdown by the parameter AllGather beside it (to ``stall_from``), a
    stall for the rest of that AllGather, its send."""
    code, _, backward, c, j, sends = entry
    ivs = state.intervals
    free = state.compute_free[s]
    ready = start if ready is None else ready
    if ready > free:
        # (an op that opens with an exposed ZeRO-3 gather starts before its input arrives: no wait past it)
        in_flight = min(max(free, msg[0]), ready) if msg is not None else ready
        if in_flight > free:
            ivs.append(Interval(s, "bubble", free, in_flight))
        if ready > in_flight:
            ivs.append(Interval(s, "pp_recv", in_flight, ready))
    if start > max(ready, free):
        ivs.append(Interval(s, "dp_all_gather", max(ready, free), start, j, c))
    for kind, a, b, lane in tpl.bars:
        ivs.append(Interval(s, kind, start + a, start + b, j, c, lane))
    if stall_from > start + tpl.compute_end:
        ivs.append(Interval(s, "slowdown", start + tpl.compute_end, stall_from, j, c))
    if mid > stall_from:
        ivs.append(Interval(s, "dp_all_gather", stall_from, mid, j, c))
    if sends:
        for kind, a, b, lane in tpl.send_bars:
            ivs.append(Interval(s, kind, mid + a, mid + b, j, c, lane))
    after_send = end - tpl.tail_s
    for kind, a, b, lane in tpl.tail_bars:
        ivs.append(Interval(s, kind, after_send + a, after_send + b, j, c, lane))
    key = (s, BACKWARD if backward else FORWARD, j, c)
    state.done[key] = (start, end)
    if sends:
        state.sent[key] = (mid, mid + tpl.message_s)


def replay(schedule_name: str, costs: StepCosts, record: bool = True) -> ReplayState:
    """Replay the forward and backward passes of the schedule ``schedule_name`` (see
    :func:`make_timeline_schedule`) with ``costs``: every op starts as soon as its stage is free and its
    input has arrived (book §11.4). ``record=False`` keeps only the times (faster).

    Raises:
        ValueError: as :func:`make_timeline_schedule`; the schedule deadlocks (names the stuck stages).
    """
    p, v, m = costs.pp, costs.interleave, costs.micro_batches
    order = _encoded_schedule(schedule_name, p, m, v)
    templates = _templates(costs)
    tpl = [[templates[(s, c, b)] for c in range(v) for b in (False, True)] for s in range(p)]
    state = ReplayState.start(p, 2 * m * p * v, record)
    gathered = costs.overlap_dp_param_gather * costs.dp_gather_s
    head = gathered * costs.dp_gather_head
    free, arrival, nxt, last_b, work = state.compute_free, state.arrival, state.next_op, state.last_backward, state.work
    sent_at = [0.0] * len(arrival) if record else None
    total = sum(len(ops) for ops in order)
    ran = 0
    while ran < total:
        progressed = False
        for s in range(p):
            ops, tpl_s = order[s], tpl[s]
            i = nxt[s]
            while i < len(ops):
                entry = ops[i]
                code, dep, backward, c, j, sends = entry
                if dep >= 0 and arrival[dep] is None:
                    break
                t = tpl_s[2 * c + backward]
                # Its exposed ZeRO-3 gather (pre_wait) needs no input: it may run while the input is in flight.
                start = free[s] if dep < 0 or arrival[dep] <= free[s] + t.pre_wait else arrival[dep] - t.pre_wait
                ready = start  # when it could start; later only while it waits for the first gathered bucket
                mid = start + t.compute_end
                stall_from = mid
                if not backward and not state.gathered[s]:
                    # The first forward starts once the first bucket is gathered, and cannot run past its
                    # first layers before the rest of the overlapped AllGather is done.
                    state.gathered[s] = True
                    if head > start:
                        ready, start = start, head
                        mid = stall_from = start + t.compute_end
                    # the rest of the AllGather runs beside this forward's computation, which it slows
                    mid = stall_from = mid + _slowdown_s(costs, _beside_s(costs, gathered - start, t.work_s))
                    mid = max(mid, gathered)
                if backward:
                    last_b[(s, c)] = (start + t.backward_at, work[s] + t.recompute_s)
                work[s] += t.work_s
                end = (mid + t.send_stall if sends else mid) + t.tail_s
                if record:
                    msg = (sent_at[dep], arrival[dep]) if dep >= 0 else None
                    _record_op(state, s, entry, t, start, mid, stall_from, msg, end, ready)
                    sent_at[code] = mid
                arrival[code] = mid + t.message_s if sends else end
                free[s] = end
                i += 1
                ran += 1
                progressed = True
            nxt[s] = i
        if not progressed:
            stuck = [f"stage {s} at op {nxt[s]}" for s in range(p) if nxt[s] < len(order[s])]
            raise ValueError(f"the schedule deadlocks: every stage waits ({', '.join(stuck)})")
    return state


def _lay(state: ReplayState, stage: int, pieces, t: float, lane: str = COMPUTE_LANE, chunk=None,
         out: list | None = None) -> float:
    for kind, d in pieces:
        if d > 0:
            if state.record:
                state.intervals.append(Interval(stage, kind, t, t + d, None, chunk, lane))
            if out is not None:
                out.append((kind, t, t + d, chunk))
            t += d
    return t


def finish_stage(state: ReplayState, costs: StepCosts, stage: int) -> float:
    """After the stage's last backward: DP communication (overlapped share launched at each chunk's last
    backward), the optimizer step, the non-overlapped parameter AllGather; returns when the stage is done.
    The overlapped parameter AllGather of the step (from its start) is drawn here as well."""
    v = costs.interleave
    t_end = state.compute_free[stage]
    gathered = costs.overlap_dp_param_gather * costs.dp_gather_s
    _lay(state, stage, [("dp_all_gather", gathered)], 0.0, COMM_LANE)
    # Overlapped gradient reduction: one share per chunk, launched in the order the chunks finish; the last
    # bucket (dp_reduce_tail) only once the backward has ended, since its first layers finish last.
    ov, tail = costs.overlap_dp_grad_reduce, costs.dp_reduce_tail
    share = [(k, ov * (1 - tail) * d / v) for k, d in costs.dp_reduce]
    done = state.work[stage]
    launches = sorted((*state.last_backward.get((stage, c), (t_end, done)), c) for c in range(v))
    comm, hidden = 0.0, []
    for at, _, c in launches:
        comm = _lay(state, stage, share, max(at, comm), COMM_LANE, c, hidden)
    # It runs beside the computation left after the first launch, up to that computation's length once
    # slowed (_beside_s), and slows it: the stream pays that after its last backward (a stage's own end; the
    # messages it sent meanwhile are not delayed), and the last bucket waits for it.
    after_launch = done - launches[0][1] if launches else 0.0
    beside = _beside_s(costs, sum(b - a for _, a, b, _ in hidden), after_launch)
    t = _lay(state, stage, [("slowdown", _slowdown_s(costs, beside))], t_end)
    comm = _lay(state, stage, [(k, ov * tail * d) for k, d in costs.dp_reduce], max(t, comm), COMM_LANE,
                None, hidden)
    # The stream waits for the overlapped reduction still running (exposed).
    for kind, a, b, c in hidden:
        if b > t:
            _lay(state, stage, [(kind, b - max(a, t))], max(a, t), COMPUTE_LANE, c)
            t = b
    t = _lay(state, stage, [(k, (1 - costs.overlap_dp_grad_reduce) * d) for k, d in costs.dp_reduce], t)
    t = _lay(state, stage, [("optimizer", costs.optimizer_s)], t)
    t = _lay(state, stage, [("dp_all_gather", costs.dp_gather_s - gathered)], t)
    return t


@dataclasses.dataclass(frozen=True)
class StepTimeline:
    """One training step, per pipeline stage (one GPU of each).

    Attributes:
        intervals: every bar (:class:`Interval`), sorted by (stage, lane, start).
        step_s: the step time: when the last stage has finished its optimizer step, s.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        costs: the durations replayed.
        ops: ``(stage, kind, microbatch, chunk)`` -> ``(start_s, end_s)`` of each forward / backward
            (recomputation, exposed TP and the sender's stall included).
        arrivals: the same key -> ``(send_start_s, arrival_s)`` of the message the op sent.
        analytical: the time model's breakdown of the same plan (None for hand-made costs).
        layout: the plan's layout (None for hand-made costs).
    """

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
        """Seconds per kind on ``lane`` of one stage (None: summed over stages), kinds in :data:`KINDS`
        order; on the compute lane of a stage they add up to ``step_s``."""
        out = {k: 0.0 for k in KINDS}
        for iv in self.intervals:
            if iv.lane == lane and (stage is None or iv.stage == stage):
                out[iv.kind] += iv.duration_s
        return out


def timeline_from_costs(costs: StepCosts, schedule: str | None = None, analytical: TimeBreakdown | None = None,
                        layout: Layout | None = None, record: bool = True) -> StepTimeline:
    """Replay ``costs`` under ``schedule`` (see :func:`make_timeline_schedule`) and finish every stage.
    ``record=False``: the step time only (no bars, ops or arrivals).

    Raises:
        ValueError: as :func:`make_timeline_schedule` and :func:`replay`.
    """
    name = schedule or ("interleaved" if costs.interleave > 1 else "1f1b")
    state = replay(name, costs, record)
    ends = [finish_stage(state, costs, s) for s in range(costs.pp)]
    step = max(ends)
    if record:
        for s, e in enumerate(ends):
            if step > e:
                state.intervals.append(Interval(s, "idle", e, step))
    ivs = tuple(sorted(state.intervals, key=lambda iv: (iv.stage, iv.lane != COMPUTE_LANE, iv.start_s)))
    return StepTimeline(intervals=ivs, step_s=step, schedule=name, costs=costs, ops=dict(state.done),
                        arrivals=dict(state.sent), analytical=analytical, layout=layout)


def step_timeline(m: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int,
                  software: SoftwareProfile | str | None = None, schedule: str | None = None,
                  achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
                  dtype: str = "bf16", grad_bytes: int | None = None, optimizer_s: float | None = None,
                  record: bool = True) -> StepTimeline:
    """The step timeline of a plan (book §11.4).

    Args:
        m, layout, cluster, global_batch, achievable_fraction, dp_overlap, dtype, grad_bytes, software: as
            :func:`~commlab.parallel.planner.time_model.step_time`.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``; None: interleaved when
            ``layout.interleave > 1``, else 1F1B.
        optimizer_s: seconds of the optimizer step (None: the time model's, 0 unless it runs the kernel model).
        record: keep the bars (False: only ``step_s``, as the search's re-ranking needs).

    Returns:
        a :class:`StepTimeline`; its ``step_s`` is the step time in seconds.

    Raises:
        ValueError: what :func:`~commlab.parallel.planner.time_model.step_time` raises; an unknown schedule;
            GPipe or 1F1B with ``interleave > 1``; interleaving with m not a multiple of pp.
    """
    costs, bd = step_costs(m, layout, cluster, global_batch, software, achievable_fraction, dp_overlap, dtype,
                           grad_bytes, optimizer_s)
    return timeline_from_costs(costs, schedule, bd, layout, record)


def rerank_by_timeline(plans: Sequence, k: int, m: ModelConfig, cluster: Cluster, global_batch: int,
                       software: SoftwareProfile | str | None = None,
                       achievable_fraction: float | str = AUTO, dp_overlap: float | None = None,
                       dtype: str = "bf16", grad_bytes: int | None = None) -> list:
    """The search's final ranking, its first ``k`` places all replayed plans.

    ``plans`` (:class:`~commlab.parallel.planner.search.Plan` s, sorted by the analytical step time) are
    replayed with :func:`step_timeline`, each given its ``timeline_step_s``: first the ``k`` fastest by the
    sum; then, place by place, the best replayed plan takes the next place unless a plan not yet replayed
    could still beat it, which is replayed first. A plan could beat it when its sum times the smallest
    replay-to-sum ratio seen so far (at most 1) is not above the best replay: a replay is usually a little
    slower than the sum (the schedule's dependencies) but can be faster (the sum prices every stage as the
    heaviest), and the ratio is the margin the replays have shown. At most :data:`RERANK_MAX_FACTOR` ``· k``
    plans are replayed; the first ``k`` places are replayed plans even when that cap binds. After them, every
    other plan follows by its step time (the replay's where there is one; ties by memory).
    """
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
