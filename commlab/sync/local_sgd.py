"""Local SGD: every replica steps alone, and the parameters are averaged every H steps.

:class:`LocalSGD` averages after the local optimizer's step on the schedule of torch's ``PeriodicModelAverager``
(``period=every``, ``warmup_steps``), through commlab's ring AllReduce so that an emulated slow link can delay it.
Post-local SGD (Lin et al. 2020, arXiv:1808.07217) runs synchronous DP during the warm-up, then this.

Book: chapter 8b, §8b.1 (local SGD); checked against torch in tests/test_sync.py.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives.agreement import agree
from commlab.collectives.common import group_size_and_rank
from commlab.sync.average import (agree_before_sync, check_emulate, check_params, flatten, mean_over_group,
                                   unflatten_into)
from commlab.topology.emulated import EmulatedTopology

__all__ = ["LocalSGD"]


class LocalSGD:
    """Periodic model averaging over ``group``; call :meth:`step` right after each local ``optimizer.step()``.

    Call ``k`` (0-based) averages when ``k >= warmup_steps`` and ``(k - warmup_steps) % every == 0``, the schedule of
    torch's ``PeriodicModelAverager`` (nothing during the warm-up: pair it with DDP there, as post-local SGD does).
    One flat buffer divided by N before the sum, as torch's ``average_parameters``, but parameters whose ``.grad``
    is None are averaged too.

    Args:
        params: the parameters (floating-point tensors, each once; mixed dtypes are averaged in their promoted
            dtype, as torch's ``average_parameters``), the same layout on every rank. The tensors are held: a
            parameter replaced on the module afterwards is not averaged; rebuild.
        group: the data-parallel process group (None: the world).
        every: H, steps between averages (>= 1). warmup_steps: steps before the first average (>= 0).
        emulate: an :class:`~commlab.topology.EmulatedTopology` delaying the AllReduce's messages.

    Attributes: ``every``, ``warmup_steps``; ``steps`` and ``averages`` so far, ``bytes_sent_per_rank`` (cumulative).

    Raises:
        ValueError: a setting out of range, no parameters, a non-floating-point or repeated tensor, an ``emulate``
            too small for the group. CollectiveMismatchError: ranks disagree on settings or layout. From
            :meth:`step`, on every rank before anything is sent: FloatingPointError (a NaN/Inf parameter on any rank),
            RuntimeError (the ranks' step counts differ: a state loaded on some ranks only).
    """

    def __init__(self, params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None, *, every: int,
                 warmup_steps: int = 0, emulate: EmulatedTopology | None = None):
        self.every = checks.integer("every", every, where="LocalSGD", note="H, steps between averages")
        self.warmup_steps = checks.integer("warmup_steps", warmup_steps, least=0, where="LocalSGD")
        self.params = list(params)
        if not self.params:
            checks.fail("params", self.params, "a non-empty iterable of tensors", where="LocalSGD")
        check_params(self.params, "LocalSGD")
        self.group, self.emulate = group, emulate
        self.size, _ = group_size_and_rank(group, "LocalSGD")
        check_emulate(emulate, group, "LocalSGD")
        layout = (self.every, self.warmup_steps, tuple((p.numel(), str(p.dtype)) for p in self.params))
        agree("LocalSGD", layout, group, what="(every, warmup_steps, parameter layout)")
        self.steps = 0
        self.averages = 0
        self.bytes_sent_per_rank = 0.0

    def due(self, step: int | None = None) -> bool:
        """Whether call ``step`` (0-based; default: the next one) averages."""
        k = self.steps if step is None else step
        return k >= self.warmup_steps and (k - self.warmup_steps) % self.every == 0

    def step(self) -> bool:
        """Count one local step; average the parameters if the schedule says so. Returns True when it averaged."""
        averaged = self.due()
        if averaged:
            self.average()
        self.steps += 1
        return averaged

    @torch.no_grad()
    def average(self) -> None:
        """Replace every rank's parameters by their mean over the group, now (off the schedule)."""
        flat = flatten(self.params)
        agree_before_sync(flat, self.group, f"LocalSGD step {self.steps}: the parameters", self.steps)
        out = mean_over_group(flat, self.group, emulate=self.emulate)
        for p, m in zip(self.params, unflatten_into(out.mean, self.params)):
            p.copy_(m)
        self.averages += 1
        self.bytes_sent_per_rank += out.bytes_sent_per_rank

    def state_dict(self) -> dict:
        """``{"every", "warmup_steps", "steps", "averages", "bytes_sent_per_rank"}`` (parameters: the model's)."""
        return {"every": self.every, "warmup_steps": self.warmup_steps, "steps": self.steps,
                "averages": self.averages, "bytes_sent_per_rank": self.bytes_sent_per_rank}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`.

        Raises:
            ValueError: a key of :meth:`state_dict` missing (named); ``every`` or ``warmup_steps`` differ from this
                object's (the schedule would change).
        """
        missing = sorted({"every", "warmup_steps", "steps", "averages", "bytes_sent_per_rank"} - set(state))
        if missing:
            raise ValueError(f"LocalSGD.load_state_dict: the state lacks {missing}; pass what LocalSGD.state_dict() "
                             "returned")
        for name in ("every", "warmup_steps"):
            if state[name] != getattr(self, name):
                raise ValueError(f"LocalSGD.load_state_dict: the checkpoint has {name}={state[name]!r}, this "
                                 f"LocalSGD {name}={getattr(self, name)!r}; build it with the checkpoint's setting")
        self.steps, self.averages = int(state["steps"]), int(state["averages"])
        self.bytes_sent_per_rank = float(state["bytes_sent_per_rank"])
