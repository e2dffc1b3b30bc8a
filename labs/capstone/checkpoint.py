"""Checkpoints of the capstone in ``torch.distributed.checkpoint`` (DCP), readable under any TP x PP x DP layout.

What is stored is the *unsharded* model: every parameter and its Adam moments under the full model's name
(``blocks.2.attn.qkv.weight``, ``.exp_avg``, ``.exp_avg_sq``, ``.step``). Saving, each rank gathers its stage's
tensors over TP (and ZeRO-1's moments over DP first); DCP writes a key that several ranks hold once. Loading,
each rank reads its stage's full tensors and keeps its shards, so a 2x2x2 checkpoint loads as 1x2x4 (a
production system would save DTensor shards and let DCP reshard them; at this size the copy is small).

The DP compressor's state (:class:`DPSync`: PowerSGD's residuals and Q matrices, error-feedback residuals)
is stored per rank under its place in the mesh, and restored only into a run of the same setting (layout,
compressor, bucket cap): then resuming is the uninterrupted run, bitwise. Otherwise the compressor starts
afresh with a warning (see :func:`load`). Batches are drawn from ``(seed, step)``, so data needs no state.

Entry points: :func:`save`, :func:`load`, :func:`latest_step`; lab 14, part 3, resumes under another layout.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commlab.compress import CompressionHookState, PowerSGDState
from commlab.overlap import BucketedDataParallel
from commlab.parallel import ZeroOneOptimizer
from commlab.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def _dcp():
    """``torch.distributed.checkpoint``, imported on first use: it takes about a second per process to import
    (it pulls in DTensor), which every rank of a run without checkpoints would otherwise pay at start-up."""
    import torch.distributed.checkpoint as dcp
    return dcp

__all__ = ["DPSync", "dp_sync_of", "save", "load", "latest_step", "resume"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class DPSync:
    """This rank's DP comm hook state, and what it belongs to (for :func:`save` and :func:`load`).

    Attributes:
        state: the hook's state (:class:`PowerSGDState` or :class:`CompressionHookState`).
        wrapper: the :class:`BucketedDataParallel` it is registered on (its buckets name their parameters).
        rank_key: this rank's place in the mesh, ``"pp<s>.tp<t>.dp<d>"``: the residuals are this rank's own.
        setting: everything the state's meaning depends on beyond the model, the same on every rank (e.g.
            ``"tp=2 pp=2 dp=2, powersgd:2, error feedback on, bucket cap 26214400 B"``); the state is restored
            only into a run with the same setting.
    """

    state: PowerSGDState | CompressionHookState
    wrapper: BucketedDataParallel
    rank_key: str
    setting: str


def dp_sync_of(hook_state: PowerSGDState | CompressionHookState | None, wrapper: BucketedDataParallel, mesh,
               opts) -> DPSync | None:
    """This rank's DP compressor state as checkpoints store it (None without one): under the rank's place in
    ``mesh``, with the setting of ``opts`` it is valid for."""
    if hook_state is None:
        return None
    rank_key = "pp{}.tp{}.dp{}".format(*(mesh.get_local_rank(dim) for dim in ("pp", "tp", "dp")))
    setting = (f"tp={opts.tp} pp={opts.pp} dp={opts.dp}, {opts.compressor} with error feedback "
               f"{'on' if opts.error_feedback else 'off'}, {opts.dtype}, seed {opts.seed}, "
               f"bucket cap {wrapper.bucket_cap_bytes} B")
    return DPSync(hook_state, wrapper, rank_key, setting)


def _owners(model: nn.Module, stage: nn.Module) -> dict[str, tuple[nn.Parameter, nn.Module | None, str]]:
    """Full-model name -> (parameter, its TP layer or None if replicated, "weight"/"bias") for ``stage``'s params."""
    mine = {id(p) for p in stage.parameters()}
    layer_of = {}
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            for attr in ("weight", "bias"):
                if getattr(module, attr) is not None:
                    layer_of[id(getattr(module, attr))] = (module, attr)
    return {name: (p, *layer_of.get(id(p), (None, "")))
            for name, p in model.named_parameters() if id(p) in mine}


def _full(local: torch.Tensor, layer, attr) -> torch.Tensor:
    return local.detach().clone() if layer is None else layer.gather_full(local.detach(), attr)


def _shard(full: torch.Tensor, layer, attr) -> torch.Tensor:
    return full.clone() if layer is None else layer.take_shard(full, attr)


