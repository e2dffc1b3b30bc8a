"""DiLoCo and Streaming DiLoCo: H inner steps alone, then an outer SGD step on the averaged pseudo-gradient.

:class:`DiLoCo` keeps the global copy of the parameters and the outer momentum; every H inner steps (per fragment,
on the staggered schedule of :mod:`commlab.sync.schedule`) it averages Delta = theta_global - theta_local over the
group (dense ring AllReduce, or a compressor through :func:`commlab.compress.aggregate`, with error feedback), takes
an outer SGD (Nesterov) step on the global copy and mixes it into the replica. With ``sync_delay`` tau > 0 the
AllReduce runs on a background thread over a second gloo/NCCL group while tau inner steps go on.
Sources: arXiv:2311.08105 (DiLoCo), arXiv:2501.18512 (Streaming DiLoCo), torchft ``local_sgd.py``.

Book: chapter 8b, §8b.2 (DiLoCo) and §8b.3 (Streaming DiLoCo); cost model in :mod:`commlab.sync.cost` (§8b.4).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives.agreement import agree, gather
from commlab.collectives.common import global_rank, group_size_and_rank
from commlab.compress.error_feedback import ErrorFeedback
from commlab.compress.hooks import AGGREGATIONS
from commlab.compress.specs import compressor_for, parse_spec
from commlab.sync.average import (agree_before_sync, bits_checksum, check_emulate, check_params, flatten,
                                   mean_over_group, unflatten_into)
from commlab.sync.schedule import FragmentSync, check_schedule, fragment_schedule, split_fragments
from commlab.topology.emulated import EmulatedTopology

__all__ = ["DiLoCo", "outer_sgd_step"]

#: The settings a checkpoint must share with the DiLoCo that loads it (they fix the schedule and the payloads).
STRUCTURAL = ("inner_steps", "fragments", "sync_delay", "compressor", "error_feedback", "aggregation", "layout")


def outer_sgd_step(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, lr: float, momentum: float,
                   nesterov: bool) -> torch.Tensor | None:
    """One step of SGD with momentum on ``param`` in place, as ``torch.optim.SGD`` (dampening 0, no weight decay):
    ``buf = grad`` on the first step, else ``buf = momentum buf + grad``; ``param -= lr (grad + momentum buf)``
    (Nesterov) or ``lr buf``. Returns the new buffer (None without momentum). Shapes: all alike."""
    if momentum != 0:
        if buf is None:
            buf = grad.clone()
        else:
            buf.mul_(momentum).add_(grad)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    param.add_(grad, alpha=-lr)
    return buf


#: Groups made for in-flight syncs and handed back by DiLoCo.close(), by the ranks they span. Destroying one would
#: not free it for good: torch names a locally synchronised group by its ranks and the number of groups, so the
#: next one would reuse the name and read the destroyed group's stale rendezvous keys (a gloo size mismatch).
_IDLE_SYNC_GROUPS: dict[tuple[int, ...], list] = {}


def _ranks_of(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _take_sync_group(group):
    """A group over ``group``'s ranks for the in-flight AllReduce: an idle one that every rank holds (they agree on
    which, by name), else a new one (collective over ``group``'s members)."""
    ranks = _ranks_of(group)
    idle = [g for g in _IDLE_SYNC_GROUPS.get(ranks, []) if g in dist.distributed_c10d._world.pg_names]
    _IDLE_SYNC_GROUPS[ranks] = idle
    names = {dist.distributed_c10d._world.pg_names[g]: g for g in idle}
    common = set.intersection(*(set(n) for n in gather(sorted(names), group)))
    if common:
        chosen = names[min(common)]
        idle.remove(chosen)
        return chosen
    return dist.new_group(list(ranks), use_local_synchronization=True)


@dataclasses.dataclass
class _InFlight:
    """One fragment's outer sync between send and apply (mean, sent, seconds and error are filled by the worker)."""

    sync: FragmentSync
    thread: threading.Thread | None = None
    mean: torch.Tensor | None = None
    sent: float = 0.0
    seconds: float = 0.0
    error: BaseException | None = None
    counted: bool = False


class DiLoCo:
    """DiLoCo (``fragments=1, sync_delay=0``) and Streaming DiLoCo over a data-parallel group.

    Call :meth:`step` after each inner ``optimizer.step()``. At a fragment's send step (:attr:`schedule`) its
    ``Delta = theta_global - theta_local`` (arXiv:2311.08105, Alg. 1) is averaged over the group; tau steps later the
    outer SGD steps the global copy and the fragment becomes ``alpha theta_local + (1 - alpha) theta_global``.

    Args:
        params: floating-point tensors in model order, each once (fragments are contiguous runs,
            :func:`split_fragments`), or a list of explicit fragments; mixed dtypes are averaged in the promoted
            dtype. The tensors are held (a parameter replaced on the module later is not synced).
        group: the DP group (None: the world); its first rank's parameters are broadcast at construction.
        inner_steps: H >= 1. fragments: F, a divisor of H. sync_delay: tau in 0..H/F-1. mixing: alpha in [0, 1].
        outer_lr, outer_momentum, nesterov: the outer SGD (defaults 0.7, 0.9, Nesterov).
        compressor, error_feedback, aggregation: Delta's compressor spec (:func:`commlab.compress.specs.parse_spec`;
            None or ``"dense"``), its residuals per fragment, ``"auto"`` or ``"two_phase"``.
        emulate: an :class:`~commlab.topology.EmulatedTopology` delaying the sync's messages. seed: compressors' RNG.

    Attributes: the arguments, ``period`` (H/F) and :attr:`schedule` (one cycle); state ``steps``,
    ``global_params``, ``momentum_buffers``, ``outer_steps``, residuals, ``bytes_sent_per_rank``; measured
    ``comm_seconds``, ``wait_seconds`` (the exposed part), ``payload_nbytes`` (per fragment), ``path``, ``closed``.

    Raises:
        ValueError: a bad setting, spec, tensor or ``emulate`` (named). CollectiveMismatchError: ranks disagree on
            settings or layout. FloatingPointError (from :meth:`step`, on every rank): a NaN/Inf Delta.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Sequence[Sequence[torch.Tensor]],
                 group: dist.ProcessGroup | None = None, *, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, fragments: int = 1, sync_delay: int = 0,
                 mixing: float = 0.0, compressor: str | None = None, error_feedback: bool = False,
                 emulate: EmulatedTopology | None = None, seed: int = 0, aggregation: str = "auto"):
        w = "DiLoCo"
        self.period = check_schedule(inner_steps, fragments, sync_delay, where=w)
        self.inner_steps, self.fragments, self.sync_delay = int(inner_steps), int(fragments), int(sync_delay)
        self.outer_lr = checks.number("outer_lr", outer_lr, above=0.0, where=w)
        self.outer_momentum = checks.number("outer_momentum", outer_momentum, least=0.0, below=1.0, where=w)
        self.nesterov = checks.flag("nesterov", nesterov, where=w)
        if self.nesterov and self.outer_momentum == 0:
            checks.fail("nesterov", nesterov, "False when outer_momentum is 0", where=w,
                        note="Nesterov needs momentum, as torch.optim.SGD says")
        self.mixing = checks.share("mixing", mixing, where=w, note="alpha: local <- alpha local + (1-alpha) global")
        self.error_feedback = checks.flag("error_feedback", error_feedback, where=w)
        self.seed = checks.integer("seed", seed, least=0, where=w)
        self.compressor = None if compressor in (None, "dense") else compressor
        self._compressor = None
        if self.compressor is not None:
            try:
                kind, _ = parse_spec(self.compressor)
                if kind != "powersgd":
                    self._compressor = compressor_for(self.compressor, seed=self.seed)
            except (ValueError, TypeError) as e:  # the spec's own message, under the argument's name
                raise ValueError(f"{w}: compressor={compressor!r} is not a usable spec: {e}") from e
            if kind == "powersgd":
                checks.fail("compressor", compressor, "a compressor spec other than powersgd", where=w,
                            note="PowerSGD keeps per-matrix state of its own; use int:8, topk:0.01, cast:fp16, ...")
        if self.error_feedback and self._compressor is None:
            checks.fail("error_feedback", True, "False without a compressor", where=w,
                        note="dense Delta loses nothing to feed back")
        self.aggregation = checks.one_of("aggregation", aggregation, AGGREGATIONS, where=w)
        if self.aggregation == "two_phase" and self._compressor is None:
            checks.fail("aggregation", aggregation, "'auto' without a compressor", where=w,
                        note="the two-phase AllReduce compresses twice; dense Delta rides the ring AllReduce")
        self._ef = ErrorFeedback(self._compressor) if self.error_feedback else None
        two_phase_ef = self.error_feedback and self.aggregation == "two_phase"
        self._server_ef = ErrorFeedback(self._compressor) if two_phase_ef else None
        self.group, self.emulate = group, emulate
        self.size, _ = group_size_and_rank(group, w)
        check_emulate(emulate, group, w)

        self.params, self.fragment_index = self._fragments(params)
        self.layout = tuple(tuple((tuple(self.params[i].shape), str(self.params[i].dtype)) for i in idx)
                            for idx in self.fragment_index)
        agree(w, (self.hyperparameters(), self.layout), group, what="(settings, fragments' layout)")
        self.schedule: tuple[FragmentSync, ...] = fragment_schedule(self.inner_steps, self.fragments, self.sync_delay)
        self._send_at = {s.send_step: s for s in self.schedule}
        self._apply_at = {s.apply_step: s for s in self.schedule}

        with torch.no_grad():
            if self.size > 1:
                src = global_rank(group, 0)
                for p in self.params:
                    dist.broadcast(p.data, src, group=group)
            # Persistent state (saved by state_dict).
            self.global_params = [p.detach().clone() for p in self.params]
            self.momentum_buffers = [torch.zeros_like(p) for p in self.params]
        self.steps = 0
        self.outer_steps = [0] * self.fragments
        self.bytes_sent_per_rank = 0.0
        self.comm_seconds = self.wait_seconds = 0.0
        # Of the last sync of each fragment: one rank's payload bytes; and the path payloads took.
        self.payload_nbytes = [0] * self.fragments
        self.path = "all_reduce" if self._compressor is None else ""
        self._in_flight: _InFlight | None = None
        self.closed = False
        # The in-flight AllReduce gets its own group, so that it never interleaves with the caller's collectives;
        # close() hands it back for the next DiLoCo on the same ranks (see _take_sync_group).
        self._sync_group, self._own_group = group, None
        if self.sync_delay > 0 and self.size > 1:
            self._sync_group = self._own_group = _take_sync_group(group)

    def _fragments(self, params) -> tuple[list[torch.Tensor], list[list[int]]]:
        params = list(params)
        if params and all(isinstance(g, (list, tuple)) for g in params):
            if self.fragments not in (1, len(params)):
                checks.fail("fragments", self.fragments, f"1 or {len(params)} (the explicit fragments passed)",
                            where="DiLoCo")
            if self.fragments == 1 and len(params) > 1:
                self.period = check_schedule(self.inner_steps, len(params), self.sync_delay, where="DiLoCo")
                self.fragments = len(params)
            flat, index = [], []
            for g in params:
                if not g:
                    checks.fail("params", params, "fragments that each hold a tensor", where="DiLoCo")
                index.append(list(range(len(flat), len(flat) + len(g))))
                flat.extend(g)
            check_params(flat, "DiLoCo")
            return flat, index
        if not params or not all(isinstance(p, torch.Tensor) for p in params):
            checks.fail("params", params, "a non-empty iterable of tensors, or a list of lists of tensors",
                        where="DiLoCo")
        check_params(params, "DiLoCo")
        return params, split_fragments(params, self.fragments)

    def hyperparameters(self) -> dict:
        """The settings, as the checkpoint stores them (``layout``: each fragment's shapes and dtypes)."""
        return {"inner_steps": self.inner_steps, "fragments": self.fragments, "sync_delay": self.sync_delay,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum, "nesterov": self.nesterov,
                "mixing": self.mixing, "compressor": self.compressor, "error_feedback": self.error_feedback,
                "aggregation": self.aggregation, "seed": self.seed}

    # ------------------------------------------------------------------------------------------ the schedule

    def step(self) -> bool:
        """Count one inner step; send and/or apply a fragment's outer sync if the schedule says so.

        Returns:
            True when an outer update was applied after this step.

        Raises:
            FloatingPointError: a NaN/Inf pseudo-gradient on any rank (every rank raises, nothing sent).
            RuntimeError: at a send step, the ranks' step counts or global copies differ (every rank raises, nothing
            sent); called after :meth:`close`.
            Any error of the outer AllReduce (re-raised here, at the apply step, on the rank it happened).
        """
        if self.closed:
            raise RuntimeError(f"DiLoCo.step: called after close() (at inner step {self.steps}); build a new DiLoCo "
                               "and load_state_dict to go on")
        self.steps += 1
        pos = (self.steps - 1) % self.inner_steps + 1
        sync = self._send_at.get(pos)
        if sync is not None:
            self._send(sync)
        sync = self._apply_at.get(pos)
        if sync is not None:
            self._apply(sync)
            return True
        return False

    def _tensors(self, f: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        idx = self.fragment_index[f]
        return ([self.params[i] for i in idx], [self.global_params[i] for i in idx],
                [self.momentum_buffers[i] for i in idx])

    @torch.no_grad()
    def _send(self, sync: FragmentSync) -> None:
        local, glob, _ = self._tensors(sync.fragment)
        delta = flatten(glob) - flatten(local)
        # The same error on every rank before anything is sent: a NaN/Inf Delta, or ranks whose step counts or
        # global copies differ (a state loaded on some ranks only).
        agree_before_sync(delta, self.group, f"DiLoCo step {self.steps}: fragment {sync.fragment}'s pseudo-gradient",
                          self.steps, bits_checksum(glob), "global copies (checksums of their bits)")
        job = _InFlight(sync)
        if self.sync_delay == 0 or self.size == 1:
            self._average(job, delta, self.group)
        else:
            job.thread = threading.Thread(target=self._average, args=(job, delta, self._sync_group), daemon=True,
                                          name=f"diloco-fragment-{sync.fragment}")
            job.thread.start()
        self._in_flight = job

    def _average(self, job: _InFlight, delta: torch.Tensor, group) -> None:
        t0 = time.perf_counter()
        try:
            if delta.is_cuda:  # the current device is per thread: a worker starts on GPU 0
                torch.cuda.set_device(delta.device)
            with torch.no_grad():
                out = mean_over_group(delta, group, compressor=self._compressor, error_feedback=self._ef,
                                      key=job.sync.fragment if self._ef else None, emulate=self.emulate,
                                      path=self.aggregation, server_error_feedback=self._server_ef)
            job.mean, job.sent = out.mean, out.bytes_sent_per_rank
            self.payload_nbytes[job.sync.fragment], self.path = out.payload_nbytes, out.path
        except BaseException as e:  # re-raised on the caller's thread at the apply step
            job.error = e
        job.seconds = time.perf_counter() - t0

    def _wait(self) -> _InFlight:
        """Join the in-flight sync (counting the time blocked on it) and return it; its error is raised here."""
        job = self._in_flight
        if job.thread is not None:
            t0 = time.perf_counter()
            job.thread.join()
            self.wait_seconds += time.perf_counter() - t0
            job.thread = None
        elif not job.counted:  # ran on this thread at the send step: all of it was exposed
            self.wait_seconds += job.seconds
        if not job.counted:
            self.comm_seconds += job.seconds
            self.bytes_sent_per_rank += job.sent
            job.counted = True
        if job.error is not None:
            self._in_flight = None
            raise job.error
        return job

    @torch.no_grad()
    def _apply(self, sync: FragmentSync) -> None:
        f = sync.fragment
        if self._in_flight is None:
            raise RuntimeError(f"DiLoCo step {self.steps}: fragment {f}'s outer update is due, but its sync was never "
                               f"sent (its send step, {self.steps - self.sync_delay}, raised); restore a checkpoint")
        job = self._wait()
        if job.sync != sync:
            raise RuntimeError(f"DiLoCo step {self.steps}: fragment {f} is due but fragment {job.sync.fragment}'s "
                               "sync is in flight; the schedule was broken (a state loaded mid-cycle?)")
        local, glob, bufs = self._tensors(f)
        first = self.outer_steps[f] == 0
        momentum = self.outer_momentum
        for p, g, buf, d in zip(local, glob, bufs, unflatten_into(job.mean, glob)):
            new = outer_sgd_step(g, d, None if (first or momentum == 0) else buf, self.outer_lr, momentum,
                                 self.nesterov)
            if momentum != 0 and first:
                buf.copy_(new)
            if self.mixing == 0:
                p.copy_(g)
            else:
                p.copy_(torch.lerp(g, p, self.mixing))
        self.outer_steps[f] += 1
        self._in_flight = None

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Everything needed to resume bitwise, as tensors, ints, floats and strings (DCP can store it).

        A sync in flight is drained first: its AllReduce is waited for (only the wait moves earlier) and its mean
        Delta saved under ``"in_flight"``, to be applied at its apply step after a load. The model's parameters and
        the inner optimizer are saved by their own ``state_dict``.

        Returns:
            ``{"hyperparameters", "layout", "steps", "outer_steps", "bytes_sent_per_rank", "global_params",
            "momentum_buffers", "residuals", "compressor_state", "in_flight", "world_size"}``; tensors are copies.
        """
        in_flight = None
        if self._in_flight is not None:
            job = self._wait()
            in_flight = {"fragment": job.sync.fragment, "send_step": job.sync.send_step,
                         "apply_step": job.sync.apply_step, "mean": job.mean.clone()}
        residuals = []  # error feedback: this rank's residual per fragment (and a chunk owner's, two-phase)
        for which, ef in (("worker", self._ef), ("owner", self._server_ef)):
            for key in ([] if ef is None else sorted(ef.keys(), key=repr)):
                residuals.append({"which": which, "key": list(key) if isinstance(key, tuple) else [key],
                                  "residual": ef.residual(key).clone()})
        return {"hyperparameters": self.hyperparameters(), "layout": [list(map(list, f)) for f in self.layout],
                "steps": self.steps, "outer_steps": list(self.outer_steps),
                "bytes_sent_per_rank": self.bytes_sent_per_rank,
                "global_params": [g.clone() for g in self.global_params],
                "momentum_buffers": [b.clone() for b in self.momentum_buffers],
                "residuals": residuals, "compressor_state": self._compressor_state(),
                "in_flight": in_flight, "world_size": self.size}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (load the model's parameters and the inner optimizer alongside).

        ``outer_lr``, ``outer_momentum``, ``nesterov``, ``mixing`` and ``seed`` are this object's (a resumed run may
        change them); the settings in :data:`STRUCTURAL` must match the checkpoint's.

        Raises:
            ValueError: keys of :meth:`state_dict` missing (named); a structural setting or the layout differs
                (named, both values); the checkpoint holds
                two-phase chunk owners' residuals and was saved on a group of another size (``world_size``).
        """
        missing = sorted({"hyperparameters", "layout", "steps", "outer_steps", "global_params", "momentum_buffers",
                          "residuals", "compressor_state", "in_flight"} - set(state))
        if missing:
            raise ValueError(f"DiLoCo.load_state_dict: the state lacks {missing}; pass what DiLoCo.state_dict() "
                             "returned (not a LocalSGD's, a model's or an optimizer's)")
        saved = dict(state["hyperparameters"], layout=tuple(tuple((tuple(s), d) for s, d in f)
                                                           for f in state["layout"]))
        mine = dict(self.hyperparameters(), layout=self.layout)
        for name in STRUCTURAL:
            if saved[name] != mine[name]:
                raise ValueError(f"DiLoCo.load_state_dict: the checkpoint has {name}={saved[name]!r}, this DiLoCo "
                                 f"{name}={mine[name]!r}; build it with the checkpoint's settings")
        owners = any(entry["which"] == "owner" for entry in state["residuals"])
        if owners and state.get("world_size", self.size) != self.size:
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint has world_size={state['world_size']}, this "
                             f"group {self.size} ranks; its two-phase chunk owners' residuals are cut for "
                             f"{state['world_size']} chunks (resume on that many ranks, or without error_feedback)")
        if self._in_flight is not None and self._in_flight.thread is not None:
            self._in_flight.thread.join()
        with torch.no_grad():
            for mine_t, theirs in zip(self.global_params + self.momentum_buffers,
                                      list(state["global_params"]) + list(state["momentum_buffers"])):
                mine_t.copy_(theirs)
        self.steps = int(state["steps"])
        self.outer_steps = [int(k) for k in state["outer_steps"]]
        self.bytes_sent_per_rank = float(state["bytes_sent_per_rank"])
        efs = {"worker": self._ef, "owner": self._server_ef}
        for ef in efs.values():
            if ef is not None:
                ef.reset()
        for entry in state["residuals"]:
            key = tuple(int(k) for k in entry["key"])
            tensors = [self.params[i] for i in self.fragment_index[key[0]]]
            dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])  # flatten's dtype
            efs[entry["which"]].set_residual(key if entry["which"] == "owner" else key[0],
                                             entry["residual"].to(tensors[0].device), dtype=dtype)
        self._load_compressor_state(state["compressor_state"])
        job = state["in_flight"]
        self._in_flight = None
        if job is not None:
            sync = FragmentSync(int(job["fragment"]), int(job["send_step"]), int(job["apply_step"]))
            mean = job["mean"].to(self.params[self.fragment_index[sync.fragment][0]].device, copy=True)
            self._in_flight = _InFlight(sync, mean=mean, counted=True)

    def _compressor_state(self) -> dict:
        """The random state of the compressor (QSGD's generator, Random-K's call count), for a bitwise resume."""
        c, out = self._compressor, {}
        if c is not None and isinstance(getattr(c, "generator", None), torch.Generator):
            out["generator"] = c.generator.get_state()
        if c is not None and isinstance(getattr(c, "step", None), int):
            out["step"] = c.step
        return out

    def _load_compressor_state(self, state: dict) -> None:
        if "generator" in state:
            self._compressor.generator.set_state(state["generator"])
        if "step" in state:
            self._compressor.step = int(state["step"])

    def close(self) -> None:
        """Wait for a sync in flight (its result is kept: :meth:`state_dict` still saves it) and destroy the group
        this object made for it (tau > 0). Call before destroying the process group; calling it again does nothing.
        :meth:`step` raises RuntimeError after it."""
        if self._in_flight is not None and self._in_flight.thread is not None:
            self._in_flight.thread.join()
        if self._own_group is not None and dist.is_initialized():
            _IDLE_SYNC_GROUPS.setdefault(_ranks_of(self._own_group), []).append(self._own_group)
        self._own_group = None
        self.closed = True
