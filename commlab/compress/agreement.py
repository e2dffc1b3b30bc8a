"""What every rank must agree on before compressed payloads are combined: finiteness, and payload layout.

Both checks are one small collective each, and both raise the *same* error on every rank, so that no rank
waits in a later collective for a peer that has already given up, and training code can skip a step on all
ranks at once. :func:`commlab.compress.aggregate.aggregate` (every path), the two-phase AllReduce
(:mod:`commlab.compress.two_phase`) and the DDP ``compression_hook`` use them.
"""

from __future__ import annotations

import torch

from commlab.collectives.agreement import agree, gather
from commlab.compress.base import Payload, all_finite

__all__ = ["agree_finite", "agree_payloads", "describe_payload"]


def describe_payload(payload: Payload, compressor_name: str) -> tuple:
    """What must be identical on every rank for the payloads to be combined (picklable, small): the
    compressor's name, the tensor's shape and dtype, each payload tensor's name, element count and dtype,
    and the meta."""
    tensors = tuple((name, t.numel(), str(t.dtype).replace("torch.", "")) for name, t in payload.tensors.items())
    meta = tuple(sorted((str(k), repr(v)) for k, v in payload.meta.items()))
    return (compressor_name, tuple(payload.shape), str(payload.dtype).replace("torch.", ""), tensors, meta)


def agree_payloads(payload: Payload, compressor_name: str, group, size: int, what: str = "aggregate") -> None:
    """One small all-gather of each rank's :func:`describe_payload`; on a mismatch every rank raises the same
    :class:`~commlab.collectives.CollectiveMismatchError`, naming what each rank passed.

    Args:
        payload: this rank's payload. compressor_name: its compressor's name. group, size: the process group
        and its size (1: nothing to check). what: the caller, for the message.
    """
    if size == 1:
        return

    def differ(everyone: list) -> str | None:
        if len(set(everyone)) == 1:
            return None
        lines = "; ".join(
            f"rank {r}: {d[0]} of shape {list(d[1])} {d[2]}, payload "
            + ", ".join(f"{name}={numel}x{dt}" for name, numel, dt in d[3])
            + (f", meta {{{', '.join(f'{k}: {v}' for k, v in d[4])}}}" if d[4] else "")
            for r, d in enumerate(everyone))
        return (f"the ranks' payloads differ ({lines}). Every rank must compress a tensor of the same shape and "
                "dtype with the same compressor settings (and, for Random-K, call it the same number of times); "
                "payloads whose sizes depend on the data (topk_global) cannot be aggregated this way")

    agree(what, describe_payload(payload, compressor_name), group, differ=differ)


def agree_finite(tensor: torch.Tensor, group, what: str) -> None:
    """Raise the same ``FloatingPointError`` on every rank if any rank's ``tensor`` holds a NaN or an inf.

    One tiny collective before compressing. Without it the rank with the bad gradient raises alone while
    its peers wait in the next collective, or, if the caller skips the step there only, the ranks drift
    one step apart and sum different steps' gradients without any error.
    """
    flags = [row[0] for row in gather([int(not all_finite(tensor))], group, ints=True)]
    if any(flags):
        ranks = [r for r, f in enumerate(flags) if f]
        raise FloatingPointError(f"{what}: rank(s) {ranks} hold NaN or infinite gradient values; nothing was "
                                 "sent. Every rank raises this, so all can skip the step together")
