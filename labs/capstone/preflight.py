"""The capstone's command line, checked before anything runs: what would fail later is a usage error now.

A layout that does not fit the model, a compressor with no replica to send to, a log file in a missing
directory, a checkpoint directory that cannot be created or written: ``train.py`` refuses them at once (exit
2), naming the flag and the numbers, rather than after a process group, a training run or a profile. Entry
points: :func:`check` (the options alone) and :func:`check_world` (against the launcher's world, before any
process group exists).
"""

from __future__ import annotations

import math
import os

import torch

from commlab.experiments.corpus import load_corpus
from commlab.experiments.methods import parse_spec

from labs.capstone.model import check_layout

__all__ = ["check", "check_world"]


def check(opts) -> None:
    """Raise ValueError, naming the flag, for what would fail later in a run of ``opts`` (train.Options)."""
    for name, least in (("micro_batch", 1), ("micro_batches", 1), ("steps", 1), ("eval_every", 0),
                        ("ckpt_every", 0)):
        if getattr(opts, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(opts, name)}")
    if not (math.isfinite(opts.lr) and opts.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {opts.lr}")
    if (opts.ckpt_every or opts.resume or opts.overwrite) and not opts.ckpt_dir:
        raise ValueError("--ckpt-every and --resume need --ckpt-dir (and so does --overwrite)")
    if opts.resume and opts.overwrite:
        raise ValueError("--resume continues the checkpoints in --ckpt-dir and --overwrite deletes them: pass one")
    if opts.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs CUDA GPUs and torch sees none here; use --backend gloo (the "
                         "default without CUDA)")
    parse_spec(opts.compressor)
    if opts.compressor != "dense" and opts.dp < 2:
        raise ValueError(f"--compressor {opts.compressor} compresses the DP dimension, and --dp {opts.dp} has no "
                         "other replica to send to; use --dp 2 or more, or --compressor dense")
    if opts.dp_impl == "ddp" and (opts.pp != 1 or opts.compressor != "dense"):
        raise ValueError("--dp-impl ddp runs with --pp 1 and --compressor dense only (DDP's backward cannot be "
                         "driven by a pipeline schedule, and the compressors are commlab's hooks)")
    _check_outer(opts)
    _check_paths(opts)
    corpus = load_corpus()
    longest = min(len(corpus.train), len(corpus.val)) - 2
    if opts.model.seq > longest:
        raise ValueError(f"--seq {opts.model.seq} is longer than the held-out split allows ({longest} tokens)")
    check_layout(opts.model, opts.tp, opts.pp, opts.dp)


#: The outer step's flags and their defaults: each needs --inner-steps.
OUTER_FLAGS = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "fragments": 1, "sync_delay": 0,
               "mixing": 0.0, "outer_compressor": "dense"}


def _check_outer(opts) -> None:
    """DiLoCo over DP (``--inner-steps``): its flags in range, and nothing that assumes a per-step AllReduce."""
    if opts.inner_steps is None:
        given = [name for name, default in OUTER_FLAGS.items() if getattr(opts, name) != default]
        if given:
            flag = "--no-nesterov" if given[0] == "nesterov" else "--" + given[0].replace("_", "-")
            raise ValueError(f"{flag} sets DiLoCo's outer step, which runs only with --inner-steps H")
        return
    h = opts.inner_steps
    if h < 1:
        raise ValueError(f"--inner-steps must be >= 1 (local steps between outer steps), got {h}")
    if opts.dp < 2:
        raise ValueError(f"--inner-steps {h} syncs the DP replicas every {h} steps, and --dp {opts.dp} has no other "
                         "replica; use --dp 2 or more")
    if opts.compressor != "dense":
        raise ValueError(f"--compressor {opts.compressor} compresses the per-step gradient AllReduce, which "
                         "--inner-steps replaces by the outer step; compress that one with --outer-compressor")
    if opts.zero1:
        raise ValueError("--zero1 shards Adam's state over DP, but with --inner-steps each DP replica steps its own "
                         "Adam on its own gradients; drop one of them")
    if opts.dp_impl != "commlab":
        raise ValueError(f"--dp-impl {opts.dp_impl} averages gradients every step; --inner-steps runs with "
                         "--dp-impl commlab")
    if not (math.isfinite(opts.outer_lr) and opts.outer_lr > 0):
        raise ValueError(f"--outer-lr must be a finite number > 0, got {opts.outer_lr}")
    if not 0 <= opts.outer_momentum < 1:
        raise ValueError(f"--outer-momentum must be in [0, 1), got {opts.outer_momentum}")
    if opts.outer_momentum == 0 and opts.nesterov:
        raise ValueError("--outer-momentum 0 needs --no-nesterov (Nesterov's step is a momentum step)")
    if not 0 <= opts.mixing <= 1:
        raise ValueError(f"--mixing must be in [0, 1], got {opts.mixing}")
    f = opts.fragments
    if f < 1 or h % f:
        raise ValueError(f"--fragments must be a divisor of --inner-steps {h} (each fragment syncs once every {h} "
                         f"steps, one every H / F steps), got {f}")
    if not 0 <= opts.sync_delay < h // f:
        raise ValueError(f"--sync-delay must be in 0..{h // f - 1} (below --inner-steps / --fragments = {h // f}: "
                         f"a fragment's sync lands before the next one's is sent), got {opts.sync_delay}")
    if opts.outer_compressor != "dense":
        try:
            kind, _ = parse_spec(opts.outer_compressor)
        except ValueError as e:
            raise ValueError(f"--outer-compressor: {e}") from None
        if kind == "powersgd":
            raise ValueError(f"--outer-compressor {opts.outer_compressor}: PowerSGD keeps per-matrix state of its "
                             "own and is not an outer compressor; use int:8, topk:RATIO, cast:bf16, ...")


def _check_paths(opts) -> None:
    """The directories and the file the run writes: each must be (or become) writable."""
    for flag, path in (("--ckpt-dir", opts.ckpt_dir), ("--profile", opts.profile)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a file, not a directory")
    for flag, path in (("--ckpt-dir", opts.ckpt_dir), ("--profile", opts.profile)):
        if path is None:
            continue
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot create it ({e.strerror})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: not writable")
    if opts.log_file is not None:
        parent = os.path.dirname(os.path.abspath(opts.log_file))
        if os.path.isdir(opts.log_file):
            raise ValueError(f"--log-file {opts.log_file} is a directory; give a file name such as "
                             f"{opts.log_file}/run.jsonl")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"--log-file {opts.log_file}: its directory {parent} does not exist or is not writable")


def check_world(opts, world_size: int) -> None:
    """Raise ValueError if ``tp x pp x dp`` is not ``world_size``, saying how to start a run of one process
    with the ranks it needs. Pure: call it before any process group exists, so every rank refuses at once."""
    try:
        check_layout(opts.model, opts.tp, opts.pp, opts.dp, world_size)
    except ValueError as e:
        if world_size > 1:
            raise
        ranks = opts.tp * opts.pp * opts.dp
        raise ValueError(f"{e} (start it with torchrun --nproc-per-node {ranks}, or under srun)") from None