def _optimizer_states(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> dict[nn.Parameter, dict]:
    """Each parameter's (TP-local) optimizer state, unsharded over DP; collective over DP for ZeRO-1."""
    if isinstance(optimizer, ZeroOneOptimizer):
        return optimizer.full_state()
    return {p: optimizer.state.get(p, {}) for p in params}


# ---- the DP compressor's state: a picklable skeleton plus its tensors, both in DCP ---------------------

def _split(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor (inside dicts, lists, tuples) replaced by ``{"__tensor__": key}``, the tensor
    put in ``tensors[key]``: DCP stores tensors as tensors and pickles the rest, but it flattens nested dicts,
    so the skeleton travels as one pickled object."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _dp_sync_entries(sync: DPSync) -> dict[str, Any]:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(sync.state.state_dict(), tensors)
    return {"setting": sync.setting, f"{sync.rank_key}/skeleton": pickle.dumps(skeleton),
            **{f"{sync.rank_key}/{k}": t for k, t in tensors.items()}}


def _restore_dp_sync(sync: DPSync, path: str, saved_setting: str | None, step: int, device: torch.device) -> None:
    """Load this rank's compressor state from ``path`` if it was saved with ``sync``'s setting, else start it
    afresh with a warning on rank 0. Collective (a DCP load) when the settings agree, which they do on every
    rank or on none, since the setting is the same on every rank.

    Why afresh rather than refuse: the state is that of each rank's flat buckets, which do not map across
    layouts (a residual is one DP rank's own error; a bucket holds one stage's TP shards). Starting afresh
    (zero residuals, Q drawn anew; PowerSGD's step count carried over) drops at most one step's compression
    error per rank, and training goes on as a compressed run from its start does; an elastic restart on
    fewer nodes must be able to go on.
    """
    if saved_setting != sync.setting:
        # The state is as new (load runs before the first step): only PowerSGD's step count is carried over.
        if isinstance(sync.state, PowerSGDState):
            sync.state.step = step + 1    # steps done: compression goes on from the same step
        if dist.get_rank() == 0:
            if saved_setting is None:
                why = ("holds no compressor state (it was saved without one); this run is "
                       f"[{sync.setting}], so the compressor starts afresh")
            else:
                why = (f"holds the compressor state of [{saved_setting}]; this run is [{sync.setting}]. A "
                       "compressor's per-rank bucket state does not map across layouts or compressors, so the "
                       "compressor starts afresh")
            fresh = ("new Q matrices and zero error-feedback residuals" if isinstance(sync.state, PowerSGDState)
                     else "zero error-feedback residuals")
            print(f"warning: checkpoint {path!r} {why} ({fresh}); model and optimizer are loaded exactly",
                  file=sys.stderr, flush=True)
        return
    meta = _dcp().FileSystemReader(path).read_metadata().state_dict_metadata
    prefix = f"dp_sync.{sync.rank_key}/"
    want: dict[str, Any] = {f"{sync.rank_key}/skeleton": None}
    for key, md in meta.items():
        if key.startswith(prefix) and key != prefix + "skeleton":
            want[key[len("dp_sync."):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=device)
    _dcp().load({"dp_sync": want}, checkpoint_id=path)
    tensors = {k[len(sync.rank_key) + 1:]: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    state_dict = _join(pickle.loads(want[f"{sync.rank_key}/skeleton"]), tensors)
    if isinstance(sync.state, PowerSGDState):
        sync.state.load_state_dict(state_dict)
    else:
        by_name = dict(sync.wrapper.module.named_parameters())
        sync.state.load_state_dict(state_dict, {b.index: [by_name[n] for n in b.names] for b in sync.wrapper.buckets})


# ---- save and load -----------------------------------------------------------------------------------

def save(directory: str, step: int, model: nn.Module, stage: nn.Module, optimizer: torch.optim.Optimizer,
         dp_sync: DPSync | None = None) -> str:
    """Write step ``step``'s checkpoint to ``directory/step_<step>``; every rank of the world must call it.

    Args:
        model: this rank's (TP-sharded) whole model, whose ``named_parameters`` give the full names.
        stage: the part of it this rank trains (its pipeline stage).
        optimizer: the stage's Adam, or a :class:`ZeroOneOptimizer` over it (its ``exp_avg``, ``exp_avg_sq``
            and ``step`` are saved, unsharded: gathered over DP for ZeRO-1, then over TP).
        dp_sync: this rank's DP compressor state, if the run compresses (None: nothing to save).

    Returns:
        The checkpoint's path.
    """
    path = os.path.join(directory, f"step_{step:06d}")
    owners = _owners(model, stage)
    opt_states = _optimizer_states(optimizer, [p for p, _, _ in owners.values()])
    state: dict[str, torch.Tensor] = {}
    for name, (p, layer, attr) in owners.items():
        state[name] = _full(p, layer, attr)
        st = opt_states.get(p, {})
        for moment in _MOMENTS:
            if moment in st:
                state[f"{name}.{moment}"] = _full(st[moment], layer, attr)
        if "step" in st:
            state[f"{name}.step"] = st["step"].detach().clone().reshape(1)
    everything: dict[str, Any] = {"model": state, "meta": {"step": torch.tensor([step])}}
    if dp_sync is not None:
        everything["dp_sync"] = _dp_sync_entries(dp_sync)
    _dcp().save(everything, checkpoint_id=path)
    return path


def latest_step(directory: str) -> int | None:
    """The newest step saved in ``directory`` (None if there is none)."""
    if not os.path.isdir(directory):
        return None
    steps = [int(d[5:]) for d in os.listdir(directory)
             if d.startswith("step_") and d[5:].isdigit() and os.path.exists(os.path.join(directory, d, ".metadata"))]
    return max(steps) if steps else None


def load(directory: str, model: nn.Module, stage: nn.Module, optimizer: torch.optim.Optimizer,
         full_shapes: dict[str, torch.Size], dp_sync: DPSync | None = None) -> int:
    """Load the newest checkpoint of ``directory`` into this rank's shard of ``model`` and ``optimizer``.

    Every rank of the world must call it. The layout it was saved under does not matter for the model and
    the optimizer (Adam or :class:`ZeroOneOptimizer`, whichever saved it); the compressor state is restored
    when it was saved with ``dp_sync.setting``, and started afresh with a warning on rank 0 otherwise (why:
    ``_restore_dp_sync``). Call it before the first step: a state that is not restored is taken as new.

    Args:
        full_shapes: the unsharded model's parameter shapes by name (from a model built whole).
        dp_sync: this rank's DP compressor state, if the run compresses.

    Returns:
        The step it was saved at (training goes on from the next).

    Raises:
        FileNotFoundError: ``directory`` holds no checkpoint.
        RuntimeError: (from DCP) a key this rank needs is missing: the checkpoint is of another model.
        ValueError: (from :meth:`ZeroOneOptimizer.load_full_state`) a checkpoint whose parameters of one
            ZeRO-1 param group were saved at different Adam steps.
    """
    step = latest_step(directory)
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {directory!r} (expected step_NNNNNN folders written by --ckpt-dir)")
    path = os.path.join(directory, f"step_{step:06d}")
    owners = _owners(model, stage)
    state: dict[str, torch.Tensor] = {}
    for name, (p, _, _) in owners.items():
        shape = full_shapes[name]
        state[name] = torch.empty(shape, dtype=p.dtype, device=p.device)
        for moment in _MOMENTS:
            state[f"{name}.{moment}"] = torch.empty(shape, dtype=p.dtype, device=p.device)
        state[f"{name}.step"] = torch.empty(1, dtype=torch.float32)
    meta: dict[str, Any] = {"step": torch.tensor([0])}
    everything: dict[str, Any] = {"model": state, "meta": meta}
    has_sync = "dp_sync.setting" in _dcp().FileSystemReader(path).read_metadata().state_dict_metadata
    if dp_sync is not None and has_sync:
        everything["dp_sync"] = {"setting": None}
    _dcp().load(everything, checkpoint_id=path)
    if int(meta["step"]) != step:
        raise RuntimeError(f"checkpoint {path!r} says step {int(meta['step'])}")
    opt_states: dict[nn.Parameter, dict] = {}
    with torch.no_grad():
        for name, (p, layer, attr) in owners.items():
            p.copy_(_shard(state[name], layer, attr))
            opt_states[p] = {"step": state[f"{name}.step"].reshape(()).clone(),
                             **{m: _shard(state[f"{name}.{m}"], layer, attr).to(p.device) for m in _MOMENTS}}
    if isinstance(optimizer, ZeroOneOptimizer):
        optimizer.load_full_state(opt_states)
    else:
        for p, st in opt_states.items():
            optimizer.state[p] = st
    if dp_sync is not None:
        saved = everything["dp_sync"]["setting"] if "dp_sync" in everything else None
        _restore_dp_sync(dp_sync, path, saved, step, next(stage.parameters()).device)
    return step


def resume(directory: str, steps: int, model: nn.Module, stage: nn.Module, optimizer: torch.optim.Optimizer,
           full_shapes: dict[str, torch.Size], dp_sync: DPSync | None = None) -> int:
    """:func:`load` the newest checkpoint of ``directory`` if there is one (every rank calls it); the step to
    start from (0 without a checkpoint). Rank 0 says which, and when it already reaches ``steps``."""
    start = 0 if latest_step(directory) is None else 1 + load(directory, model, stage, optimizer, full_shapes,
                                                              dp_sync)
    if dist.get_rank() == 0:
        print(f"resume: no checkpoint in {directory!r}, starting at step 0" if start == 0 else
              f"resume: from the checkpoint of step {start - 1} in {directory!r}" +
              (f"; it already reaches --steps {steps}: nothing to do" if start >= steps else ""),
              file=sys.stderr, flush=True)
    return start
