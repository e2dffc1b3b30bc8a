"""Checkpoints of the capstone in ``torch.distributed.checkpoint`` (DCP), readable under any TP x PP x DP layout.

What is stored is the *unsharded* model: every parameter and its Adam moments under the full model's name.
Saving, each rank gathers its stage's tensors over TP (and ZeRO-1's moments over DP); loading, each rank reads
its stage's full tensors and keeps its shards, so a 2x2x2 checkpoint loads as 1x2x4. The DP compressor's
state (:class:`DPSync`) is stored per rank and restored only into a run of the same setting (then bitwise);
otherwise it starts afresh with a warning. With DiLoCo (``--inner-steps``) each DP replica's parameters and Adam
state are stored apart, beside the outer state (:class:`OuterSync`): same layout and outer flags only (a plain
checkpoint starts DiLoCo).

A checkpoint is complete once rank 0 has written its ``manifest.json`` (files' sizes and SHA-256, the model and
the run); one without a manifest (saved before manifests) loads unverified. :class:`RunDirectory` guards
``--ckpt-dir`` (lock, resume, saves, preemption, the stop at a non-finite loss). Entry points: :class:`RunDirectory`,
:func:`save`, :func:`load`, :func:`verify`. Book: chapter 14, §14.4; lab 14, part 3 (another layout).
"""

from __future__ import annotations

import dataclasses
import contextlib
import datetime
import fcntl
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commlab.collectives.agreement import gather
from commlab.compress import CompressionHookState, PowerSGDState
from commlab.launch.device import group_device
from commlab.overlap import BucketedDataParallel
from commlab.parallel import ZeroOneOptimizer
from commlab.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def _dcp():
    """``torch.distributed.checkpoint``, imported on first use: it takes about a second per process to import
    (it pulls in DTensor), which every rank of a run without checkpoints would otherwise pay at start-up."""
    import torch.distributed.checkpoint as dcp
    return dcp

__all__ = ["RunError", "RunDirectory", "DPSync", "dp_sync_of", "OuterSync", "outer_sync_of", "save", "load",
           "verify", "checkpoints", "preempted_at", "MANIFEST", "LOCK", "PREEMPTION_SIGNALS"]

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
    rank_key = _rank_key(mesh)
    setting = (f"tp={opts.tp} pp={opts.pp} dp={opts.dp}, {opts.compressor} with error feedback "
               f"{'on' if opts.error_feedback else 'off'}, {opts.dtype}, seed {opts.seed}, "
               f"bucket cap {wrapper.bucket_cap_bytes} B")
    return DPSync(hook_state, wrapper, rank_key, setting)


@dataclasses.dataclass(frozen=True)
class OuterSync:
    """This rank's DiLoCo outer state (``--inner-steps``), and what it belongs to (for :func:`save` and :func:`load`).

    Attributes:
        state: the outer optimizer (``state_dict``/``load_state_dict``: step count, global copy, outer momentum,
            error-feedback residuals) over this rank's stage parameters, synced over its DP group.
        replica: this rank's DP rank: its replica's parameters and Adam state are its own between outer steps.
        rank_key: this rank's place in the mesh, ``"pp<s>.tp<t>.dp<d>"``.
        setting: the layout and the outer step's flags, the same on every rank; a checkpoint resumes only
            under the same setting.
    """

    state: Any
    replica: int
    rank_key: str
    setting: str


def _rank_key(mesh) -> str:
    return "pp{}.tp{}.dp{}".format(*(mesh.get_local_rank(dim) for dim in ("pp", "tp", "dp")))


def outer_sync_of(outer, mesh, opts) -> OuterSync | None:
    """This rank's DiLoCo state as checkpoints store it (None without ``--inner-steps``), with the setting of
    ``opts`` (written as the flags that resume it) it is valid for."""
    if outer is None:
        return None
    setting = (f"--tp {opts.tp} --pp {opts.pp} --dp {opts.dp} --dtype {opts.dtype} --seed {opts.seed} "
               f"--inner-steps {opts.inner_steps} --outer-lr {opts.outer_lr} --outer-momentum {opts.outer_momentum}"
               f"{'' if opts.nesterov else ' --no-nesterov'} --fragments {opts.fragments} "
               f"--sync-delay {opts.sync_delay} --mixing {opts.mixing} --outer-compressor {opts.outer_compressor}"
               f"{'' if opts.error_feedback else ' --no-error-feedback'}")
    return OuterSync(outer, mesh.get_local_rank("dp"), _rank_key(mesh), setting)


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


