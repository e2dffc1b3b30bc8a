"""Sharded data parallelism: ZeRO-2 (gradients sharded), ZeRO-3 / FSDP (parameters sharded too), and HSDP.

Rajbhandari et al. 2020, "ZeRO" (SC'20), §5; PyTorch FSDP (Zhao et al. 2023, VLDB 16(12), §3) and FSDP2
(``torch/distributed/fsdp/_fully_shard/``). :class:`ShardedDataParallel` shards per *unit* (a submodule whose
parameters form one flat, zero-padded vector cut into N shards): stage 2 reduce-scatters each unit's
gradients when backward completes them and all-gathers the updated shards after the optimizer step; stage 3
keeps only the shard, all-gathering a unit before its forward and again before its backward (storage resized
in place, FSDP2's trick) with the next unit prefetched; HSDP (``replicate_group``) all-reduces each shard
across replicas. Collectives are torch's asynchronous ``all_gather_into_tensor`` / ``reduce_scatter_tensor``,
since a prefetch needs a handle that progresses while the autograd thread computes (commlab's ring is tested
equal to them). Stage 1 is :class:`ZeroOneOptimizer`. :func:`zero_memory_bytes` and
:func:`held_memory_bytes` count model-state bytes.

Book: chapter 12 (§12.1 memory, §12.2 communication, §12.3 FSDP's per-layer schedule).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from commlab import checks
from commlab.collectives.common import all_gather_single, group_size_and_rank, reduce_scatter_single
from commlab.collectives.agreement import agree, first_difference
from commlab.launch.device import group_device

__all__ = ["ShardedDataParallel", "ShardedStepStats", "zero_memory_bytes", "held_memory_bytes", "STAGES"]

#: The ZeRO stages :class:`ShardedDataParallel` runs (stage 1 is :class:`~commlab.parallel.ZeroOneOptimizer`).
STAGES = (2, 3)

#: ``record_function`` range names, read back by a profile of the step.
RANGE_ALL_GATHER = "sharded::all_gather::unit"      # + index: launching (or, unprefetched, doing) a unit's gather
RANGE_WAIT_GATHER = "sharded::wait_all_gather::unit"  # + index: waiting for it
RANGE_REDUCE_SCATTER = "sharded::reduce_scatter::unit"  # + index
RANGE_WAIT_REDUCE = "sharded::wait_reduce_scatter"   # the end of backward: waiting for every ReduceScatter
RANGE_ALL_REDUCE = "sharded::all_reduce::unit"        # + index: HSDP's AllReduce of a shard (synchronous)


@dataclasses.dataclass
class ShardedStepStats:
    """What one training step (forward, backward, and stage 2's parameter gather) communicated, on this rank.

    Attributes:
        all_gathers: unit AllGathers issued. prefetched: those launched ahead, by the previous unit's hook.
        reduce_scatters: unit ReduceScatters issued. all_reduces: replicate-group AllReduces (HSDP).
        all_gather_nbytes, reduce_scatter_nbytes, all_reduce_nbytes: bytes sent by this rank in each (ring
            model: ``(N-1)/N`` of the padded flat unit for the first two, ``2 (R-1)/R`` of the shard for the last).
    """

    all_gathers: int = 0
    prefetched: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    all_gather_nbytes: float = 0.0
    reduce_scatter_nbytes: float = 0.0
    all_reduce_nbytes: float = 0.0


class _Unit:
    """One wrapped module: its parameters' flat layout, this rank's shard, and the state of its collectives."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[nn.Parameter], names: list[str],
                 n: int, group_rank: int):
        self.index, self.name, self.module = index, name, module
        self.params, self.names = params, names
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        self.padded_numel = math.ceil(self.numel / n) * n   # every shard the same size, as AllGather needs
        self.shard_numel = self.padded_numel // n
        self.start = group_rank * self.shard_numel
        p0 = params[0]
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
            torch.cat([p.detach().reshape(-1) for p in params], out=flat[:self.numel])
            self.shard = nn.Parameter(flat[self.start:self.start + self.shard_numel].clone())
        self.unsharded = True
        self.gather: tuple[Any, torch.Tensor] | None = None    # (work, output) of a launched AllGather
        self.reduce: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (work, output shard, input flat)
        self.ready = 0              # gradients accumulated in this backward
        self.reduced = False        # its ReduceScatter was launched in this backward
        self.backward_gathered = False

    @property
    def nbytes(self) -> int:
        return self.padded_numel * self.shard.element_size()


