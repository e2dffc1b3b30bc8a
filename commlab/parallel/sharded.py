"""Sharded data parallelism as FSDP2 does it: ZeRO-2, ZeRO-3 / FSDP and HSDP, with per-parameter dim-0 shards.

:class:`ShardedDataParallel` replaces each parameter of the module by its *shard*: rows ``[r c, (r + 1) c)`` of
dim 0 on rank r, ``c = ceil(d0 / N)`` (``torch.chunk``, as FSDP2), so ``model.parameters()`` are the shards and
any optimizer built on them steps them. A *unit* (a submodule) AllGathers its parameters' padded shards before
its forward (ZeRO-3: again before its backward) and reduce-scatters their gradients when backward completes
them; HSDP (``replicate_group``) then all-reduces the shards' gradients across replicas.
:class:`MixedPrecisionPolicy`: ``param_dtype`` for the AllGather and the compute, ``reduce_dtype`` for the
ReduceScatter. :func:`sharded_step_nbytes` prices a step's bytes; :func:`zero_memory_bytes` and
:func:`held_memory_bytes` count model-state bytes. Sources: Rajbhandari et al. 2020 (ZeRO), §5; torch's
``torch/distributed/fsdp/_fully_shard/``.

Book: chapter 12 (§12.1 memory, §12.2 communication, §12.3 FSDP2's per-parameter shards and schedule).
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
from torch.utils._pytree import tree_flatten, tree_map

from commlab import checks
from commlab.collectives.agreement import agree, first_difference
from commlab.collectives.common import all_gather_single, group_size_and_rank, reduce_scatter_single
from commlab.launch.device import group_device

__all__ = ["ShardedDataParallel", "ShardedStepStats", "MixedPrecisionPolicy", "sharded_step_nbytes",
           "dim0_shard_rows", "gradient_divide_factors", "zero_memory_bytes", "held_memory_bytes", "STAGES"]

#: The ZeRO stages :class:`ShardedDataParallel` runs (stage 1 is :class:`~commlab.parallel.ZeroOneOptimizer`).
STAGES = (2, 3)

#: ``record_function`` range names, read back by a profile of the step.
RANGE_ALL_GATHER = "sharded::all_gather::unit"      # + index: launching (or, unprefetched, doing) a unit's gather
RANGE_WAIT_GATHER = "sharded::wait_all_gather::unit"  # + index: waiting for it
RANGE_REDUCE_SCATTER = "sharded::reduce_scatter::unit"  # + index
RANGE_WAIT_REDUCE = "sharded::wait_reduce_scatter"   # the end of backward: waiting for every ReduceScatter
RANGE_ALL_REDUCE = "sharded::all_reduce::unit"        # + index: HSDP's AllReduce of a shard (synchronous)


def _check_dtype(name: str, dtype) -> torch.dtype | None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        checks.fail(name, dtype, "a floating-point torch.dtype (torch.bfloat16, torch.float16, torch.float32, "
                    "torch.float64) or None", where="MixedPrecisionPolicy")
    return dtype


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision (``torch.distributed.fsdp.MixedPrecisionPolicy``), the two dtypes that move bytes.

    Attributes:
        param_dtype: dtype of the AllGather and of the unsharded parameters, hence of the forward and backward
            compute (floating inputs of each unit are cast to it); None: the parameters' own.
        reduce_dtype: dtype of the gradients' ReduceScatter (and HSDP's AllReduce); None: ``param_dtype``. A
            float16 reduction divides by about sqrt(N) before and after it (:func:`gradient_divide_factors`).
    The shards, their gradients and the optimizer stay in the parameters' own dtype.

    Raises:
        ValueError: a dtype that is not a floating-point ``torch.dtype`` (nor None).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self):
        _check_dtype("param_dtype", self.param_dtype)
        _check_dtype("reduce_dtype", self.reduce_dtype)

    @classmethod
    def of(cls, policy) -> "MixedPrecisionPolicy":
        """``policy`` as this class: None (no mixed precision), this class, or torch's ``MixedPrecisionPolicy``
        with ``output_dtype=None`` and ``cast_forward_inputs=True`` (the two options not modelled here).

        Raises:
            ValueError: another type, a torch policy using the options not modelled, or a bad dtype.
        """
        if policy is None:
            return cls()
        if isinstance(policy, cls):
            return policy
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        if not isinstance(policy, TorchPolicy):
            checks.fail("mp_policy", policy, "None, a commlab.parallel.sharded.MixedPrecisionPolicy or a "
                        "torch.distributed.fsdp.MixedPrecisionPolicy", where="ShardedDataParallel")
        if policy.output_dtype is not None or not policy.cast_forward_inputs:
            checks.fail("mp_policy", policy, "a policy with output_dtype=None and cast_forward_inputs=True",
                        note="the other options of FSDP2's policy are not modelled", where="ShardedDataParallel")
        return cls(policy.param_dtype, policy.reduce_dtype)


def dim0_shard_rows(d0: int, n: int, rank: int) -> tuple[int, int, int]:
    """``(start, rows, padded_rows)`` of rank ``rank``'s dim-0 shard of a parameter of ``d0`` rows over ``n`` ranks.

    FSDP2's rule (``_chunk_with_empty`` and ``_get_dim0_padded_size`` in ``_fully_shard/_fsdp_common.py``):
    ``torch.chunk`` on dim 0, chunks of ``c = ceil(d0 / n)`` rows, the last ones shorter or empty; every rank's
    AllGather input is padded at the end to ``c`` rows, so the gathered tensor has ``n c >= d0`` rows.
    """
    c = -(-d0 // n)
    start = min(rank * c, d0)
    return start, min(d0, start + c) - start, c


@dataclasses.dataclass
class ShardedStepStats:
    """What one training step (forward and backward) communicated, on this rank.

    Attributes:
        all_gathers: unit AllGathers issued. prefetched: those launched ahead, by the previous unit's hook.
        reduce_scatters: unit ReduceScatters issued. all_reduces: replicate-group AllReduces (HSDP).
        all_gather_nbytes, reduce_scatter_nbytes, all_reduce_nbytes: bytes sent by this rank in each (ring
            model: ``(N-1)/N`` of the gathered padded unit, in ``param_dtype``, for the AllGather, of the
            padded gradients, in ``reduce_dtype``, for the ReduceScatter; ``2 (R-1)/R`` of the shard for the last).
    """

    all_gathers: int = 0
    prefetched: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    all_gather_nbytes: float = 0.0
    reduce_scatter_nbytes: float = 0.0
    all_reduce_nbytes: float = 0.0


def sharded_step_nbytes(shapes: Sequence[Sequence[int]], n: int, stage: int = 3,
                        param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype | None = None,
                        replicas: int = 1) -> dict[str, float]:
    """Bytes one rank sends in a training step of :class:`ShardedDataParallel` (ring model; book §12.3).

    Each parameter of shape ``(d0, ...)`` is padded to ``N ceil(d0 / N)`` rows (:func:`dim0_shard_rows`); with
    P its padded elements summed over ``shapes``: AllGather ``k (N-1)/N P`` elements of ``param_dtype`` (k = 2
    under ZeRO-3: forward and backward; 1 under ZeRO-2), ReduceScatter ``(N-1)/N P`` of ``reduce_dtype`` (None:
    ``param_dtype``), HSDP's AllReduce ``2 (R-1)/R P/N`` of ``reduce_dtype``. What :class:`ShardedStepStats`
    counts for one forward and backward, every parameter trainable and given a gradient.

    Returns:
        ``{"all_gather", "reduce_scatter", "all_reduce", "total"}`` in bytes.

    Raises:
        ValueError: a shape with no dim 0 or a negative size, n or replicas not an int >= 1, a bad stage or dtype.
    """
    n = checks.integer("n", n, note="ranks of the shard group")
    replicas = checks.integer("replicas", replicas, note="ranks of the replicate group (HSDP); 1: none")
    stage = _check_stage(stage)
    policy = MixedPrecisionPolicy(param_dtype, reduce_dtype)
    if param_dtype is None:
        checks.fail("param_dtype", param_dtype, "a floating-point torch.dtype", where="sharded_step_nbytes")
    padded = 0
    for shape in shapes:
        shape = tuple(shape)
        if not shape or not all(checks.is_int(s) and s >= 0 for s in shape):
            checks.fail("shapes", shape, "a tuple of sizes >= 0 with a dim 0", where="sharded_step_nbytes")
        padded += n * dim0_shard_rows(shape[0], n, 0)[2] * math.prod(shape[1:])
    ag, rs = param_dtype.itemsize, (policy.reduce_dtype or param_dtype).itemsize
    out = {"all_gather": (2 if stage == 3 else 1) * (n - 1) / n * padded * ag,
           "reduce_scatter": (n - 1) / n * padded * rs,
           "all_reduce": 2 * (replicas - 1) / replicas * padded / n * rs}
    out["total"] = sum(out.values())
    return out


class _Param:
    """One parameter: where it lives in the module, its dim-0 shard (a Parameter registered in its place) and the
    unsharded tensor the forward computes with (the original Parameter, in ``param_dtype``)."""

    def __init__(self, fqn: str, places: list[tuple[nn.Module, str]], p: nn.Parameter):
        self.fqn, self.places, self.unsharded = fqn, places, p
        self.shape, self.orig_dtype, self.requires_grad = p.shape, p.dtype, p.requires_grad
        self.rest = math.prod(p.shape[1:])
        self.shard: nn.Parameter | None = None
        self.padded: torch.Tensor | None = None   # the shard's storage: c rows, the shard its first `rows`

    def make_shard(self, n: int, group_rank: int, compute_dtype: torch.dtype, keep: bool) -> None:
        start, self.rows, self.c = dim0_shard_rows(self.shape[0], n, group_rank)
        self.padded_numel = self.c * self.rest
        p = self.unsharded
        with torch.no_grad():
            self.padded = p.new_zeros((self.c, *self.shape[1:]))
            self.padded[:self.rows].copy_(p[start:start + self.rows])
            self.shard = nn.Parameter(self.padded[:self.rows], requires_grad=self.requires_grad)
            # The unsharded Parameter now holds the compute copy: whole under ZeRO-2, freed under ZeRO-3.
            p.data = p.detach().to(compute_dtype, copy=True, memory_format=torch.contiguous_format)
            if not keep:
                p.data.untyped_storage().resize_(0)
        self.register(self.shard)

    def register(self, t: nn.Parameter) -> None:
        for module, attr in self.places:  # as FSDP2's unsafe_setattr_param: no checks, no hooks
            module._parameters[attr] = t


class _Unit:
    """One wrapped module: its parameters, the sizes of its AllGather and ReduceScatter, and their state."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[_Param]):
        self.index, self.name, self.module, self.params = index, name, module, params
        self.trainable = [sp for sp in params if sp.requires_grad]
        # The unsharded parameters hold the shards' values (ZeRO-3: are allocated); ZeRO-2 sets it False after each
        # forward, its copy kept whole for the backward, so that the next forward gathers the shards again.
        self.unsharded = True
        self.gather: tuple[Any, torch.Tensor] | None = None    # (work, output) of a launched AllGather
        self.reduce: tuple[Any, torch.Tensor, torch.Tensor, list[_Param]] | None = None  # work, out, in, params
        self.ready = 0              # gradients accumulated in this backward
        self.reduced = False        # its ReduceScatter was launched in this backward
        self.backward_gathered = False