def _rank_state_entries(sync: DPSync | OuterSync) -> dict[str, Any]:
    """DCP entries of ``sync.state.state_dict()``: its setting, and under this rank's key its skeleton and tensors."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(sync.state.state_dict(), tensors)
    return {"setting": sync.setting, f"{sync.rank_key}/skeleton": pickle.dumps(skeleton),
            **{f"{sync.rank_key}/{k}": t for k, t in tensors.items()}}


def _load_rank_state(path: str, top: str, rank_key: str, device: torch.device) -> Any:
    """The state dict :func:`_rank_state_entries` stored under ``top`` for ``rank_key`` (a collective DCP load)."""
    meta = _dcp().FileSystemReader(path).read_metadata().state_dict_metadata
    prefix = f"{top}.{rank_key}/"
    want: dict[str, Any] = {f"{rank_key}/skeleton": None}
    for key, md in meta.items():
        if key.startswith(prefix) and key != prefix + "skeleton":
            want[key[len(top) + 1:]] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=device)
    _dcp().load({top: want}, checkpoint_id=path)
    tensors = {k[len(rank_key) + 1:]: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    return _join(pickle.loads(want[f"{rank_key}/skeleton"]), tensors)


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
    state_dict = _load_rank_state(path, "dp_sync", sync.rank_key, device)
    if isinstance(sync.state, PowerSGDState):
        sync.state.load_state_dict(state_dict)
    else:
        by_name = dict(sync.wrapper.module.named_parameters())
        sync.state.load_state_dict(state_dict, {b.index: [by_name[n] for n in b.names] for b in sync.wrapper.buckets})


# ---- save, verify and load -----------------------------------------------------------------------------

#: Written by rank 0 after DCP's save, last: a step folder without it holds an unfinished save.
MANIFEST = "manifest.json"
#: The lock file of a ``--ckpt-dir``, held (``fcntl.flock``) by rank 0 of the run that uses the directory.
LOCK = "run.lock"
#: The signals that make a run save at the next step boundary and stop: SLURM's ``--signal=TERM@60`` or
#: ``USR1@60``, and torchrun, which forwards SIGTERM to its workers (SIGUSR1 too when listed in
#: ``TORCHELASTIC_SIGNALS_TO_HANDLE``).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: The run settings that change what training computes; a resume that changes one says so.
_TRAINING_SETTINGS = ("seed", "lr", "dtype", "compressor", "error_feedback", "global_batch", "inner_steps")


class RunError(RuntimeError):
    """The run cannot go on, for the reason the message names (its checkpoints, their directory, a non-finite
    loss). Every rank raises it with the same message, so that all ranks leave together."""


def run_config(opts) -> dict:
    """What a checkpoint records of the run: ``{"model": GPTConfig's fields, "run": the other options}``."""
    run = {k: v for k, v in dataclasses.asdict(opts).items() if k != "model"}
    return {"model": dataclasses.asdict(opts.model), "run": run | {"global_batch": opts.global_batch}}


def _refuse_non_finite(state: dict[str, torch.Tensor], step: int) -> None:
    """RunError on every rank if any rank's ``state`` holds a NaN or an infinity (collective over the world)."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    named = [f"rank {r}: {', '.join(b)}" for r, b in enumerate(gather(bad[:3])) if b]
    if named:
        raise RunError(f"step {step}: not saving a checkpoint that holds non-finite values ({'; '.join(named)}); "
                       "the newest checkpoint on disk stays the last good one")


def save(directory: str, step: int, model: nn.Module, stage: nn.Module, optimizer: torch.optim.Optimizer,
         dp_sync: DPSync | None = None, config: dict | None = None, outer: OuterSync | None = None) -> str:
    """Write step ``step``'s checkpoint to ``directory/step_<step>``; every rank of the world must call it.

    Args:
        model: this rank's (TP-sharded) whole model, whose ``named_parameters`` give the full names.
        stage: the part of it this rank trains (its pipeline stage).
        optimizer: the stage's Adam, or a :class:`ZeroOneOptimizer` over it (its ``exp_avg``, ``exp_avg_sq``
            and ``step`` are saved, unsharded: gathered over DP for ZeRO-1, then over TP).
        dp_sync: this rank's DP compressor state, if the run compresses (None: nothing to save).
        config: what the manifest records of the run (:func:`run_config`).
        outer: this rank's DiLoCo state, with ``--inner-steps``: then each DP replica's parameters and Adam
            state are stored apart (``dp<d>/<name>``), since they differ between outer steps.

    Returns:
        The checkpoint's path.

    Raises:
        RunError: on every rank, before anything is written, if a tensor to save is not finite.
    """
    path = os.path.join(directory, f"step_{step:06d}")
    owners = _owners(model, stage)
    opt_states = _optimizer_states(optimizer, [p for p, _, _ in owners.values()])
    replica = "" if outer is None else f"dp{outer.replica}/"
    state: dict[str, torch.Tensor] = {}
    for name, (p, layer, attr) in owners.items():
        state[replica + name] = _full(p, layer, attr)
        st = opt_states.get(p, {})
        for moment in _MOMENTS:
            if moment in st:
                state[f"{replica}{name}.{moment}"] = _full(st[moment], layer, attr)
        if "step" in st:
            state[f"{replica}{name}.step"] = st["step"].detach().clone().reshape(1)
    _refuse_non_finite(state, step)
    everything: dict[str, Any] = {"model": state, "meta": {"step": torch.tensor([step])}}
    if dp_sync is not None:
        everything["dp_sync"] = _rank_state_entries(dp_sync)
    if outer is not None:
        everything["outer"] = _rank_state_entries(outer)
    with _agreed_write(step, path):
        if dist.get_rank() == 0:   # a leftover of an earlier crash, then an unfinished or damaged save of this step
            for old in (path + ".stale", path):   # from before a resume; no rank writes before rank 0 joins DCP
                if os.path.exists(old):
                    if old == path:
                        os.replace(path, path + ".stale")
                    shutil.rmtree(path + ".stale")
    with _agreed_write(step, path):   # DCP raises on every rank when any rank fails to write
        _dcp().save(everything, checkpoint_id=path)
    with _agreed_write(step, path):
        if dist.get_rank() == 0:   # DCP's save returns once every rank's files and the .metadata are written
            _write_manifest(path, step, config)
    return path


@contextlib.contextmanager
def _agreed_write(step: int, path: str):
    """Run the block on every rank, then RunError on every rank (collective) naming the step, the path and the
    first OS error if any rank's block failed (a read-only or full disk): one message, not a traceback a rank."""
    problem = None
    try:
        yield
    except BaseException as e:   # DCP's CheckpointException is a BaseException holding each rank's error
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        causes = [f[0] for _, f in sorted(getattr(e, "failures", {}).items())] or [e]
        problem = "; ".join(dict.fromkeys(f"{type(c).__name__}: {c}" for c in causes))
    problems = [p for p in gather(problem) if p]
    if problems:
        raise RunError(f"step {step}: the checkpoint could not be written to {path} ({problems[0]}); the run "
                       "stops, and the newest checkpoint on disk stays the last good one")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(path: str, step: int, config: dict | None) -> None:
    """Rank 0's record of a finished save: each file's size and SHA-256, and the run's configuration. Written
    to a temporary name and renamed, so that it exists whole or not at all. (At scale, each writer would hash
    its own files; here rank 0 reads them back, a few MB.)"""
    files = {name: {"bytes": os.path.getsize(os.path.join(path, name)), "sha256": _sha256(os.path.join(path, name))}
             for name in sorted(os.listdir(path)) if not name.startswith(MANIFEST)}
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": step, "config": config, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))


