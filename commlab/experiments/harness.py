"""One data-parallel training run with a chosen gradient-averaging method, recorded step by step.

:func:`run` launches ``config.world_size`` gloo ranks (:func:`commlab.launch`); every rank trains the
same model on its own mini-batches through commlab's data-parallel path,
:class:`commlab.overlap.BucketedDataParallel`, whose comm hook is the method
(:func:`commlab.experiments.methods.method_hook`): the gradient, in one bucket (reverse registration order),
is averaged while ``backward()`` runs, and every rank takes the same optimizer step. Per step each rank
records its loss and its seconds of compute (forward + backward, without the time spent averaging),
encode/decode, communication (the rest of the averaging, including the wait and the copy back into
``.grad``) and the whole step; the parent combines the ranks (mean loss; the slowest rank's seconds, since
the ranks wait for each other in every collective) into a :class:`RunRecord`. Every ``eval_every`` steps the
ranks score their shares of the held-out set; that time is not part of any step. Model, data and loss live on
the group's device; times are marks of the wrapper's :class:`commlab.launch.Clock`, read once at the end. A run
whose :attr:`RunConfig.sync` is not ``"every"`` has no per-step hook: :mod:`commlab.sync` syncs every H steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from commlab import checks
from commlab.experiments.methods import (check_aggregation, describe, describe_sync, make_method, method_hook,
                                        parse_spec, parse_sync)
from commlab.experiments.tasks import OPTIMIZERS, TASKS, get_task, make_optimizer
from commlab.launch.device import group_device
from commlab.overlap.bucketed import BucketedDataParallel
from commlab.topology.emulated import EmulatedTopology
from commlab.topology.links import Link

__all__ = ["RunConfig", "RunRecord", "run", "train_rank"]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run (JSON-serialisable; ``None`` fields take the task's defaults).

    Attributes:
        task: ``"digits"`` or ``"charlm"`` (:mod:`commlab.experiments.tasks`).
        method: a method spec (:mod:`commlab.experiments.methods`), e.g. ``"topk:0.01"``.
        error_feedback: wrap the compressor in error feedback (PowerSGD: its own residuals).
        warmup_steps: dense steps before compression starts.
        seed: model initialisation and mini-batch draws (and the compressors' shared randomness).
        world_size: ranks (1 runs, but communicates nothing).
        steps, batch_size, lr, eval_every: the task's defaults when None; ``batch_size`` is per rank.
        optimizer: one of :data:`commlab.experiments.tasks.OPTIMIZERS`; None: the task's (digits SGD, charlm Adam).
        link_bytes_per_s, link_alpha_s: if ``link_bytes_per_s`` is set, every rank sits on its own emulated
            node behind a link of that bandwidth (bytes/s per direction) and latency (s), which delays each
            payload message (:class:`commlab.topology.EmulatedTopology`).
        aggregation: ``"auto"`` (the compressor's own path) or ``"two_phase"`` (:data:`~.methods.AGGREGATIONS`).
        sync: ``"every"`` (the method averages each step's gradient), ``"local:H"`` (method
            ``"dense"``), ``"diloco:H"`` or ``"streaming:H:F:tau:alpha"`` (:class:`commlab.sync.DiLoCo`; the method
            then compresses the pseudo-gradient, with ``error_feedback``; the inner optimizer is ``optimizer``).
        outer_lr, outer_momentum: DiLoCo's outer SGD (Nesterov when the momentum is above 0); None: its defaults.
        Fields at their default (``aggregation``, ``sync``, the outer ones) are left out of :attr:`key`, so that
        runs recorded before they existed keep their keys.

    Raises:
        ValueError: a bad task, method or number (the message says which).
    """

    task: str
    method: str = "dense"
    error_feedback: bool = False
    warmup_steps: int = 0
    seed: int = 0
    world_size: int = 4
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    eval_every: int | None = None
    link_bytes_per_s: float | None = None
    link_alpha_s: float = 0.0
    optimizer: str | None = None
    aggregation: str = "auto"
    sync: str = "every"
    outer_lr: float | None = None
    outer_momentum: float | None = None

    def __post_init__(self):
        _task_class(self.task)
        parse_spec(self.method)
        check_aggregation(self.method, self.aggregation)
        checks.flag("RunConfig.error_feedback", self.error_feedback)
        if self.method == "dense" and (self.error_feedback or self.warmup_steps):
            raise ValueError("RunConfig: dense has no compressor, so error_feedback and warmup_steps must be off")
        for name in ("warmup_steps", "seed"):
            checks.integer(f"RunConfig.{name}", getattr(self, name), least=0)
        for name in ("world_size", "steps", "batch_size", "eval_every"):
            if getattr(self, name) is not None:
                checks.integer(f"RunConfig.{name}", getattr(self, name), note="or None for the task's default")
        if self.lr is not None:
            checks.number("RunConfig.lr", self.lr, above=0)
        if self.optimizer is not None:
            checks.one_of("RunConfig.optimizer", self.optimizer, OPTIMIZERS, note="or None")
        if self.link_bytes_per_s is not None:
            checks.number("RunConfig.link_bytes_per_s", self.link_bytes_per_s, above=0, note="bytes/s")
        checks.seconds("RunConfig.link_alpha_s", self.link_alpha_s)
        if self.link_bytes_per_s is None and self.link_alpha_s:
            raise ValueError("RunConfig.link_alpha_s needs link_bytes_per_s (there is no emulated link without it)")
        steps = self.steps or _task_class(self.task).defaults.steps
        if self.warmup_steps >= steps:
            raise ValueError(f"RunConfig.warmup_steps ({self.warmup_steps}) must be below the number of steps ({steps}); "
                             "otherwise nothing is compressed")
        if self.link_bytes_per_s is not None and self.method.startswith("powersgd"):
            raise ValueError("an emulated link delays commlab's ring collectives only; PowerSGD uses dist.all_reduce")
        self._check_sync(steps)

    def _check_sync(self, steps: int) -> None:
        kind, nums = parse_sync(self.sync)
        where = f"RunConfig(sync={self.sync!r})"
        if self.outer_lr is not None:
            checks.number("RunConfig.outer_lr", self.outer_lr, above=0, note="or None for DiLoCo's default")
        if self.outer_momentum is not None:
            checks.number("RunConfig.outer_momentum", self.outer_momentum, least=0, below=1,
                          note="or None for DiLoCo's default")
        if kind not in ("diloco", "streaming") and (self.outer_lr, self.outer_momentum) != (None, None):
            raise ValueError(f"{where}: outer_lr and outer_momentum are DiLoCo's; leave them None")
        if kind == "every":
            return
        if kind == "local" and (self.method != "dense" or self.error_feedback):
            raise ValueError(f"{where}: local SGD averages the parameters themselves; method must be 'dense' "
                             f"without error feedback, got {self.method!r}, error_feedback={self.error_feedback}")
        if self.method.startswith("powersgd") or self.method == "sign:tensor":
            raise ValueError(f"{where}: the outer sync compresses Δ with one compressor over the whole model; "
                             f"method {self.method!r} is not one (use dense, cast, int, qsgd, sign, topk, randomk)")
        if self.warmup_steps:
            raise ValueError(f"{where}: warmup_steps must be 0, got {self.warmup_steps}")
        if nums[0] >= steps:
            raise ValueError(f"{where}: H = {nums[0]} inner steps must be below the run's {steps} steps, or it "
                             "never syncs")

    def resolved(self) -> "RunConfig":
        """This config with the task's defaults filled in."""
        d = _task_class(self.task).defaults
        return dataclasses.replace(self, steps=self.steps or d.steps, batch_size=self.batch_size or d.batch_size,
                                   lr=self.lr or d.lr, eval_every=self.eval_every or d.eval_every,
                                   optimizer=self.optimizer or d.optimizer)

    @property
    def group(self) -> str:
        """The task, with the optimizer when it is not the task's default (``"charlm/sgd-momentum"``):
        runs are compared with the dense run of the same group and seed."""
        default = _task_class(self.task).defaults.optimizer
        return self.task if self.optimizer in (None, default) else f"{self.task}/{self.optimizer}"

    @property
    def label(self) -> str:
        if self.sync != "every":
            outer = ("" if self.outer_lr is None and self.outer_momentum is None else
                     f" (outer lr {_g(self.outer_lr)}, momentum {_g(self.outer_momentum)})")
            return describe_sync(self.sync, self.method, self.error_feedback) + outer
        return describe(self.method, self.error_feedback, self.warmup_steps, self.aggregation)

    @property
    def key(self) -> str:
        """A unique, readable id of the resolved run (used to resume a grid)."""
        c = self.resolved()
        link = "" if c.link_bytes_per_s is None else f"|link={c.link_bytes_per_s:g}B/s,{c.link_alpha_s:g}s"
        # The task's own optimizer is left out of the key, so that records made before the field existed match.
        if c.optimizer != _task_class(c.task).defaults.optimizer:
            link += f"|opt={c.optimizer}"
        return (f"{c.method_segment}seed={c.seed}|"
                f"n={c.world_size}|steps={c.steps}|bs={c.batch_size}|lr={c.lr:g}|eval={c.eval_every}{link}")

    @property
    def method_segment(self) -> str:
        """The part of :attr:`key` that names the method: ``"charlm|sign|ef=1|warmup=0|"``, with
        ``"agg=two_phase|"`` after it for two-phase aggregation and ``"sync=diloco:10|"`` for a run that syncs less
        often (the defaults ``"auto"`` and ``"every"`` are left out, so that runs recorded before the fields existed
        keep their keys)."""
        agg = "" if self.aggregation == "auto" else f"agg={self.aggregation}|"
        agg += "" if self.sync == "every" else f"sync={self.sync}|"
        if self.outer_lr is not None or self.outer_momentum is not None:
            agg += f"outer={_g(self.outer_lr)},{_g(self.outer_momentum)}|"
        return f"{self.task}|{self.method}|ef={int(self.error_feedback)}|warmup={self.warmup_steps}|{agg}"


