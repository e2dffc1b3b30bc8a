"""The point-to-point layer every hand-written collective uses.

Two reasons to route every message through here instead of calling ``dist.isend`` directly: an empty
tensor is not sent at all (both neighbours compute the same empty size and skip the message together),
and an :class:`~commlab.topology.EmulatedTopology`, when given, delays each message as the emulated link
would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.topology.emulated import EmulatedTopology


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None,
          emulate: EmulatedTopology | None = None):
    """Start sending ``tensor`` to global rank ``dst``; returns a request, or None for an empty tensor."""
    if tensor.numel() == 0:
        return None
    if emulate is not None:
        emulate.wait_before_send(dist.get_rank(), dst, tensor.numel() * tensor.element_size())
    return dist.isend(tensor, dst=dst, group=group)


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None):
    """Start receiving into ``tensor`` from global rank ``src``; returns a request, or None if empty."""
    if tensor.numel() == 0:
        return None
    return dist.irecv(tensor, src=src, group=group)


def wait(*requests) -> None:
    """Wait for every request (None entries are skipped)."""
    for req in requests:
        if req is not None:
            req.wait()