_STEP_DIR = re.compile(r"step_(\d{6,})(\.stale)?")
#: The files a checkpoint folder holds: DCP's (and their temporary names), and the manifest.
_OURS = re.compile(r"(\.metadata|__\d+_\d+\.distcp|manifest\.json)(\.tmp)?")


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a checkpoint folder this script wrote: named ``step_NNNNNN`` (as :func:`save` names
    it, or ``.stale`` after it), holding DCP's files or a manifest (or nothing) and no other file or folder."""
    name = os.path.basename(os.path.normpath(path))
    m = _STEP_DIR.fullmatch(name)
    if not m or name[5:5 + len(m[1])] != f"{int(m[1]):06d}" or not os.path.isdir(path) or os.path.islink(path):
        return False
    return all(_OURS.fullmatch(entry) and os.path.isfile(os.path.join(path, entry)) for entry in os.listdir(path))


def foreign(directory: str) -> list[str]:
    """The ``step_<digits>`` folders of ``directory`` that are not :func:`is_checkpoint`: never deleted."""
    if not os.path.isdir(directory):
        return []
    return sorted(d for d in os.listdir(directory) if re.fullmatch(r"step_\d+(\.stale)?", d)
                  and os.path.isdir(os.path.join(directory, d)) and not is_checkpoint(os.path.join(directory, d)))


