"""Checkpoints of the capstone in ``torch.distributed.checkpoint`` (DCP), readable under any TP x PP x DP layout.

What is stored is the *unsharded* model: every parameter and its Adam moments under the full model's name
(``blocks.2.attn.qkv.weight``, its ``.exp_avg``, ``.exp_avg_sq``, ``.step``), whole. Saving, each rank
reassembles the tensors of its stage over its TP group (:meth:`ColumnParallelLinear.gather_full` and the row
version); the ranks that then hold the same key (a TP group's ranks, the DP replicas) write it once, because
DCP's planner keeps one copy of a key that several ranks save. Loading, each rank reads the full tensors of
*its* stage and keeps its TP shard (``take_shard``), so a checkpoint saved as 2x2x2 loads as 1x2x4 or 2x2x1:
the layout is not part of the checkpoint. The price is that a rank briefly holds its stage's full tensors (a
production system would save DTensor shards and let DCP reshard them; at the capstone's size the copy is
small, and the format stays DCP's).

Not stored: a compressor's state (PowerSGD's Q matrices, error-feedback residuals), so a resumed compressed
run starts those afresh; the data order needs nothing, since batches are drawn from ``(seed, step)``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from commlab.parallel.tensor import ColumnParallelLinear, RowParallelLinear

__all__ = ["save", "load", "latest_step"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


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


def save(directory: str, step: int, model: nn.Module, stage: nn.Module, optimizer: torch.optim.Adam) -> str:
    """Write step ``step``'s checkpoint to ``directory/step_<step>``; every rank of the world must call it.

    Args:
        model: this rank's (TP-sharded) whole model, whose ``named_parameters`` give the full names.
        stage: the part of it this rank trains (its pipeline stage).
        optimizer: the stage's Adam (its ``exp_avg``, ``exp_avg_sq`` and ``step`` are saved).

    Returns:
        The checkpoint's path.
    """
    path = os.path.join(directory, f"step_{step:06d}")
    state: dict[str, torch.Tensor] = {}
    for name, (p, layer, attr) in _owners(model, stage).items():
        state[name] = _full(p, layer, attr)
        st = optimizer.state.get(p, {})
        for moment in _MOMENTS:
            if moment in st:
                state[f"{name}.{moment}"] = _full(st[moment], layer, attr)
        if "step" in st:
            state[f"{name}.step"] = st["step"].detach().clone().reshape(1)
    dcp.save({"model": state, "meta": {"step": torch.tensor([step])}}, checkpoint_id=path)
    return path


def latest_step(directory: str) -> int | None:
    """The newest step saved in ``directory`` (None if there is none)."""
    if not os.path.isdir(directory):
        return None
    steps = [int(d[5:]) for d in os.listdir(directory)
             if d.startswith("step_") and d[5:].isdigit() and os.path.exists(os.path.join(directory, d, ".metadata"))]
    return max(steps) if steps else None


def load(directory: str, model: nn.Module, stage: nn.Module, optimizer: torch.optim.Adam,
         full_shapes: dict[str, torch.Size]) -> int:
    """Load the newest checkpoint of ``directory`` into this rank's shard of ``model`` and ``optimizer``.

    Args:
        full_shapes: the unsharded model's parameter shapes by name (from a model built whole).

    Returns:
        The step it was saved at (training goes on from the next).

    Raises:
        FileNotFoundError: ``directory`` holds no checkpoint.
        RuntimeError: (from DCP) a key this rank needs is missing: the checkpoint is of another model.
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
    meta = {"step": torch.tensor([0])}
    dcp.load({"model": state, "meta": meta}, checkpoint_id=path)
    if int(meta["step"]) != step:
        raise RuntimeError(f"checkpoint {path!r} says step {int(meta['step'])}")
    with torch.no_grad():
        for name, (p, layer, attr) in owners.items():
            p.copy_(_shard(state[name], layer, attr))
            optimizer.state[p] = {
                "step": state[f"{name}.step"].reshape(()).clone(),
                **{m: _shard(state[f"{name}.{m}"], layer, attr).to(p.device) for m in _MOMENTS}}
    return step