def _g(x: float | None) -> str:
    return "default" if x is None else f"{x:g}"


def _task_class(name):
    """The task class (not an instance: building one loads its data) for ``name``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


@dataclasses.dataclass
class RunRecord:
    """A finished run. Per-step lists have one entry per completed step.

    Attributes:
        config: the resolved :class:`RunConfig` as a dict.
        label: e.g. ``"Top-K 1% + EF"``.
        metric, higher_is_better: the task's quality measure (``"accuracy"`` or ``"perplexity"``).
        params: parameters of the model; dense_nbytes: bytes of its gradient (elements times their dtype's size).
        payload_nbytes: bytes of one rank's compressed gradient (of the last step; the dense size for dense).
        bytes_sent_per_rank: bytes each rank sent per compressed step (ring accounting, chapter 4; two-phase:
            :func:`commlab.compress.two_phase.two_phase_bytes_sent_per_rank`).
        path: how the payloads were summed (``"all_reduce"``, ``"all_gather"``, ``"two_phase"`` or ``"powersgd"``).
        loss: training loss per step, mean over ranks (nats).
        compute_s, codec_s, comm_s, step_s: seconds per step, slowest rank.
        eval_steps, eval_quality: quality after each evaluated step count (0 = the initial model).
        final_quality: quality of the final model (NaN if the run diverged).
        diverged_at_step: None, or the step whose gradient held NaN/Inf on some rank (the run stopped there),
            or the first evaluated step whose held-out quality was not finite (the run went on; NaN is stored).
        wall_s: seconds of the whole launch.
    """

    config: dict
    label: str
    metric: str
    higher_is_better: bool
    params: int
    dense_nbytes: int
    payload_nbytes: int
    bytes_sent_per_rank: float
    path: str
    loss: list[float]
    compute_s: list[float]
    codec_s: list[float]
    comm_s: list[float]
    step_s: list[float]
    eval_steps: list[int]
    eval_quality: list[float]
    final_quality: float
    diverged_at_step: int | None
    wall_s: float

    @property
    def ratio(self) -> float:
        """Compression ratio: dense gradient bytes / payload bytes."""
        return self.dense_nbytes / self.payload_nbytes if self.payload_nbytes else math.inf

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # JSON has no NaN or inf: store a diverged run's qualities and losses as null.
        clean = lambda x: x if math.isfinite(x) else None  # noqa: E731
        d["final_quality"] = clean(self.final_quality)
        d["eval_quality"] = [clean(q) for q in self.eval_quality]
        d["loss"] = [clean(x) for x in self.loss]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunRecord":
        d = dict(d)
        back = lambda x: math.nan if x is None else x  # noqa: E731
        d["final_quality"] = back(d["final_quality"])
        d["eval_quality"] = [back(q) for q in d["eval_quality"]]
        d["loss"] = [back(x) for x in d["loss"]]
        return cls(**d)


def _rank_setup(config: RunConfig):
    """This rank's ``(rank, n, device, task, model, params, dense_nbytes)``: the task's model, built from the seed
    on the group's device, and the bytes of its parameters."""
    import torch.distributed as dist

    device = group_device()
    task = get_task(config.task)
    model = task.build(config.seed).to(device)
    params = list(model.parameters())
    return (dist.get_rank(), dist.get_world_size(), device, task, model, params,
            sum(p.numel() * p.element_size() for p in params))


def train_rank(config: RunConfig, emulate: EmulatedTopology | None = None) -> dict[str, Any]:
    """One rank's part of :func:`run` (call inside every rank; ``config`` resolved). Returns plain lists."""
    if config.sync != "every":
        return _train_rank_sync(config, emulate)
    rank, n, device, task, model, params, dense_nbytes = _rank_setup(config)
    # One bucket for the whole gradient: the compressors see it as one tensor (a global Top-K, chapter 5).
    wrapped = BucketedDataParallel(model, bucket_cap_bytes=dense_nbytes)
    clock = wrapped.clock
    method = make_method(config.method, config.error_feedback, config.warmup_steps, config.seed, emulate, clock,
                         config.aggregation)
    wrapped.register_comm_hook(method, method_hook)
    opt = make_optimizer(config.optimizer, model, config.lr)
    gen = torch.Generator().manual_seed(config.seed * 1000 + rank + 1)
    out = {k: [] for k in ("loss", "compute_s", "codec_s", "comm_s", "step_s", "evals")}
    out.update(payload_nbytes=0, bytes_sent_per_rank=0.0, path="", diverged_at_step=None,
               params=sum(p.numel() for p in params), dense_nbytes=dense_nbytes)
    marked = []

    def evaluate(step):
        model.eval()
        out["evals"].append((step, *task.evaluate(model, rank, n)))
        model.train()

    evaluate(0)
    for step in range(config.steps):
        t0 = clock.mark()
        batch = tuple(t.to(device) for t in task.batch(rank, n, config.batch_size, gen))
        opt.zero_grad(set_to_none=False)
        try:
            loss = task.loss(wrapped, batch)
            loss.backward()  # the method averages the bucket inside it, and the wait runs at its end
        except FloatingPointError:
            out["diverged_at_step"] = step
            break
        t1 = clock.mark()
        opt.step()
        marked.append((t0, t1, clock.mark(), wrapped.last_step, method.take_costs(), loss.detach()))
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            evaluate(step + 1)
    # The marks are read once, after training (on a GPU a wait per step would serialise the run).
    for t0, t1, t2, rec, costs, loss in marked:
        # Time the autograd thread spent inside the method (it averages synchronously) and waiting at the end
        # of backward is averaging, not compute; what the compressor itself took of it is the codec's.
        averaging = sum(b.launched_s - b.launch_s for b in rec.buckets) + (rec.wait_end_s - rec.wait_start_s)
        codec = sum(c.codec_s(clock) for c in costs)
        out["step_s"].append(clock.elapsed(t0, t2))
        out["compute_s"].append(clock.elapsed(t0, t1) - averaging)
        out["codec_s"].append(codec)
        out["comm_s"].append(averaging - codec)
        out["loss"].append(float(loss))
        out["payload_nbytes"] = sum(c.payload_nbytes for c in costs)
        out["bytes_sent_per_rank"] = sum(c.bytes_sent_per_rank for c in costs)
        out["path"] = costs[0].path
    return out


def make_sync(config: RunConfig, params, emulate: EmulatedTopology | None = None):
    """The :mod:`commlab.sync` object of ``config.sync`` over ``params`` (call inside every rank):
    :class:`commlab.sync.LocalSGD` or :class:`commlab.sync.DiLoCo` (outer SGD at its defaults), whose compressor
    is ``config.method`` (None for ``"dense"``)."""
    from commlab.sync import DiLoCo, LocalSGD

    kind, nums = parse_sync(config.sync)
    if kind == "local":
        return LocalSGD(params, every=nums[0], emulate=emulate)
    fragments, delay, mixing = nums[1:] if kind == "streaming" else (1, 0, 0.0)
    outer = {}
    if config.outer_lr is not None:
        outer["outer_lr"] = config.outer_lr
    if config.outer_momentum is not None:
        outer.update(outer_momentum=config.outer_momentum, nesterov=config.outer_momentum > 0)
    return DiLoCo(params, inner_steps=nums[0], fragments=fragments, sync_delay=delay, mixing=mixing, **outer,
                  compressor=None if config.method == "dense" else config.method,
                  error_feedback=config.error_feedback, emulate=emulate, seed=config.seed,
                  aggregation=config.aggregation)


def _train_rank_sync(config: RunConfig, emulate: EmulatedTopology | None) -> dict[str, Any]:
    """:func:`train_rank` for a run that syncs less often: every rank takes its own optimizer steps on its own
    batches, and the sync object (:func:`make_sync`) averages (local SGD) or applies an outer step (DiLoCo) when
    its schedule says so. ``compute_s`` is forward + backward, ``comm_s`` the sync's call (encode/decode
    included; ``codec_s`` is 0), ``step_s`` the whole step with the optimizer's. The held-out quality is that of
    the ranks' average model (the model they would agree on if they synced now; between syncs each rank's own
    differs), averaged through a group of its own outside every step."""
    import copy

    import torch.distributed as dist

    from commlab.launch.device import Clock

    rank, n, device, task, model, params, dense_nbytes = _rank_setup(config)
    eval_group = dist.new_group(backend="gloo")
    clock = Clock(device)
    sync = make_sync(config, params, emulate)
    opt = make_optimizer(config.optimizer, model, config.lr)
    gen = torch.Generator().manual_seed(config.seed * 1000 + rank + 1)
    out = {k: [] for k in ("loss", "compute_s", "codec_s", "comm_s", "step_s", "evals")}
    out.update(diverged_at_step=None, params=sum(p.numel() for p in params), dense_nbytes=dense_nbytes)
    marked = []

    @torch.no_grad()
    def evaluate(step):
        avg = copy.deepcopy(model)
        for p in avg.parameters():
            host = p.detach().cpu()
            dist.all_reduce(host, group=eval_group)
            p.copy_(host / n)
        avg.eval()
        out["evals"].append((step, *task.evaluate(avg, rank, n)))

    evaluate(0)
    for step in range(config.steps):
        t0 = clock.mark()
        batch = tuple(t.to(device) for t in task.batch(rank, n, config.batch_size, gen))
        opt.zero_grad(set_to_none=False)
        loss = task.loss(model, batch)
        loss.backward()
        t1 = clock.mark()
        opt.step()
        t2 = clock.mark()
        try:
            sync.step()
        except FloatingPointError:  # raised on every rank by the compressed averaging's finiteness check
            out["diverged_at_step"] = step
            break
        marked.append((t0, t1, t2, clock.mark(), loss.detach()))
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            evaluate(step + 1)
    if hasattr(sync, "close"):
        sync.close()  # Streaming DiLoCo: wait for a fragment's sync still in flight
    for t0, t1, t2, t3, loss in marked:
        out["step_s"].append(clock.elapsed(t0, t3))
        out["compute_s"].append(clock.elapsed(t0, t1))
        out["codec_s"].append(0.0)
        out["comm_s"].append(clock.elapsed(t2, t3))
        out["loss"].append(float(loss))
    done = max(1, len(marked))
    # Bytes per inner step, the mean over the run (the outer syncs spread over the steps between them).
    out["bytes_sent_per_rank"] = float(sync.bytes_sent_per_rank) / done
    # One rank's payloads over one cycle of outer syncs (every fragment once), and how they were combined.
    out["payload_nbytes"] = sum(getattr(sync, "payload_nbytes", [dense_nbytes]))
    out["path"] = getattr(sync, "path", "all_reduce")
    return out


def run(config: RunConfig, *, timeout: float = 600.0) -> RunRecord:
    """Launch the ranks, train, and combine their records.

    Raises:
        ValueError: a bad config. commlab.launch's errors if a rank fails (the message names it).
    """
    from commlab.launch import launch

    config = config.resolved()
    emulate = None
    if config.link_bytes_per_s is not None:
        emulate = EmulatedTopology(config.world_size, 1, Link.from_bandwidth(config.link_bytes_per_s,
                                                                             config.link_alpha_s, "emulated"))
    t0 = time.perf_counter()
    ranks = launch(train_rank, config.world_size, config, emulate, timeout=timeout, print_output=False)
    wall = time.perf_counter() - t0
    task_cls = _task_class(config.task)
    r0 = ranks[0]
    steps = len(r0["loss"])
    # Every rank evaluated its share at the same steps: add the shares.
    eval_steps = [e[0] for e in r0["evals"]]
    quality = []
    for i in range(len(eval_steps)):
        total = sum(r["evals"][i][1] for r in ranks)
        count = sum(r["evals"][i][2] for r in ranks)
        quality.append(task_cls.quality(total, count))
    diverged = r0["diverged_at_step"]
    # A model whose held-out loss is no longer finite has diverged even if no gradient was NaN yet.
    bad = next((s for s, q in zip(eval_steps, quality) if not math.isfinite(q)), None)
    if diverged is None and bad is not None:
        diverged = bad
    quality = [q if math.isfinite(q) else math.nan for q in quality]
    slowest = {k: [max(r[k][i] for r in ranks) for i in range(steps)] for k in ("compute_s", "codec_s", "comm_s", "step_s")}
    dense_nbytes = r0["dense_nbytes"]
    return RunRecord(
        config=dataclasses.asdict(config), label=config.label, metric=task_cls.metric,
        higher_is_better=task_cls.higher_is_better, params=r0["params"], dense_nbytes=dense_nbytes,
        payload_nbytes=r0["payload_nbytes"], bytes_sent_per_rank=r0["bytes_sent_per_rank"], path=r0["path"],
        loss=[sum(r["loss"][i] for r in ranks) / len(ranks) for i in range(steps)], **slowest,
        eval_steps=eval_steps, eval_quality=quality,
        final_quality=math.nan if diverged is not None else quality[-1], diverged_at_step=diverged, wall_s=wall)
