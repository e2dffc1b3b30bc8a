"""The mean of a flat tensor over a group, dense or compressed: the one averaging step of :mod:`commlab.sync`.

:func:`mean_over_group` rides commlab's ring AllReduce (dense) or :func:`commlab.compress.aggregate` (a compressor,
with error feedback), so that an :class:`~commlab.topology.EmulatedTopology` can delay it and its bytes are counted
the way chapter 4 counts them. :func:`flatten` and :func:`unflatten_into` move a group of parameters to and from
one flat buffer.

Book: chapter 8b, §8b.1–§8b.3 (the averaging behind each sync).
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives import ring_all_reduce, ring_bytes_sent_per_rank
from commlab.collectives.agreement import gather
from commlab.collectives.common import group_size_and_rank
from commlab.compress.aggregate import aggregate
from commlab.compress.base import all_finite
from commlab.compress.error_feedback import ErrorFeedback
from commlab.topology.emulated import EmulatedTopology

__all__ = ["Mean", "mean_over_group", "flatten", "unflatten_into", "check_params", "check_emulate", "bits_checksum",
           "agree_before_sync"]


class Mean(NamedTuple):
    """What :func:`mean_over_group` returns: the mean (the input's shape and dtype), the bytes this rank sent, its
    payload's bytes, and the path (``"all_reduce"``, ``"all_gather"`` or ``"two_phase"``)."""

    mean: torch.Tensor
    bytes_sent_per_rank: float
    payload_nbytes: int
    path: str


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new flat tensor holding ``tensors`` one after another, on their device.

    Mixed dtypes (bf16 weights beside fp32 norms) are promoted to one (``torch.promote_types``: bf16 and fp32
    give fp32), as ``torch.cat`` in torch's ``average_parameters`` does; :func:`unflatten_into` views and
    ``copy_`` cast each part back to its tensor's dtype.
    """
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def check_params(params: Sequence[torch.Tensor], where: str) -> None:
    """Refuse what cannot be averaged as parameters: a non-floating-point tensor (a mean of integers would be
    truncated when copied back) and one tensor (or two views of one storage) listed twice (it would be stepped
    and mixed twice). Zero-element tensors pass (they send nothing).

    Raises:
        ValueError: naming ``params``, the index and the offending dtype or the earlier index.
    """
    seen: dict = {}
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            checks.fail("params", getattr(p, "dtype", type(p).__name__), "floating-point tensors", where=where,
                        note=f"tensor {i}: an integer or bool buffer is not averaged as a parameter")
        if p.numel() == 0:
            continue
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), tuple(p.stride()))
        if key in seen:
            checks.fail("params", f"tensor {i}", f"each tensor once (it repeats tensor {seen[key]})", where=where,
                        note="a tied parameter would be updated twice; pass it once")
        seen[key] = i


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``tensors`` (which ``flat`` was built from by :func:`flatten`)."""
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def bits_checksum(tensors: Sequence[torch.Tensor]) -> int:
    """An exact integer checksum of the tensors' bits (the sum of their elements read as integers of their width,
    modulo 2^62): equal tensors give equal sums on any device, in any summation order."""
    total = 0
    for t in tensors:
        if t.numel():
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
            total += int(t.detach().reshape(-1).view(bits).sum(dtype=torch.int64))
    return total % (1 << 62)


def agree_before_sync(tensor: torch.Tensor, group: dist.ProcessGroup | None, where: str, steps: int,
                      checksum: int = 0, what: str = "checksums") -> None:
    """One small AllGather before a sync; every rank raises the same error if any rank's ``tensor`` holds a NaN or
    an inf (FloatingPointError, naming the ranks), or if the ranks' ``steps`` or ``checksum`` differ (RuntimeError:
    a state loaded, or a step taken, on some ranks only; they would otherwise drift apart without a word).
    Nothing is sent when it raises, so every rank can skip the step together."""
    rows = gather([int(not all_finite(tensor)), int(steps), int(checksum)], group, ints=True)
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        raise FloatingPointError(f"{where}: rank(s) {bad} hold NaN or infinite values; nothing was sent. "
                                 "Every rank raises this, so all can skip the step together")
    for i, name in ((1, "step counts"), (2, what)):
        if len({row[i] for row in rows}) > 1:
            raise RuntimeError(f"{where}: the group ranks' {name} differ: {[row[i] for row in rows]}; a state "
                               "loaded or a step taken on some ranks only? Load the same checkpoint on all")


def check_emulate(emulate: EmulatedTopology | None, group: dist.ProcessGroup | None, where: str) -> None:
    """Refuse an emulated topology that does not place every rank of ``group`` (messages name global ranks).

    Raises:
        ValueError: naming ``emulate``, its world size and the group's global ranks (on every member alike).
    """
    if emulate is None:
        return
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if max(ranks) >= emulate.world_size:
        checks.fail("emulate", emulate, f"a topology of more than {max(ranks)} ranks (it places ranks "
                    f"0..{emulate.world_size - 1}; the group spans global ranks {sorted(ranks)})", where=where)


def mean_over_group(flat: torch.Tensor, group: dist.ProcessGroup | None = None, *, compressor=None,
                    error_feedback: ErrorFeedback | None = None, key: Hashable | None = None,
                    emulate: EmulatedTopology | None = None, path: str = "auto",
                    server_error_feedback: ErrorFeedback | None = None) -> Mean:
    """The mean over ``group`` of every rank's ``flat``, and the bytes this rank sent.

    Dense (``compressor`` None): ``flat / N`` (a new tensor) is summed in place by commlab's ring AllReduce, dividing
    before the sum as torch's ``average_parameters`` and DDP's default hook do; ``2 (N-1)/N × nbytes`` sent.
    Compressed: :func:`commlab.compress.aggregate` (its path and byte count), the sum divided by N after.

    Args:
        flat: a 1-D floating-point tensor of the same size and dtype on every rank.
        compressor, error_feedback, key, emulate, path, server_error_feedback: as
            :func:`commlab.compress.aggregate` (``path="two_phase"``: the two-phase compressed AllReduce).

    Returns:
        :class:`Mean`: ``(mean, bytes_sent_per_rank, payload_nbytes, path)``.

    Raises:
        FloatingPointError: (compressed) a NaN/Inf on any rank, on every rank. Others: as ``aggregate``.
    """
    n, _ = group_size_and_rank(group, "mean_over_group")
    if compressor is None:
        buf = flat / n
        ring_all_reduce(buf, group, inplace=True, check=False, emulate=emulate)
        nbytes = flat.numel() * flat.element_size()
        return Mean(buf, ring_bytes_sent_per_rank(nbytes, n, "all_reduce"), nbytes, "all_reduce")
    out = aggregate(flat, compressor, group, error_feedback=error_feedback, key=key, emulate=emulate, path=path,
                    server_error_feedback=server_error_feedback)
    return Mean(out.sum.div_(n), out.bytes_sent_per_rank, out.payload_nbytes, out.path)