def _check_stage(stage) -> int:
    return checks.one_of("stage", stage, STAGES, note="2: gradients and optimizer state sharded; 3: parameters "
                         "too; stage 1 is ZeroOneOptimizer")


def _ranks(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None or group is dist.group.WORLD \
        else dist.get_process_group_ranks(group)


class ShardedDataParallel(nn.Module):
    """ZeRO-2 or ZeRO-3 / FSDP (with HSDP) around ``module`` (book §12.3).

    Build the optimizer with :meth:`make_optimizer` (any element-wise ``torch.optim`` class; one over
    ``sdp.parameters()`` would find no gradients), then train as usual. Read the model with
    :meth:`full_parameters` and :meth:`full_gradients` (collective); under stage 3 checkpoint those, not
    ``state_dict()``. Gradients are averaged over every DP rank (``shard_group`` x ``replicate_group``) and
    accumulate over backwards; NaN/inf are reduced like any number. Every rank must run the same units in the
    same order (their collectives pair up); a backward that raises loses its gradients.

    Args:
        module: the model, on the group's device, equal on every rank; modified in place (stage 3 frees storage).
        stage: 2 or 3. shard_group: the group that shards (N = its size; None: the world).
        replicate_group: HSDP's group over which shards are replicated (e.g. a 2-D DeviceMesh's
            ``"dp_replicate"``); None: none.
        units: the submodules that are units, in forward order (default: ``module``'s children that hold
            parameters); every parameter that requires grad belongs to exactly one unit.
        prefetch: stage 3: launch the next unit's AllGather while the current one computes (default True).
        broadcast_from_rank0: broadcast the parameters from rank 0 of the groups first (default True).

    Attributes: ``units``, ``n``, ``group_rank``, ``replicas`` (1 without HSDP), ``last_step`` (ShardedStepStats).

    Raises:
        ValueError: a bad stage, no trainable parameter, parameters off the group's device, bad units, a
            replicate group sharing another rank with the shard group. RuntimeError: not initialised / not a member.
        CollectiveMismatchError: the ranks hold different models or units (on every rank).
    """

    def __init__(self, module: nn.Module, stage: int = 3, shard_group: dist.ProcessGroup | None = None,
                 replicate_group: dist.ProcessGroup | None = None, units: Sequence[nn.Module] | None = None,
                 prefetch: bool = True, broadcast_from_rank0: bool = True):
        super().__init__()
        self.n, self.group_rank = group_size_and_rank(shard_group, "ShardedDataParallel (shard_group)")
        self.replicas = 1
        if replicate_group is not None:
            self.replicas, _ = group_size_and_rank(replicate_group, "ShardedDataParallel (replicate_group)")
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.prefetch = bool(prefetch)
        problem: ValueError | None = None
        try:
            self._check_arguments(module, stage, units)
        except ValueError as exc:
            problem = exc
        # The arguments' verdict travels with the layout, so that a rank whose arguments are bad does not leave the
        # others waiting in the agreement: every rank raises (its own error if all agree, else the mismatch).
        layout = [("invalid arguments", str(problem))] if problem is not None else self._layout()
        advice = "build the same model, with the same units and stage, on every rank"
        for group in (shard_group, replicate_group) if replicate_group is not None else (shard_group,):
            agree("ShardedDataParallel", [tuple(r) for r in layout], group,
                  differ=lambda everyone: first_difference(everyone, "layouts", advice))
        if problem is not None:
            raise problem
        if broadcast_from_rank0:
            self._broadcast()
        self.last_step = ShardedStepStats()
        self._in_backward = False
        self._handles: list[Any] = []
        for u in self._units:
            for p in u.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(u)))
        if self.stage == 3:
            for u in self._units:
                self._handles.append(u.module.register_forward_pre_hook(self._pre_forward(u)))
                self._handles.append(u.module.register_forward_hook(self._post_forward(u)))
            for u in self._units:
                self._free(u)

    # ---- construction -------------------------------------------------------------------------------------

    def _check_arguments(self, module, stage, units) -> None:
        """Everything that can be wrong on this rank alone (ValueError); builds the units when nothing is."""
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.stage = _check_stage(stage)
        if self.replicate_group is not None:
            shared = sorted(set(_ranks(self.shard_group)) & set(_ranks(self.replicate_group)))
            if shared != [dist.get_rank()]:
                raise ValueError(f"ShardedDataParallel: shard_group {_ranks(self.shard_group)} and replicate_group "
                                 f"{_ranks(self.replicate_group)} share ranks {shared}; HSDP needs groups that meet in "
                                 "this rank only (the two dimensions of a mesh, e.g. init_device_mesh(..., (R, N)))")
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ShardedDataParallel: the module has no parameter with requires_grad=True: nothing to "
                             "shard")
        device = group_device(self.shard_group)
        wrong = [f"{n} on {p.device}" for n, p in named if p.device != device]
        if wrong:
            # NCCL moves only tensors on the rank's own GPU, gloo only CPU ones: anything else would fail inside
            # the first AllGather, with only the peers waiting.
            raise ValueError(f"ShardedDataParallel: the shard group's device is {device}, but "
                             f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}; move the model there first: "
                             "module.to(commlab.launch.group_device(group))")
        self._units = self._build_units(module, units, named)

    def _build_units(self, module, units, named) -> list[_Unit]:
        if units is None:
            units = [m for m in module.children() if any(p.requires_grad for p in m.parameters())]
        units = list(units)
        names_of = {id(m): name for name, m in module.named_modules()}
        owner: dict[int, int] = {}
        for i, m in enumerate(units):
            if id(m) not in names_of:
                raise ValueError(f"ShardedDataParallel: units[{i}] ({type(m).__name__}) is not a submodule of the "
                                 "wrapped module")
            for p in m.parameters():
                if p.requires_grad:
                    if id(p) in owner:
                        raise ValueError(f"ShardedDataParallel: units {owner[id(p)]} and {i} share a parameter; a "
                                         "parameter belongs to one unit (wrap the inner or the outer module, not both)")
                    owner[id(p)] = i
        outside = [n for n, p in named if id(p) not in owner]
        if outside:
            raise ValueError(f"ShardedDataParallel: parameters {outside[:4]}{' ...' if len(outside) > 4 else ''} "
                             "belong to no unit; pass units=[...] covering every module that holds parameters")
        built = []
        for i, m in enumerate(units):
            mine = [(n, p) for n, p in named if owner[id(p)] == i]
            if not mine:
                raise ValueError(f"ShardedDataParallel: units[{i}] ({names_of[id(m)]}) has no parameter that "
                                 "requires grad; leave it out of units")
            kinds = {(p.dtype, p.device) for _, p in mine}
            if len(kinds) > 1:
                raise ValueError(f"ShardedDataParallel: unit {names_of[id(m)]!r} mixes dtypes or devices "
                                 f"({sorted(f'{d}@{v}' for d, v in kinds)}); its flat shard needs one of each")
            with torch.no_grad():
                for _, p in mine:
                    # Each parameter its own storage, starting at 0, so that freeing it frees exactly its bytes.
                    own = p.data.untyped_storage().nbytes() == p.numel() * p.element_size()
                    if p.data.storage_offset() != 0 or not own or not p.data.is_contiguous():
                        p.data = p.data.clone(memory_format=torch.contiguous_format)
            built.append(_Unit(i, names_of[id(m)], m, [p for _, p in mine], [n for n, _ in mine], self.n,
                               self.group_rank))
        return built

    def _layout(self) -> list[tuple]:
        rows = [("stage", self.stage), ("units", len(self._units))]
        for u in self._units:
            rows += [(f"unit {u.index} ({u.name}): {n}", tuple(p.shape), str(p.dtype).replace("torch.", ""))
                     for n, p in zip(u.names, u.params)]
        return rows

    @torch.no_grad()
    def _broadcast(self) -> None:
        # Replicate group first, then shard group: every rank ends with the values of the rank that is rank 0 in
        # both (one broadcast per dimension of the mesh), as DDP's broadcast from rank 0 does for a flat group.
        groups = ([self.replicate_group] if self.replicate_group is not None else []) + [self.shard_group]
        for group in groups:
            if dist.get_world_size(group) == 1:
                continue
            src = _ranks(group)[0]
            for t in [p.data for u in self._units for p in u.params] + list(self.module.buffers()):
                dist.broadcast(t, src=src, group=group)
        for u in self._units:
            flat = torch.zeros(u.padded_numel, dtype=u.shard.dtype, device=u.shard.device)
            torch.cat([p.detach().reshape(-1) for p in u.params], out=flat[:u.numel])
            u.shard.data.copy_(flat[u.start:u.start + u.shard_numel])

    # ---- unshard / reshard ----------------------------------------------------------------------------------

    def _gather_start(self, u: _Unit, prefetch: bool = False) -> None:
        """Launch u's AllGather (async), unless it is gathered or on its way."""
        if u.unsharded or u.gather is not None:
            return
        with record_function(f"{RANGE_ALL_GATHER}{u.index}"):
            out = torch.empty(u.padded_numel, dtype=u.shard.dtype, device=u.shard.device)
            work = all_gather_single(out, u.shard.detach(), group=self.shard_group, async_op=True) \
                if self.n > 1 else None
            if work is None:
                out.copy_(u.shard.detach())
        u.gather = (work, out)
        s = self.last_step
        s.all_gathers += 1
        s.prefetched += int(prefetch)
        s.all_gather_nbytes += (self.n - 1) / self.n * u.nbytes

    @torch.no_grad()
    def _gather_finish(self, u: _Unit) -> None:
        """Wait for u's AllGather and write it into the parameters' (re-allocated) storage."""
        if u.unsharded:
            return
        self._gather_start(u)
        work, out = u.gather
        with record_function(f"{RANGE_WAIT_GATHER}{u.index}"):
            if work is not None:
                work.wait()
        for p, part in zip(u.params, torch.split(out[:u.numel], u.numels)):
            p.data.untyped_storage().resize_(p.numel() * p.element_size())
            p.data.copy_(part.view(p.shape))
        u.gather, u.unsharded = None, True

    @torch.no_grad()
    def _free(self, u: _Unit) -> None:
        """Stage 3: release the full parameters' storage (shapes stay; autograd's saved tensors see the next gather)."""
        if self.stage != 3 or not u.unsharded:
            return
        for p in u.params:
            p.data.untyped_storage().resize_(0)
        u.unsharded = False

    # ---- hooks ------------------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._in_backward:
            # The previous backward raised before its end-of-backward callback: its gradients are lost (each
            # rank's error has reached its caller); wait for what it launched and start clean.
            self._end_backward()
        self.last_step = ShardedStepStats()
        return self.module(*args, **kwargs)

    def _pre_forward(self, u: _Unit):
        def hook(module, args):
            self._gather_finish(u)
            if self.prefetch and u.index + 1 < len(self._units):
                self._gather_start(self._units[u.index + 1], prefetch=True)
        return hook

    def _post_forward(self, u: _Unit):
        def hook(module, args, output):
            self._free(u)
            if torch.is_grad_enabled():
                u.backward_gathered = False
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward(u))
            return output
        return hook

    def _pre_backward(self, u: _Unit):
        def hook(grad):
            self._start_backward()
            if not u.backward_gathered:
                u.backward_gathered = True
                self._gather_finish(u)
                if self.prefetch and u.index > 0:
                    self._gather_start(self._units[u.index - 1], prefetch=True)
            return grad
        return hook

    def _start_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _grad_hook(self, u: _Unit):
        def hook(param):
            self._start_backward()
            u.ready += 1
            if u.ready == len(u.params):
                self._reduce_start(u)
        return hook

    @torch.no_grad()
    def _reduce_start(self, u: _Unit) -> None:
        """Flatten u's gradients (None: zeros), free them, launch the ReduceScatter; stage 3 frees u again."""
        if u.reduced:
            return
        with record_function(f"{RANGE_REDUCE_SCATTER}{u.index}"):
            flat = torch.zeros(u.padded_numel, dtype=u.shard.dtype, device=u.shard.device)
            for p, part in zip(u.params, torch.split(flat[:u.numel], u.numels)):
                if p.grad is not None:
                    part.copy_(p.grad.reshape(-1))
                p.grad = None   # the full gradient is freed: only the shard's survives (ZeRO-2's P_g)
            out = torch.empty(u.shard_numel, dtype=flat.dtype, device=flat.device)
            if self.n > 1:
                work = reduce_scatter_single(out, flat, group=self.shard_group, async_op=True)
            else:
                work = None
                out.copy_(flat)
        u.reduce, u.reduced = (work, out, flat), True
        self.last_step.reduce_scatters += 1
        self.last_step.reduce_scatter_nbytes += (self.n - 1) / self.n * u.nbytes
        self._free(u)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End of backward (an autograd engine callback): reduce what no hook reduced, wait, set the shards' grads."""
        try:
            for u in self._units:   # a unit whose gradients never all arrived (unused): zeros for the missing
                self._reduce_start(u)
            total = self.n * self.replicas
            with record_function(RANGE_WAIT_REDUCE):
                for u in self._units:
                    work, out, _ = u.reduce
                    if work is not None:
                        work.wait()
                    if self.replicate_group is not None and self.replicas > 1:
                        with record_function(f"{RANGE_ALL_REDUCE}{u.index}"):
                            dist.all_reduce(out, group=self.replicate_group)
                        self.last_step.all_reduces += 1
                        self.last_step.all_reduce_nbytes += 2 * (self.replicas - 1) / self.replicas * \
                            out.numel() * out.element_size()
                    out.div_(total)
                    u.shard.grad = out if u.shard.grad is None else u.shard.grad.add_(out)
                    # Consumed: never wait on it again. gloo runs reduce_scatter_tensor as an AllReduce whose
                    # wait() copies this rank's chunk into ``out`` each time it is called (torch 2.13), which
                    # would overwrite the average with the sum.
                    u.reduce = None
        finally:
            self._end_backward()

    @torch.no_grad()
    def _end_backward(self) -> None:
        """Leave every unit sharded with nothing in flight (after a backward, or one that raised)."""
        for u in self._units:
            if u.reduce is not None and u.reduce[0] is not None:
                u.reduce[0].wait()       # launched but never consumed (the backward raised): let it finish
            # backward_gathered too: a second backward of an earlier forward (two micro-batches forwarded
            # before either backward) must gather the units again, which this backward freed.
            u.reduce, u.reduced, u.ready, u.backward_gathered = None, False, 0, False
            if u.gather is not None:   # a prefetch nobody used: wait for it so that nothing is left in flight
                self._gather_finish(u)
            self._free(u)
        self._in_backward = False

    # ---- the optimizer and the step ---------------------------------------------------------------------------

    def shard_parameters(self) -> list[nn.Parameter]:
        """This rank's shards, one flat 1-D parameter of ``padded_numel / N`` elements per unit: what to optimise."""
        return [u.shard for u in self._units]

    def make_optimizer(self, optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_cls(self.shard_parameters(), **kwargs)``; under stage 2 with a step-post hook that AllGathers
        the updated shards into the model's parameters (stage 3 gathers them at the next forward).

        The optimizer must be element-wise (SGD, Adam, AdamW): its state then has the shard's size, 1/N of the
        model's (ZeRO's P_os); clipping by the global norm inside it, or LAMB, would need the whole gradient.

        Raises:
            ValueError: ``optimizer_cls`` is not a ``torch.optim.Optimizer`` subclass.
        """
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer subclass (e.g. torch.optim.Adam), "
                             f"got {optimizer_cls!r}")
        opt = optimizer_cls(self.shard_parameters(), **kwargs)
        if self.stage == 2:
            opt.register_step_post_hook(lambda *_: self.gather_parameters())
        return opt

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Stage 2: AllGather every unit's shard into the model's parameters (collective over ``shard_group``)."""
        if self.stage != 2:
            return
        for u in self._units:   # the parameters are whole but stale: mark them so, and launch every gather at once
            u.unsharded = False
            self._gather_start(u)
        for u in self._units:
            self._gather_finish(u)

    @torch.no_grad()
    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter, unsharded, as new tensors in ``module.named_parameters()`` order (requires-grad ones).

        Collective over ``shard_group``: one AllGather per unit (not counted in :attr:`last_step`).
        """
        return self._gather_all([u.shard.detach() for u in self._units])

    @torch.no_grad()
    def full_gradients(self) -> list[torch.Tensor | None]:
        """Every parameter's averaged gradient, unsharded (as DDP's ``p.grad``), in the order of
        :meth:`full_parameters`; None for all before any backward. Collective over ``shard_group``."""
        if all(u.shard.grad is None for u in self._units):
            return [None] * sum(len(u.params) for u in self._units)
        return self._gather_all([u.shard.grad if u.shard.grad is not None else torch.zeros_like(u.shard)
                                 for u in self._units])

    def _gather_all(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        by_param: dict[int, torch.Tensor] = {}
        for u, shard in zip(self._units, shards):
            out = torch.empty(u.padded_numel, dtype=shard.dtype, device=shard.device)
            if self.n > 1:
                all_gather_single(out, shard.contiguous(), group=self.shard_group)
            else:
                out.copy_(shard)
            for p, part in zip(u.params, torch.split(out[:u.numel], u.numels)):
                by_param[id(p)] = part.view(p.shape).clone()
        return [by_param[id(p)] for p in self.module.parameters() if id(p) in by_param]

    def named_units(self) -> list[tuple[str, nn.Module]]:
        """``(name in the module, module)`` of each unit, in order."""
        return [(u.name, u.module) for u in self._units]

    @property
    def units(self) -> list[nn.Module]:
        return [u.module for u in self._units]

    def held_nbytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds now, measured by :func:`held_memory_bytes`: under stage 3 the shards are the
        parameters (the module's own are freed outside their windows); under stage 2 the module's parameters are
        whole and the shards are the optimizer's master copy."""
        params = list(self.module.parameters())
        return held_memory_bytes(params + self.shard_parameters() if self.stage == 3 else params, optimizer)