def gradient_divide_factors(ranks: int, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """``(pre, post)``: a gradient is divided by ``pre`` before the ReduceScatter (and HSDP's AllReduce) of its sum
    over ``ranks`` data-parallel ranks and by ``post`` after, ``pre * post == ranks``, for the average.

    FSDP2's rule (``_get_gradient_divide_factors`` in ``_fully_shard/_fsdp_collectives.py``, torch 2.13): float32
    and bfloat16 have the range to sum first (pre = 1, post = N); other dtypes (float16) would overflow or
    underflow, so pre is the smallest power of 2 dividing N with ``N / pre <= pre`` (about sqrt(N)), post ``N / pre``.
    """
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0, float(ranks)
    pre = 1
    while ranks % pre == 0 and ranks / pre > pre:
        pre *= 2
    return float(pre), ranks / pre


def _check_stage(stage) -> int:
    return checks.one_of("stage", stage, STAGES, note="2: gradients and optimizer state sharded; 3: parameters "
                         "too; stage 1 is ZeroOneOptimizer")


def _ranks(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None or group is dist.group.WORLD \
        else dist.get_process_group_ranks(group)


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "")


class ShardedDataParallel(nn.Module):
    """ZeRO-2 or ZeRO-3 / FSDP2 (with HSDP) around ``module`` (book §12.3), used as ``fully_shard`` is.

    After wrapping, ``module``'s parameters are this rank's dim-0 shards (:func:`dim0_shard_rows`): build the
    optimizer on ``sdp.parameters()`` and train as usual; backward leaves each shard's ``.grad`` the average over
    every DP rank of its rows. Clip with :meth:`clip_grad_norm_` (the global norm); read the whole model with
    :meth:`full_parameters`. As under ``fully_shard``: every rank runs the same units in the same order, and
    gives gradients to the same parameters (one that gets none is left out of the ReduceScatter, its ``.grad``
    stays None); chapter 12 §12.3 lists what differs from FSDP2 (plain-tensor shards, not DTensors).

    Args:
        module: the model, equal on every rank; modified in place. stage: 3 (``reshard_after_forward=True``)
            or 2 (kept whole after the forward; gathered again in every forward). shard_group: the group that
            shards (None: the world); replicate_group: HSDP's replica group (None: none). units: the submodules
            that are units, in forward order (default: the children holding parameters). prefetch: gather the
            next unit while this one computes. broadcast_from_rank0: broadcast the parameters first.
            mp_policy: :class:`MixedPrecisionPolicy` or torch's (None: the parameters' dtype throughout).

    Attributes: ``units``, ``n``, ``group_rank``, ``replicas`` (1 without HSDP), ``mp_policy``, ``last_step``.

    Raises:
        ValueError: a bad stage, policy or units, no trainable parameter, a 0-dim parameter, parameters off the
            group's device, a replicate group sharing a rank with the shard group.
        RuntimeError: not initialised / not a member.
        CollectiveMismatchError: the ranks hold different parameters, buffers, units or policies (on every rank).
    """

    def __init__(self, module: nn.Module, stage: int = 3, shard_group: dist.ProcessGroup | None = None,
                 replicate_group: dist.ProcessGroup | None = None, units: Sequence[nn.Module] | None = None,
                 prefetch: bool = True, broadcast_from_rank0: bool = True,
                 mp_policy: MixedPrecisionPolicy | Any | None = None):
        super().__init__()
        self.n, self.group_rank = group_size_and_rank(shard_group, "ShardedDataParallel (shard_group)")
        self.replicas = 1
        if replicate_group is not None:
            self.replicas, _ = group_size_and_rank(replicate_group, "ShardedDataParallel (replicate_group)")
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.prefetch = bool(prefetch)
        problem: ValueError | None = None
        try:
            self._check_arguments(module, stage, units, mp_policy)
        except ValueError as exc:
            problem = exc
        # The arguments' verdict travels with the layout, so that a rank whose arguments are bad does not leave the
        # others waiting in the agreement: every rank raises (its own error if all agree, else the mismatch).
        layout = [("invalid arguments", str(problem))] if problem is not None else self._layout()
        advice = "build the same model, with the same units, stage and policy, on every rank"
        for group in (shard_group, replicate_group) if replicate_group is not None else (shard_group,):
            agree("ShardedDataParallel", [tuple(r) for r in layout], group,
                  differ=lambda everyone: first_difference(everyone, "layouts", advice))
        if problem is not None:
            raise problem
        if broadcast_from_rank0:
            self._broadcast()
        for u in self._units:
            compute = self._compute_dtype(u)
            for sp in u.params:
                sp.make_shard(self.n, self.group_rank, compute, keep=self.stage == 2)
            u.unsharded = False
        self.last_step = ShardedStepStats()
        self._in_backward = False
        self._handles: list[Any] = []
        for u in self._units:
            for sp in u.trainable:
                self._handles.append(sp.unsharded.register_post_accumulate_grad_hook(self._grad_hook(u)))
            self._handles.append(u.module.register_forward_pre_hook(self._pre_forward(u)))
            self._handles.append(u.module.register_forward_hook(self._post_forward(u)))

    # ---- construction -------------------------------------------------------------------------------------

    def _check_arguments(self, module, stage, units, mp_policy) -> None:
        """Everything that can be wrong on this rank alone (ValueError); builds the units when nothing is."""
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.stage = _check_stage(stage)
        self.mp_policy = MixedPrecisionPolicy.of(mp_policy)
        if self.replicate_group is not None:
            shared = sorted(set(_ranks(self.shard_group)) & set(_ranks(self.replicate_group)))
            if shared != [dist.get_rank()]:
                raise ValueError(f"ShardedDataParallel: shard_group {_ranks(self.shard_group)} and replicate_group "
                                 f"{_ranks(self.replicate_group)} share ranks {shared}; HSDP needs groups that meet in "
                                 "this rank only (the two dimensions of a mesh, e.g. init_device_mesh(..., (R, N)))")
        self.module = module
        named = list(module.named_parameters())
        if not any(p.requires_grad for _, p in named):
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
        scalars = [n for n, p in named if p.dim() == 0]
        if scalars:
            raise ValueError(f"ShardedDataParallel: parameters {scalars[:4]} have no dim 0 to shard (0-dim); make "
                             "them 1-element tensors (shape (1,))")
        self._units = self._build_units(module, units, named)
        by_fqn = {sp.fqn: sp for u in self._units for sp in u.params}
        self._ordered = [by_fqn[n] for n, _ in named]   # module.named_parameters() order, whatever is registered now

    def _build_units(self, module, units, named) -> list[_Unit]:
        if units is None:
            units = [m for m in module.children() if any(True for _ in m.parameters())]
        units = list(units)
        names_of = {id(m): name for name, m in module.named_modules()}
        owner: dict[int, int] = {}
        for i, m in enumerate(units):
            if id(m) not in names_of:
                raise ValueError(f"ShardedDataParallel: units[{i}] ({type(m).__name__}) is not a submodule of the "
                                 "wrapped module")
            for p in m.parameters():
                if id(p) in owner and owner[id(p)] != i:
                    raise ValueError(self._shared_message(module, units, names_of, owner[id(p)], i, p))
                owner[id(p)] = i
        outside = [n for n, p in named if id(p) not in owner]
        if outside:
            raise ValueError(f"ShardedDataParallel: parameters {outside[:4]}{' ...' if len(outside) > 4 else ''} "
                             "belong to no unit; pass units=[...] covering every module that holds parameters")
        places: dict[int, list[tuple[nn.Module, str]]] = {}   # every (module, attribute) of a parameter (tied too)
        for fqn, p in module.named_parameters(remove_duplicate=False):
            prefix, _, attr = fqn.rpartition(".")
            places.setdefault(id(p), []).append((module.get_submodule(prefix), attr))
        built = []
        for i, m in enumerate(units):
            mine = [(n, p) for n, p in named if owner[id(p)] == i]
            if not mine:
                raise ValueError(f"ShardedDataParallel: units[{i}] ({names_of[id(m)]}) has no parameter; leave it "
                                 "out of units")
            kinds = {(p.dtype, p.device) for _, p in mine}
            if len(kinds) > 1:
                raise ValueError(f"ShardedDataParallel: unit {names_of[id(m)]!r} mixes dtypes or devices "
                                 f"({sorted(f'{d}@{v}' for d, v in kinds)}); its AllGather needs one of each")
            built.append(_Unit(i, names_of[id(m)], m, [_Param(n, places[id(p)], p) for n, p in mine]))
        return built

    @staticmethod
    def _shared_message(module, units, names_of, i: int, j: int, p: nn.Parameter) -> str:
        """Why units i and j may not both hold ``p``: nested units, or a parameter tied across two units."""
        a, b = (names_of[id(units[k])] for k in (i, j))
        names = [n for n, q in module.named_parameters(remove_duplicate=False) if q is p]
        nested = any(m is units[j] for m in units[i].modules()) or any(m is units[i] for m in units[j].modules())
        if nested:
            return (f"ShardedDataParallel: units {i} ({a or 'the module'}) and {j} ({b or 'the module'}) are nested "
                    f"and both hold {names[0]!r}; a parameter belongs to one unit (wrap the inner or the outer "
                    "module, not both)")
        return (f"ShardedDataParallel: parameter {names[0]!r} is shared (tied) with {names[1:]} across units {i} "
                f"({a}) and {j} ({b}); shared/tied parameters must be in the same unit, as fully_shard requires: "
                "pass units=[...] in which one module holds every use of it (a common parent, e.g. the wrapped "
                "module itself, units=[module]) and the modules under it are not units of their own")

    def _layout(self) -> list[tuple]:
        rows = [("stage", self.stage, "mp_policy", _name(self.mp_policy.param_dtype),
                 _name(self.mp_policy.reduce_dtype)), ("units", len(self._units))]
        for u in self._units:
            rows += [(f"unit {u.index} ({u.name}): {sp.fqn}{'' if sp.requires_grad else ' (frozen)'}",
                      tuple(sp.shape), _name(sp.orig_dtype)) for sp in u.params]
        # The buffers are broadcast too (_broadcast): ranks whose buffers differ in number, shape or dtype would
        # wait in, or silently mis-pair, those broadcasts.
        rows += [(f"buffer {name}", tuple(b.shape), _name(b.dtype)) for name, b in self.module.named_buffers()]
        return rows

    def _compute_dtype(self, u: _Unit) -> torch.dtype:
        return self.mp_policy.param_dtype or u.params[0].orig_dtype

    def _reduce_dtype(self, u: _Unit) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self._compute_dtype(u)

    @torch.no_grad()
    def _broadcast(self) -> None:
        # Replicate group first, then shard group: every rank ends with the values of the rank that is rank 0 in
        # both (one broadcast per dimension of the mesh), as DDP's broadcast from rank 0 does for a flat group.
        groups = ([self.replicate_group] if self.replicate_group is not None else []) + [self.shard_group]
        for group in groups:
            if dist.get_world_size(group) == 1:
                continue
            src = _ranks(group)[0]
            for t in [sp.unsharded.data for u in self._units for sp in u.params] + list(self.module.buffers()):
                dist.broadcast(t, src=src, group=group)

    # ---- unshard / reshard ----------------------------------------------------------------------------------

    def _needs_gather(self, u: _Unit) -> bool:
        return not u.unsharded

    @torch.no_grad()
    def _gather_start(self, u: _Unit, prefetch: bool = False) -> None:
        """Launch u's AllGather (async) of its parameters' padded shards, cast to param_dtype, unless the unsharded
        parameters hold their values (ZeRO-2: only until the end of u's forward) or the gather is on its way."""
        if u.gather is not None or not self._needs_gather(u):
            return
        dtype = self._compute_dtype(u)
        with record_function(f"{RANGE_ALL_GATHER}{u.index}"):
            inp = torch.cat([sp.padded.reshape(-1).to(dtype) for sp in u.params])
            out = torch.empty(self.n * inp.numel(), dtype=dtype, device=inp.device)
            work = all_gather_single(out, inp, group=self.shard_group, async_op=True) if self.n > 1 else None
            if work is None:
                out.copy_(inp)
        u.gather = (work, out)
        s = self.last_step
        s.all_gathers += 1
        s.prefetched += int(prefetch)
        s.all_gather_nbytes += (self.n - 1) * inp.numel() * inp.element_size()

    @torch.no_grad()
    def _gather_finish(self, u: _Unit) -> None:
        """Wait for u's AllGather and write it into the unsharded parameters' (re-allocated) storage."""
        if u.gather is None and not self._needs_gather(u):
            return
        self._gather_start(u)
        work, out = u.gather
        with record_function(f"{RANGE_WAIT_GATHER}{u.index}"):
            if work is not None:
                work.wait()
        for sp, whole in self._unpadded(u, out):
            p = sp.unsharded.data
            p.untyped_storage().resize_(p.numel() * p.element_size())
            p.copy_(whole)
        u.gather, u.unsharded = None, True

    def _unpadded(self, u: _Unit, out: torch.Tensor):
        """``(param, its whole tensor)`` from a unit's AllGather output: N blocks (one per rank) of the
        parameters' padded shards side by side, FSDP2's layout; each parameter's N c rows cut to its d0."""
        per_rank, offset = out.view(self.n, -1), 0
        for sp in u.params:
            whole = per_rank[:, offset:offset + sp.padded_numel].reshape(self.n * sp.c, *sp.shape[1:])
            yield sp, whole[:sp.shape[0]]
            offset += sp.padded_numel

    @torch.no_grad()
    def _free(self, u: _Unit) -> None:
        """ZeRO-3: release the unsharded parameters' storage (shapes stay; autograd's saved tensors see the next
        gather)."""
        if self.stage != 3 or not u.unsharded:
            return
        for sp in u.params:
            sp.unsharded.data.untyped_storage().resize_(0)
        u.unsharded = False

    # ---- hooks ------------------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._in_backward:
            # The previous backward raised before its end-of-backward callback: its gradients are lost (each
            # rank's error has reached its caller); wait for what it launched and start clean.
            self._end_backward()
        for u in self._units:   # prefetches of an earlier forward without backward (under no_grad, say)
            self._drop_gather(u)
        self.last_step = ShardedStepStats()
        args, kwargs = self._cast_inputs((args, kwargs))
        return self.module(*args, **kwargs)

    def _cast_inputs(self, inputs):
        dtype = self.mp_policy.param_dtype
        if dtype is None:
            return inputs
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs)

    def _pre_forward(self, u: _Unit):
        def hook(module, args):
            self._gather_finish(u)
            for sp in u.params:
                sp.register(sp.unsharded)
            if self.prefetch and u.index + 1 < len(self._units):
                self._gather_start(self._units[u.index + 1], prefetch=True)
            return self._cast_inputs(args)
        return hook

    def _post_forward(self, u: _Unit):
        def hook(module, args, output):
            for sp in u.params:
                sp.register(sp.shard)
            self._free(u)
            if self.stage == 2:
                u.unsharded = False   # kept whole for the backward; the next forward gathers the shards again
            if self.stage == 3 and torch.is_grad_enabled():
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
            if u.ready == len(u.trainable):
                self._reduce_start(u)
        return hook

    @torch.no_grad()
    def _reduce_start(self, u: _Unit) -> None:
        """Lay out u's gradients as FSDP2 does (rank r's rows of every parameter together, each padded to c rows;
        a parameter without a gradient is left out, as FSDP2 leaves it), in reduce_dtype, free them, launch the
        ReduceScatter; ZeRO-3 frees u again. No gradient at all: nothing is launched."""
        if u.reduced:
            return
        with_grad = [sp for sp in u.trainable if sp.unsharded.grad is not None]
        if not with_grad:
            return
        dtype = self._reduce_dtype(u)
        with record_function(f"{RANGE_REDUCE_SCATTER}{u.index}"):
            numel = sum(sp.padded_numel for sp in with_grad)
            device = with_grad[0].padded.device
            flat = torch.zeros(self.n, numel, dtype=dtype, device=device)
            offset = 0
            for sp in with_grad:
                padded = torch.zeros(self.n * sp.c, *sp.shape[1:], dtype=dtype, device=device)
                padded[:sp.shape[0]].copy_(sp.unsharded.grad)
                flat[:, offset:offset + sp.padded_numel].copy_(padded.view(self.n, -1))
                sp.unsharded.grad = None   # the full gradient is freed: only the shard's survives (ZeRO-2's P_g)
                offset += sp.padded_numel
            flat = flat.view(-1)
            pre, _ = gradient_divide_factors(self.n * self.replicas, dtype)
            if pre != 1:
                flat.div_(pre)
            out = torch.empty(numel, dtype=dtype, device=device)
            if self.n > 1:
                work = reduce_scatter_single(out, flat, group=self.shard_group, async_op=True)
            else:
                work = None
                out.copy_(flat)
        u.reduce, u.reduced = (work, out, flat, with_grad), True
        self.last_step.reduce_scatters += 1
        self.last_step.reduce_scatter_nbytes += (self.n - 1) * numel * out.element_size()
        self._free(u)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End of backward (an autograd engine callback): reduce what no hook reduced, wait, set the shards' grads."""
        try:
            for u in self._units:   # a unit whose gradients did not all arrive: those that did
                self._reduce_start(u)
            with record_function(RANGE_WAIT_REDUCE):
                for u in self._units:
                    if u.reduce is None:
                        continue
                    work, out, _, with_grad = u.reduce
                    if work is not None:
                        work.wait()
                    if self.replicate_group is not None and self.replicas > 1:
                        with record_function(f"{RANGE_ALL_REDUCE}{u.index}"):
                            dist.all_reduce(out, group=self.replicate_group)
                        self.last_step.all_reduces += 1
                        self.last_step.all_reduce_nbytes += 2 * (self.replicas - 1) / self.replicas * \
                            out.numel() * out.element_size()
                    out.div_(gradient_divide_factors(self.n * self.replicas, out.dtype)[1])
                    grads = out.to(u.params[0].orig_dtype)
                    offset = 0
                    for sp in with_grad:
                        g = grads[offset:offset + sp.padded_numel].view(sp.c, *sp.shape[1:])[:sp.rows]
                        sp.shard.grad = g if sp.shard.grad is None else sp.shard.grad.add_(g)
                        offset += sp.padded_numel
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
            self._drop_gather(u)
            self._free(u)
            if self.stage == 2:
                u.unsharded = False   # as FSDP2 reshards after backward: the next forward gathers the new shards
        self._in_backward = False

    def _drop_gather(self, u: _Unit) -> None:
        """A prefetch nobody used (the unit did not run after it, or ran in a recomputation): wait for it, so that
        nothing is left in flight, and drop it, since the shards may change before the unit's next forward."""
        if u.gather is not None:
            if u.gather[0] is not None:
                u.gather[0].wait()
            u.gather = None

    # ---- the optimizer and the whole model --------------------------------------------------------------------

    def shard_parameters(self) -> list[nn.Parameter]:
        """This rank's shards, in ``module.named_parameters()`` order: ``module.parameters()`` (what to optimise).
        Each has ``rows`` of the parameter's dim 0 (:func:`dim0_shard_rows`; 0 rows on a rank past the end)."""
        return [sp.shard for sp in self._params_in_order()]

    def _params_in_order(self) -> list[_Param]:
        return self._ordered

    def make_optimizer(self, optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_cls(self.parameters(), **kwargs)``: the same as building it on the wrapped model's parameters.

        The optimizer must be element-wise (SGD, Adam, AdamW): its state then has the shard's size, 1/N of the
        model's (ZeRO's P_os); clipping by the global norm inside it, or LAMB, would need the whole gradient (clip
        before ``step()`` with :meth:`clip_grad_norm_`, one AllReduce).

        Raises:
            ValueError: ``optimizer_cls`` is not a ``torch.optim.Optimizer`` subclass.
        """
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer subclass (e.g. torch.optim.Adam), "
                             f"got {optimizer_cls!r}")
        return optimizer_cls(self.parameters(), **kwargs)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale the shards' gradients by ``min(1, max_norm / (total + 1e-6))``, ``total`` the ``norm_type``-norm of
        the whole model's gradient; returns ``total`` (0-dim float32, float64 for float64 gradients; equal on
        every rank). What ``torch.nn.utils.clip_grad_norm_`` does on ``fully_shard``'s DTensor parameters.

        Collective over ``shard_group``: one AllReduce of this rank's sum of ``|g|^p`` (a MAX of ``max |g|`` for
        ``inf``); HSDP's replicas hold equal shards. ``clip_grad_norm_(model.parameters(), c)`` on these plain
        tensors would instead clip each rank's shard by that shard's own norm.

        Raises:
            ValueError: ``max_norm`` not a finite number >= 0, ``norm_type`` not > 0 (``inf`` allowed).
            RuntimeError: ``error_if_nonfinite`` and the total norm is NaN or infinite (on every rank).
        """
        max_norm = checks.number("max_norm", max_norm, least=0, where="clip_grad_norm_")
        norm_type = checks.number("norm_type", norm_type, above=0, finite=False, where="clip_grad_norm_")
        grads = [sp.shard.grad for sp in self._ordered if sp.shard.grad is not None]
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        local = torch.zeros((), dtype=dtype, device=group_device(self.shard_group))
        for g in grads:
            if g.numel():
                norm = torch.linalg.vector_norm(g, norm_type, dtype=dtype)
                local = torch.maximum(local, norm) if math.isinf(norm_type) else local + norm ** norm_type
        if self.n > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM,
                            group=self.shard_group)
        total = local if math.isinf(norm_type) else local ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"ShardedDataParallel.clip_grad_norm_: the total {norm_type}-norm of the gradients "
                               f"is {float(total)}; pass error_if_nonfinite=False to clip anyway")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    @torch.no_grad()
    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter, unsharded, in its own dtype, as new tensors in ``module.named_parameters()`` order.

        Collective over ``shard_group``: one AllGather per unit (not counted in :attr:`last_step`).
        """
        return self._gather_all(lambda sp: sp.padded)

    @torch.no_grad()
    def full_gradients(self) -> list[torch.Tensor | None]:
        """Every parameter's averaged gradient, unsharded (as DDP's ``p.grad``), in the order of
        :meth:`full_parameters`; None for all before any backward (and for frozen ones). Collective."""
        if all(sp.shard.grad is None for u in self._units for sp in u.params):
            return [None] * sum(len(u.params) for u in self._units)

        def padded_grad(sp):
            out = torch.zeros_like(sp.padded)
            if sp.shard.grad is not None:
                out[:sp.rows].copy_(sp.shard.grad)
            return out
        full = self._gather_all(padded_grad)
        return [None if not sp.requires_grad else t for sp, t in zip(self._params_in_order(), full)]

    def _gather_all(self, padded_of: Callable[[_Param], torch.Tensor]) -> list[torch.Tensor]:
        by_param: dict[int, torch.Tensor] = {}
        for u in self._units:
            inp = torch.cat([padded_of(sp).reshape(-1) for sp in u.params])
            out = torch.empty(self.n * inp.numel(), dtype=inp.dtype, device=inp.device)
            if self.n > 1:
                all_gather_single(out, inp, group=self.shard_group)
            else:
                out.copy_(inp)
            for sp, whole in self._unpadded(u, out):
                by_param[id(sp)] = whole.clone()
        return [by_param[id(sp)] for sp in self._params_in_order()]

    def named_units(self) -> list[tuple[str, nn.Module]]:
        """``(name in the module, module)`` of each unit, in order."""
        return [(u.name, u.module) for u in self._units]

    @property
    def units(self) -> list[nn.Module]:
        return [u.module for u in self._units]

    def unsharded_parameters(self) -> list[nn.Parameter]:
        """The tensors the units compute with (``param_dtype``), in the order of :meth:`shard_parameters`: whole
        under ZeRO-2, 0 bytes of storage under ZeRO-3 outside a unit's forward and backward."""
        return [sp.unsharded for sp in self._params_in_order()]

    def held_nbytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds now, measured by :func:`held_memory_bytes`: under ZeRO-3 the shards are the
        parameters (the unsharded ones are freed outside their windows); under ZeRO-2 the unsharded parameters
        are whole and the shards are the optimizer's master copy."""
        unsharded = self.unsharded_parameters()
        return held_memory_bytes(unsharded + self.shard_parameters() if self.stage == 3 else unsharded, optimizer)


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