def checkpoints(directory: str) -> list[tuple[int, str]]:
    """Every checkpoint folder of ``directory`` (:func:`is_checkpoint`, not ``.stale``), finished or not, as
    ``(N, path)`` in step order."""
    if not os.path.isdir(directory):
        return []
    found = [(int(d[5:]), os.path.join(directory, d)) for d in os.listdir(directory)
             if d[5:].isdigit() and is_checkpoint(os.path.join(directory, d))]
    return sorted(found)


def verify(path: str) -> tuple[dict | None, str | None]:
    """``(manifest, None)`` if every file the checkpoint at ``path`` lists in its manifest has its recorded size
    and SHA-256; else ``(None, what is wrong)``, naming the file. Reads every file once (local, not collective)."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        return None, f"no {MANIFEST} (its save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    well_formed = (isinstance(files, dict) and ".metadata" in files and any(n.endswith(".distcp") for n in files)
                   and all(isinstance(w, dict) and isinstance(w.get("bytes"), int) and isinstance(w.get("sha256"), str)
                           for w in files.values()))
    if not well_formed:
        return None, (f"{MANIFEST} is malformed (its \"files\" must map .metadata and the .distcp files to their "
                      "bytes and sha256)")
    for name, want in files.items():
        full = os.path.join(path, name)
        if not os.path.exists(full):
            return None, f"{name} is missing"
        size = os.path.getsize(full)
        if size != want["bytes"]:
            return None, f"{name} has {size} bytes, its manifest says {want['bytes']} (truncated or overwritten)"
        if _sha256(full) != want["sha256"]:
            return None, f"{name} does not match its SHA-256 in the manifest (damaged)"
    return manifest, None


def load(path: str, model: nn.Module, stage: nn.Module, optimizer: torch.optim.Optimizer,
         full_shapes: dict[str, torch.Size], dp_sync: DPSync | None = None, outer: OuterSync | None = None) -> int:
    """Load the checkpoint at ``path`` into this rank's shard of ``model`` and ``optimizer``.

    Every rank of the world must call it. The layout it was saved under does not matter for the model and
    the optimizer (Adam or :class:`ZeroOneOptimizer`, whichever saved it); the compressor state is restored
    when it was saved with ``dp_sync.setting``, and started afresh with a warning on rank 0 otherwise (why:
    ``_restore_dp_sync``). Call it before the first step: a state that is not restored is taken as new.

    Args:
        full_shapes: the unsharded model's parameter shapes by name (from a model built whole).
        dp_sync: this rank's DP compressor state, if the run compresses.
        outer: this rank's DiLoCo state, with ``--inner-steps``: restored with this replica's parameters and
            Adam state, bitwise, from a checkpoint saved with the same setting; from one of plain DP, DiLoCo
            starts afresh on the loaded parameters (``outer.state.start_from_parameters()``).

    Returns:
        The step it was saved at (training goes on from the next).

    Raises:
        RunError: on every rank, naming the step and the path, if DCP cannot read it (a file damaged after
            :func:`verify`, or a key this rank needs is missing: the checkpoint is of another model); or if
            the checkpoint holds DiLoCo state and this run another setting or none (naming both). Nothing is copied into the model or the optimizer then.
        ValueError: (from :meth:`ZeroOneOptimizer.load_full_state`) a checkpoint whose parameters of one
            ZeRO-1 param group were saved at different Adam steps.
    """
    step = int(os.path.basename(path)[5:])
    outer_saved = _refuse_other_outer(path, step, outer)
    owners = _owners(model, stage)
    replica = f"dp{outer.replica}/" if outer_saved else ""
    state: dict[str, torch.Tensor] = {}
    for name, (p, _, _) in owners.items():
        shape = full_shapes[name]
        state[replica + name] = torch.empty(shape, dtype=p.dtype, device=p.device)
        for moment in _MOMENTS:
            state[f"{replica}{name}.{moment}"] = torch.empty(shape, dtype=p.dtype, device=p.device)
        state[f"{replica}{name}.step"] = torch.empty(1, dtype=torch.float32)
    meta: dict[str, Any] = {"step": torch.tensor([0])}
    everything: dict[str, Any] = {"model": state, "meta": meta}
    try:   # DCP raises on every rank when any rank fails to read (it gathers the ranks' results)
        saved_keys = _dcp().FileSystemReader(path).read_metadata().state_dict_metadata
        if dp_sync is not None and "dp_sync.setting" in saved_keys:
            everything["dp_sync"] = {"setting": None}
        _dcp().load(everything, checkpoint_id=path)
    except BaseException as e:  # DCP's CheckpointException is a BaseException: its ranks' errors, said here
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failures = getattr(e, "failures", {})   # rank -> (exception, traceback)
        causes = [(f"rank {r}: ", f[0]) for r, f in sorted(failures.items())] or [("", e)]
        why = "; ".join(f"{who}{type(c).__name__}" + (f": {str(c).splitlines()[0][:200]}" if str(c).strip() else "")
                        for who, c in causes)
        raise RunError(f"the checkpoint of step {step} ({path}) cannot be read ({why}); move it away and resume "
                       "from an earlier one") from e
    if int(meta["step"]) != step:
        raise RunError(f"checkpoint {path!r} says step {int(meta['step'])}")
    opt_states: dict[nn.Parameter, dict] = {}
    with torch.no_grad():
        for name, (p, layer, attr) in owners.items():
            p.copy_(_shard(state[replica + name], layer, attr))
            opt_states[p] = {"step": state[f"{replica}{name}.step"].reshape(()).clone(),
                             **{m: _shard(state[f"{replica}{name}.{m}"], layer, attr).to(p.device)
                                for m in _MOMENTS}}
    if isinstance(optimizer, ZeroOneOptimizer):
        optimizer.load_full_state(opt_states)
    else:
        for p, st in opt_states.items():
            optimizer.state[p] = st
    if dp_sync is not None:
        saved = everything["dp_sync"]["setting"] if "dp_sync" in everything else None
        _restore_dp_sync(dp_sync, path, saved, step, next(stage.parameters()).device)
    if outer_saved:
        outer.state.load_state_dict(_load_rank_state(path, "outer", outer.rank_key, next(stage.parameters()).device))
    elif outer is not None:   # a checkpoint of plain DP: DiLoCo starts from it, as DiLoCo starts from a pretrained model
        outer.state.start_from_parameters()
        if dist.get_rank() == 0:
            _note(f"resume: the checkpoint of step {step} holds no DiLoCo state (saved without --inner-steps): "
                  "DiLoCo starts from its parameters, with zero outer momentum, its first outer step "
                  f"--inner-steps after step {step}")
    return step


def _refuse_other_outer(path: str, step: int, outer: OuterSync | None) -> bool:
    """Whether the checkpoint at ``path`` holds DiLoCo state; RunError on every rank if it does and this run has
    no ``outer`` or another setting. Collective (a DCP load of the setting) when both have it. A checkpoint
    without DiLoCo state (plain DP: every replica alike) loads into a DiLoCo run.

    Why refuse rather than reshard: between outer steps the DP replicas hold different parameters and Adam
    states, and the residuals are each rank's own; another DP degree has no replica to give them to, and
    resuming plain DP from one of them would drop the others' inner steps.
    """
    try:
        saved_keys = _dcp().FileSystemReader(path).read_metadata().state_dict_metadata
    except BaseException:   # noqa: BLE001 -- an unreadable checkpoint is reported by the load that follows
        return False
    saved = None
    if "outer.setting" in saved_keys:
        holder = {"outer": {"setting": None}}
        if outer is not None:
            _dcp().load(holder, checkpoint_id=path)
            saved = holder["outer"]["setting"]
        else:
            saved = "?"
    mine = None if outer is None else outer.setting
    if saved is None or saved == mine:
        return saved is not None
    where = f"--resume: the checkpoint of step {step} ({path})"
    if mine is None:
        raise RunError(f"{where} was saved with DiLoCo over DP (--inner-steps), whose DP replicas hold different "
                       "parameters between outer steps; resume it with the flags it was saved with (its "
                       "manifest.json lists them), or start afresh in another --ckpt-dir")
    raise RunError(f"{where} holds the DiLoCo state of [{saved}]; this run is [{mine}]. The replicas' parameters, "
                   "Adam states and outer state are per DP replica and rank, and do not map onto another layout "
                   "or outer setting: resume with the checkpoint's flags")


# ---- the run's directory: lock, resume, saves, preemption ------------------------------------------------

_preempted_at: int | None = None


def preempted_at() -> int | None:
    """The step after which this process's last run saved and stopped on a preemption signal (None: it did not)."""
    return _preempted_at


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RunDirectory:
    """``--ckpt-dir`` for one run of ``opts`` (train.Options): its lock, its resume, its saves, its signals.

    A context manager that every rank of the world enters (collective: rank 0 decides, every rank learns the
    same, and raises the same :class:`RunError`). On entry, with a directory: take its lock (``fcntl.flock`` on
    :data:`LOCK`, which the kernel releases when the holder dies: a live run's directory is refused, a dead
    run's is not); refuse ``step_<digits>`` folders this script did not write (:func:`foreign`), and a directory
    that is itself a checkpoint; without ``--resume`` refuse checkpoints already there unless ``--overwrite``,
    which deletes them and says so; with ``--resume`` pick the newest checkpoint whose files :func:`verify`
    (saying which were skipped and why; refusing, naming each, when checkpoints exist and none verifies; one
    without manifest but with DCP's ``.metadata`` is loaded unverified, with a note) and refuse it if it holds
    another model (naming the fields). Then :data:`PREEMPTION_SIGNALS` are caught until exit.

    (``flock`` holds across nodes on NFS, where Linux maps it to a POSIX lock; Lustre needs its ``flock`` mount
    option.)

    Per step, :meth:`end_of_step` stops the run at the first non-finite loss (the chosen behaviour: stop, not
    skip the step) and saves every ``--ckpt-every`` steps, or at once when any rank got a preemption signal,
    after which the run stops; with ``--ckpt-every`` also after the last step. Without a directory it only
    checks the loss (no collective, no handlers).
    """

    def __init__(self, opts):
        self.opts, self.dir = opts, opts.ckpt_dir
        self.path: str | None = None   # the checkpoint to resume from
        self._lock = None
        self._signal = 0
        self._handlers: dict = {}

    def __enter__(self) -> RunDirectory:
        global _preempted_at
        _preempted_at = None
        if self.dir is None:
            return self
        verdict: tuple[str, str | None] = ("ok", None)
        if dist.get_rank() == 0:
            try:
                verdict = ("ok", self._decide())
            except (RunError, OSError) as e:
                verdict = ("error", str(e) if isinstance(e, RunError) else f"--ckpt-dir {self.dir}: {e}")
        kind, value = gather(verdict)[0]
        if kind == "error":
            self._release()
            raise RunError(value)
        self.path = value
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self._handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._release()

    def _on_signal(self, signum, frame) -> None:
        self._signal = self._signal or signum   # a second signal changes nothing; SIGKILL still ends the run

    def _release(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def _take_lock(self) -> None:
        f = open(os.path.join(self.dir, LOCK), "a+", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "which has not said who it is"
            f.close()
            raise RunError(f"--ckpt-dir {self.dir} is in use by another run ({holder}); two runs in one directory "
                           "overwrite each other's steps. Wait for it to end, or use another --ckpt-dir") from None
        f.seek(0)
        f.truncate()
        since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n")
        f.flush()
        self._lock = f

    def _decide(self) -> str | None:
        """Rank 0: take the lock, then the checkpoint to resume from (None: start at step 0), or RunError."""
        if is_checkpoint(self.dir) and os.listdir(self.dir):
            raise RunError(f"--ckpt-dir {self.dir} is a checkpoint, not the directory of a run's checkpoints; pass "
                           f"its parent: --ckpt-dir {os.path.dirname(os.path.normpath(self.dir)) or '.'}")
        os.makedirs(self.dir, exist_ok=True)
        self._take_lock()
        found, others = checkpoints(self.dir), foreign(self.dir)
        if others:
            raise RunError(f"--ckpt-dir {self.dir} holds {', '.join(others)}, named like checkpoints but holding "
                           "what this script does not write; it deletes and overwrites only its own. Move them "
                           "away, or use another --ckpt-dir")
        steps = ", ".join(str(s) for s, _ in found)
        if not self.opts.resume:
            if found and not self.opts.overwrite:
                raise RunError(f"--ckpt-dir {self.dir} holds checkpoints of an earlier run (steps {steps}); continue "
                               "it with --resume, or pass --overwrite to delete them and start afresh")
            for _, path in found:
                shutil.rmtree(path)
            if found:
                _note(f"overwrite: deleted the checkpoints of an earlier run in {self.dir} (steps {steps})")
            return None
        damaged = []
        for step, path in reversed(found):
            manifest, problem = verify(path)
            if problem is None:
                self._check_config(manifest["config"] or {}, step)
                for line in damaged:
                    _note(f"resume: skipping the checkpoint of {line}")
                return path
            if not os.path.exists(os.path.join(path, MANIFEST)) and os.path.exists(os.path.join(path, ".metadata")):
                for line in damaged:   # DCP writes .metadata last: a finished save, from before manifests
                    _note(f"resume: skipping the checkpoint of {line}")
                _note(f"resume: note: the checkpoint of step {step} ({path}) has no {MANIFEST} (saved before "
                      "manifests, or the manifest was lost) but DCP's .metadata: loading it without verifying")
                return path
            damaged.append(f"step {step} ({path}): {problem}")
        if any(os.path.exists(os.path.join(p, f)) for _, p in found for f in (MANIFEST, ".metadata")):
            raise RunError(f"--resume: no checkpoint in {self.dir} can be loaded: " + "; ".join(damaged) +
                           ". Move them away (or pass --overwrite without --resume to start afresh)")
        for line in damaged:   # only unfinished saves, or none: nothing was ever confirmed, so start afresh
            _note(f"resume: skipping the checkpoint of {line}")
        return None

    def _check_config(self, saved: dict, step: int) -> None:
        """RunError naming the fields if the checkpoint's model is not this run's; a note for training settings."""
        mine = run_config(self.opts)
        theirs = saved.get("model", {})
        differ = [f"{k} {theirs.get(k)} there, {v} here" for k, v in mine["model"].items() if theirs.get(k) != v]
        if differ:
            raise RunError(f"--resume: the checkpoint of step {step} in {self.dir} holds another model "
                           f"({'; '.join(differ)}); resume with its model flags, or start afresh in another "
                           "--ckpt-dir")
        run = saved.get("run", {})
        changed = [f"{k} {run[k]} -> {mine['run'][k]}" for k in _TRAINING_SETTINGS
                   if k in run and run[k] != mine["run"][k]]
        if changed:
            _note(f"resume: note: this run changes training settings of the checkpoint: {', '.join(changed)}")

    def resume(self, trainer) -> int:
        """Load the chosen checkpoint into ``trainer`` (train.Trainer; every rank calls it); the step to start at."""
        if not self.opts.resume:
            return 0
        start = 0 if self.path is None else 1 + load(self.path, trainer.model, trainer.stage, trainer.optimizer,
                                                      trainer.full_shapes, trainer.dp_sync, trainer.outer_sync)
        if dist.get_rank() == 0:
            steps = self.opts.steps
            _note(f"resume: no checkpoint in {self.dir!r}, starting at step 0" if start == 0 else
                  f"resume: from the checkpoint of step {start - 1} in {self.dir!r}" +
                  (f"; it already reaches --steps {steps}: nothing to do" if start >= steps else ""))
        return start

    def end_of_step(self, step: int, loss: float, trainer) -> bool:
        """After step ``step`` (every rank, the same ``loss``): RunError if it is not finite; save if due or if
        a rank got a preemption signal (one AllReduce a step, with a directory); True: stop now."""
        if not math.isfinite(loss):
            raise RunError(f"step {step}: the training loss is {loss}; stopping at the first non-finite loss, with "
                           "nothing saved from this step on (lower --lr, or resume from an earlier checkpoint)")
        if self.dir is None:
            return False
        got = torch.tensor([self._signal], dtype=torch.int64, device=group_device(None))
        dist.all_reduce(got, op=dist.ReduceOp.MAX)   # every rank stops at the same boundary
        signum = int(got.item())
        every = self.opts.ckpt_every
        if signum or (every and ((step + 1) % every == 0 or step == self.opts.steps - 1)):   # and the last step
            path = save(self.dir, step, trainer.model, trainer.stage, trainer.optimizer, trainer.dp_sync,
                        run_config(self.opts), trainer.outer_sync)
            if signum and dist.get_rank() == 0:
                _note(f"preempted: {signal.Signals(signum).name} received; saved the checkpoint of step {step} "
                      f"({path}) and stopping; continue with --resume")
        if signum:
            global _preempted_at
            _preempted_at = step
        return bool(signum)