def zero_memory_bytes(stage: int, numel: int, n: int, param_bytes: float = 2, grad_bytes: float = 2,
                      optimizer_bytes: float = 12) -> dict[str, float]:
    """Model-state bytes per rank under ZeRO stage 0-3 (Rajbhandari et al. 2020, §5 and Figure 1; book §12.1).

    With Ψ = ``numel`` parameters, N = ``n`` ranks and K = ``optimizer_bytes`` per parameter: stage 0 holds
    ``(P + G + K) Ψ``; stage 1 ``(P + G) Ψ + K Ψ / N``; stage 2 ``P Ψ + (G + K) Ψ / N``; stage 3
    ``(P + G + K) Ψ / N``; defaults P = G = 2, K = 12 (mixed-precision Adam). K counts everything the optimizer
    holds per parameter, a master copy included (Adam in float64: 8 + 16 under ZeRO-1/2, 16 under ZeRO-3,
    whose shard is the parameter). Activations, temporary buffers and the shards' padding are not counted. The
    planner's :func:`commlab.parallel.planner.memory.model_state_bytes_per_param` is the same rule per parameter.

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes (floats: Ψ/N need not be whole).

    Raises:
        ValueError: a stage outside 0-3, ``numel`` not an int >= 0, ``n`` not an int >= 1, or a byte count that
            is not a finite number >= 0.
    """
    checks.one_of("stage", stage, (0, 1, 2, 3), note="ZeRO stage")
    checks.integer("numel", numel, least=0, note="parameters")
    checks.integer("n", n, note="data-parallel ranks")
    for name, v in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes), ("optimizer_bytes", optimizer_bytes)):
        checks.number(name, v, least=0, note="bytes per parameter")
    params = param_bytes * numel / (n if stage >= 3 else 1)
    grads = grad_bytes * numel / (n if stage >= 2 else 1)
    optimizer = optimizer_bytes * numel / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def held_memory_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for model state, measured: the storage actually allocated, not the shapes.

    * ``params``: the storages of ``params`` (a ZeRO-3 parameter outside its gather window has 0 bytes);
    * ``grads``: the storages of their ``.grad`` and of the optimizer's parameters' ``.grad``;
    * ``optimizer``: the optimizer's parameters that are not in ``params`` (a master copy of the shard, as
      ZeRO-1 and ZeRO-2 keep), and its state tensors of one or more dimensions (Adam's moments; the 0-d ``step``
      counters, a few bytes per tensor, are left out, as the formulas of :func:`zero_memory_bytes` leave them).

    Each storage counts once (views of one buffer are not counted twice).

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes.
    """
    seen: set[int] = set()

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()

    params = list(params)
    mine = {id(p) for p in params}
    opt_params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    held_params = sum(nbytes(p) for p in params)
    grads = sum(nbytes(p.grad) for p in params) + sum(nbytes(p.grad) for p in opt_params if id(p) not in mine)
    opt = sum(nbytes(p) for p in opt_params if id(p) not in mine)
    if optimizer is not None:
        opt += sum(nbytes(t) for st in optimizer.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"params": held_params, "grads": grads, "optimizer": opt, "total": held_params + grads + opt}
