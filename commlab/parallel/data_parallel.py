"""Data parallelism inside a DP group: gradient averaging is :class:`~commlab.overlap.BucketedDataParallel`,
and ZeRO-1 shards the optimizer state.

On a TP x PP x DP mesh the ranks holding the same parameters form one DP group, passed explicitly
(:mod:`commlab.parallel.mesh` or ``dist.new_group``); average with ``BucketedDataParallel(...,
process_group=dp_group)``; a pipeline stage accumulates under ``no_sync()`` and averages after the flush::

    dp = BucketedDataParallel(stage, process_group=dp_group)
    with dp.no_sync():
        pipeline_step(dp, x, y, loss_fn, m, pp_group)
    dp.sync_gradients()

:class:`ZeroOneOptimizer` is ZeRO stage 1 (Rajbhandari et al. 2020, §5.1, P_os); stages 2 and 3 are
:class:`commlab.parallel.sharded.ShardedDataParallel`. Book: chapter 10, §10.11 and §10.12.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from commlab.collectives import ring_all_gather, ring_bytes_sent_per_rank, ring_reduce_scatter
from commlab.collectives.common import group_size_and_rank
from commlab.overlap.bucketed import data_parallel_of

__all__ = ["ZeroStepStats", "ZeroOneOptimizer"]


@dataclasses.dataclass(frozen=True)
class ZeroStepStats:
    """Bytes of one :meth:`ZeroOneOptimizer.step`, on this rank (ring model, padded sizes).

    Attributes:
        reduce_scatter_nbytes: sent in the gradient ReduceScatter, ``(N-1)/N * padded gradient bytes``; 0 when
            the gradients were already averaged by a :class:`~commlab.overlap.BucketedDataParallel`.
        all_gather_nbytes: sent in the parameter AllGather, ``(N-1)/N * padded parameter bytes``.
        gradients_averaged: whether the step found the gradients averaged already (and reduced nothing).
        bytes_sent_per_rank: their sum; with local gradients, the same as one ring AllReduce of the gradient.
    """

    reduce_scatter_nbytes: float
    all_gather_nbytes: float
    gradients_averaged: bool = False

    @property
    def bytes_sent_per_rank(self) -> float:
        return self.reduce_scatter_nbytes + self.all_gather_nbytes


def _flat(tensors: list[torch.Tensor | None], params: list[nn.Parameter], pad_to: int) -> torch.Tensor:
    """Concatenate (a None entry = zeros of its parameter's shape), zero-padded to ``pad_to`` elements."""
    parts = [(t if t is not None else torch.zeros_like(p)).detach().reshape(-1) for t, p in zip(tensors, params)]
    total = sum(x.numel() for x in parts)
    if pad_to > total:
        parts.append(torch.zeros(pad_to - total, dtype=params[0].dtype, device=params[0].device))
    return torch.cat(parts)


@dataclasses.dataclass
class _Shard:
    """One parameter group's flat layout and this rank's master copy of its shard."""

    params: list[nn.Parameter]      # the group's parameters that require grad
    numel: int
    padded_numel: int               # numel rounded up to a multiple of N, so every shard has the same size
    start: int                      # this rank's first element in the padded flat vector
    param: nn.Parameter             # the shard: what the inner optimizer updates

    @property
    def shard_numel(self) -> int:
        return self.param.numel()


def _ranks(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None or group is dist.group.WORLD \
        else dist.get_process_group_ranks(group)


class ZeroOneOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: a ``torch.optim.Optimizer`` whose state is sharded across the DP group.

    Each param group is one flat vector, zero-padded to a multiple of N and cut into N shards; group rank r
    steps an inner ``optimizer_cls`` on shard r, so the optimizer state exists for 1/N of the model per rank.
    :meth:`step` (1) takes each group's averaged gradient shard: ring-ReduceScatter over ``dp_group`` and /N,
    or, if a :class:`~commlab.overlap.BucketedDataParallel` on the same group averaged them already
    (``gradients_averaged``), its shard of that average, sending nothing; (2) copies :attr:`param_groups`'
    options into the inner groups (LR schedulers work) and steps the inner optimizer; (3) ring-AllGathers the
    shards into every parameter. Element-wise optimizers (SGD, momentum, Adam, AdamW) match the unsharded one
    up to summation order; whole-gradient ones (clipping inside the optimizer, LAMB) are not supported. A
    ``.grad`` of None counts as zero. :meth:`state_dict` is this rank's shard; :meth:`full_state` and
    :meth:`load_full_state` give a per-parameter checkpoint that loads under another N.

    Args:
        params: parameters or param-group dicts, the same on every rank of the group; each group's trainable
            parameters share one dtype and device.
        dp_group: the data-parallel group (None: the default group).
        optimizer_cls: a ``torch.optim.Optimizer`` class (default Adam); **optimizer_kwargs: its defaults.

    Attributes: ``param_groups``, ``defaults``, ``state`` (the inner optimizer's, 1/N of the model);
    ``inner``, ``shards``; ``numel``, ``padded_numel``; ``last_step`` (:class:`ZeroStepStats` or None).

    Raises:
        ValueError: no parameters, mixed dtype/device in a group, ``optimizer_cls`` not an optimizer class.
        RuntimeError: this rank is not a member of ``dp_group``.
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict], dp_group: dist.ProcessGroup | None = None,
                 optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam, **optimizer_kwargs: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer subclass (e.g. torch.optim.Adam), "
                             f"got {optimizer_cls!r}")
        self.group = dp_group
        self.n, self.group_rank = group_size_and_rank(dp_group, "ZeroOneOptimizer")
        self.optimizer_cls = optimizer_cls
        # A throwaway instance checks the options and supplies the defaults of every option, so that
        # param_groups show them all, as the unsharded optimizer's would.
        probe = optimizer_cls([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
        self.shards: list[_Shard] = []
        self.inner: torch.optim.Optimizer | None = None
        super().__init__(params, dict(probe.defaults))
        self.inner = optimizer_cls([self._inner_group(g, sh) for g, sh in zip(self.param_groups, self.shards)])
        self.state = self.inner.state  # what exists on this rank: the shards' state
        self.last_step: ZeroStepStats | None = None

    # ---- layout ---------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (torch's rules: its options default to :attr:`defaults`) and shard it."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = [p for p in group["params"] if p.requires_grad]
        where = len(self.param_groups) - 1
        if len({p.dtype for p in params}) > 1 or len({p.device for p in params}) > 1:
            raise ValueError(f"ZeroOneOptimizer: param group {where} mixes dtypes or devices "
                             f"({sorted({f'{p.dtype}@{p.device}' for p in params})}); its flat shards need one of "
                             "each: put such parameters in separate groups")
        numel = sum(p.numel() for p in params)
        # Padding to a multiple of N makes every shard the same size, which the ring AllGather requires.
        padded = math.ceil(numel / self.n) * self.n
        per = padded // self.n
        start = self.group_rank * per
        if params:
            with torch.no_grad():
                value = _flat([p for p in params], params, padded)[start:start + per].clone()
        else:
            value = torch.zeros(0)
        shard = _Shard(params, numel, padded, start, nn.Parameter(value))
        self.shards.append(shard)
        if self.inner is not None:
            self.inner.add_param_group(self._inner_group(group, shard))

    @staticmethod
    def _inner_group(group: dict, shard: _Shard) -> dict:
        return {**{k: v for k, v in group.items() if k != "params"}, "params": [shard.param]}

    @property
    def numel(self) -> int:
        return sum(sh.numel for sh in self.shards)

    @property
    def padded_numel(self) -> int:
        return sum(sh.padded_numel for sh in self.shards)

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held on this rank (tensors in the inner state), about 1/N of unsharded."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))

    # ---- the step ---------------------------------------------------------------------------------------

    def _gradients_averaged(self) -> bool:
        """Whether a data-parallel wrapper over our group has already averaged every gradient we hold."""
        params = [p for sh in self.shards for p in sh.params]
        wrappers = {id(w): w for w in (data_parallel_of(p) for p in params) if w is not None}
        averaged = [w for w in wrappers.values() if w.gradients_averaged]
        if not averaged:
            return False
        covered = [data_parallel_of(p) in averaged for p in params]
        if not all(covered):
            raise ValueError(f"ZeroOneOptimizer: {covered.count(False)} of {len(params)} parameters' gradients were "
                             "not averaged by the BucketedDataParallel that averaged the others; wrap the whole "
                             "model, or run its backward inside no_sync() so that this step reduces all of them")
        mine = _ranks(self.group)
        for w in averaged:
            if _ranks(w.process_group) != mine:
                raise ValueError(f"ZeroOneOptimizer shards over ranks {mine}, but the gradients were averaged by a "
                                 f"BucketedDataParallel over ranks {_ranks(w.process_group)}; use the same DP group "
                                 "for both")
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """ReduceScatter the gradients (unless already averaged), update this rank's shards, AllGather the parameters.

        Call it on every rank of the group. The parameters' ``.grad`` are left as they were.

        Args:
            closure: as for torch optimizers, re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or None. The bytes are in :attr:`last_step` (:class:`ZeroStepStats`).

        Raises:
            ValueError: only some parameters were averaged by a wrapper, or it averaged over another group.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        averaged = self._gradients_averaged()
        rs_bytes = ag_bytes = 0.0
        for group, inner_group, sh in zip(self.param_groups, self.inner.param_groups, self.shards):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
            if sh.numel == 0:
                continue
            per = sh.shard_numel
            # The current values, not a stale copy: the parameters may have been loaded or edited since.
            sh.param.copy_(_flat(list(sh.params), sh.params, sh.padded_numel)[sh.start:sh.start + per])
            grad = _flat([p.grad for p in sh.params], sh.params, sh.padded_numel)
            nbytes = grad.numel() * grad.element_size()
            if averaged or self.n == 1:
                shard_grad = grad[sh.start:sh.start + per].clone()
            else:
                shard_grad = ring_reduce_scatter(grad, self.group) / self.n
                rs_bytes += ring_bytes_sent_per_rank(nbytes, self.n, "reduce_scatter")
            sh.param.grad = shard_grad.to(sh.param.dtype)
        self.inner.step()
        for sh in self.shards:
            sh.param.grad = None  # rebuilt every step; holding it would add Ψ/N gradient bytes ZeRO-1 does not need
        for sh in self.shards:
            if sh.numel == 0:
                continue
            full = sh.param.detach() if self.n == 1 else ring_all_gather(sh.param.detach(), self.group)
            ag_bytes += ring_bytes_sent_per_rank(full.numel() * full.element_size(), self.n, "all_gather")
            offset = 0
            for p in sh.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.last_step = ZeroStepStats(rs_bytes, ag_bytes, averaged)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the shards' (the shards' are rebuilt every step)."""
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    # ---- unsharded state: checkpoints that do not depend on N ---------------------------------------

    @torch.no_grad()
    def full_state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Every parameter's optimizer state, unsharded: what ``optimizer_cls`` over the parameters would hold.

        Collective over the DP group: call it on every rank of the group together. For each parameter group
        and each state tensor of the shard's size (Adam's ``exp_avg``, ``exp_avg_sq``), one ring AllGather of
        the N shards (``padded_numel`` elements arrive on every rank), of which each parameter takes its slice of
        the flat vector, reshaped to the parameter's shape; 0-d tensors and other values (Adam's ``step``),
        equal on every rank of the group because every rank steps together, are copied. A checkpoint that stores
        this per parameter name is independent of N: :meth:`load_full_state` loads it under another group size,
        and an unsharded optimizer takes it as its ``state[p]``. The ranks briefly hold the group's whole state.

        Returns:
            parameter -> ``{state key: value}``, fresh tensors (not views of the shards), e.g. Adam's
            ``{"step": 0-d float32, "exp_avg": like p, "exp_avg_sq": like p}``; ``{}`` for every parameter of
            a group that has not stepped yet.

        Raises:
            RuntimeError: a shard's state tensor has neither the shard's size nor 0 dimensions (an inner
                optimizer whose state is not element-wise, which ZeRO-1 does not support).
        """
        out: dict[nn.Parameter, dict[str, Any]] = {}
        for where, sh in enumerate(self.shards):
            inner = self.inner.state.get(sh.param, {}) if sh.numel else {}
            per_param: list[dict[str, Any]] = [{} for _ in sh.params]
            for key in sorted(inner):  # sorted: every rank gathers the same keys in the same order
                value = inner[key]
                if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                    for st in per_param:
                        st[key] = value.clone() if isinstance(value, torch.Tensor) else value
                    continue
                if value.numel() != sh.shard_numel:
                    raise RuntimeError(f"ZeroOneOptimizer.full_state: group {where}'s state {key!r} has "
                                       f"{value.numel()} elements, its shard {sh.shard_numel}; only element-wise "
                                       "optimizer state can be sharded and gathered")
                flat = value.detach() if self.n == 1 else ring_all_gather(value.detach(), self.group)
                offset = 0
                for p, st in zip(sh.params, per_param):
                    st[key] = flat[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
            out.update(zip(sh.params, per_param))
        return out

    @torch.no_grad()
    def load_full_state(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        """Take this rank's shards of the optimizer state from every parameter's full (unsharded) state.

        The inverse of :meth:`full_state`, local (no communication): each group's per-parameter tensors are
        laid out as the flat, zero-padded vector of the group, and this rank keeps its slice
        ``[start, start + shard_numel)``; 0-d tensors and other values (Adam's ``step``) are kept once per
        group, so they must be equal over its parameters. ``states`` may come from an unsharded optimizer's
        ``state`` or from :meth:`full_state` under another N (a checkpoint saved on another DP layout). The
        parameters' own values are not touched (load them into the model; :meth:`step` reads them afresh).

        Args:
            states: parameter -> ``{state key: value}``; the tensors shaped like the parameter (any device: they
                are copied to the parameter's). A group none of whose parameters has a state is left without
                one (as before its first step).

        Raises:
            ValueError: within a group some parameters have a state and others not, their keys differ, a tensor
                does not have its parameter's shape, or their 0-d values (``step``) differ; the message names
                the parameter and the group.
        """
        for where, sh in enumerate(self.shards):
            if not sh.numel:
                continue
            given = [states.get(p) or {} for p in sh.params]
            if not any(given):
                self.inner.state.pop(sh.param, None)
                continue
            keys = set(given[0])
            for i, st in enumerate(given):
                if set(st) != keys:
                    raise ValueError(f"ZeroOneOptimizer.load_full_state: in param group {where}, parameter {i} "
                                     f"(shape {list(sh.params[i].shape)}) has state {sorted(st)} but parameter 0 has "
                                     f"{sorted(keys)}; a group's shard holds one state for all of its parameters")
            shard: dict[str, Any] = {}
            for key in sorted(keys):
                values = [st[key] for st in given]
                if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
                    for i, (v, p) in enumerate(zip(values, sh.params)):
                        if v.shape != p.shape:
                            raise ValueError(f"ZeroOneOptimizer.load_full_state: param group {where}, parameter {i}: "
                                             f"state {key!r} has shape {list(v.shape)}, the parameter "
                                             f"{list(p.shape)}; pass full (unsharded over DP) tensors")
                    moved = [v.to(device=p.device, dtype=p.dtype) for v, p in zip(values, sh.params)]
                    flat = _flat(moved, sh.params, sh.padded_numel)
                    shard[key] = flat[sh.start:sh.start + sh.shard_numel].clone()
                    continue
                first = values[0]
                same = all((torch.equal(v, first) if isinstance(v, torch.Tensor) and isinstance(first, torch.Tensor)
                            else v == first) for v in values)
                if not same:
                    raise ValueError(f"ZeroOneOptimizer.load_full_state: param group {where}'s parameters have "
                                     f"different {key!r} ({[v.item() if isinstance(v, torch.Tensor) else v for v in values][:4]}"
                                     "...); its shard keeps one value for the group: put such parameters in "
                                     "separate param groups")
                shard[key] = first.clone() if isinstance(first, torch.Tensor) else first
            self.inner.state[sh.param] = shard

    # ---- state ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: its shards' optimizer state, every group's options, and the sharding it belongs to.

        ZeRO-1's state is sharded, so each rank saves (and later loads) its own: ``{"state": {group index:
        the inner optimizer's state of that group's shard}, "param_groups": [options and parameter indices, as
        torch's optimizers write them], "zero": {"world_size", "group_rank", "numels"}}``.
        """
        inner = self.inner.state_dict()
        groups, index = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(index, index + len(g["params"])))})
            index += len(g["params"])
        return {"state": inner["state"], "param_groups": groups,
                "zero": {"world_size": self.n, "group_rank": self.group_rank,
                         "numels": [sh.numel for sh in self.shards]}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved on the same group rank of a group of the same size and layout.

        Raises:
            ValueError: not a ZeroOneOptimizer state dict, saved by another group rank or group size, or for
                other parameter groups (the message says which).
        """
        zero = state_dict.get("zero") if isinstance(state_dict, dict) else None
        if zero is None:
            raise ValueError("ZeroOneOptimizer.load_state_dict: this is not a ZeroOneOptimizer state dict (it has no "
                             "'zero' entry); an unsharded optimizer's state cannot be loaded into one shard")
        if (zero["world_size"], zero["group_rank"]) != (self.n, self.group_rank):
            raise ValueError(f"ZeroOneOptimizer.load_state_dict: saved by group rank {zero['group_rank']} of "
                             f"{zero['world_size']}, loaded on group rank {self.group_rank} of {self.n}; ZeRO-1's "
                             "state is sharded: each rank loads the state its own group rank saved, in a group of "
                             "the same size")
        mine = [sh.numel for sh in self.shards]
        if list(zero["numels"]) != mine or len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"ZeroOneOptimizer.load_state_dict: saved for param groups of {list(zero['numels'])} "
                             f"elements, this optimizer has {mine}; build it over the same parameter groups")
        saved_groups = state_dict["param_groups"]
        self.inner.load_state_dict({"state": state_dict["state"],
                                    "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]}
                                                     for i, g in enumerate(saved_groups)]})
        for g, saved in zip(self.param_groups, saved_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self.state = self.inner.state
