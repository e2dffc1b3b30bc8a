"""The errors both doors of :mod:`commlab.launch` raise, and how a peer's reaction to a failure is recognised."""

from __future__ import annotations

from typing import Mapping, Sequence

from commlab.launch.inflight import ADVICE, UnfinishedSends, describe_unfinished

__all__ = ["LaunchError", "RankError", "LaunchTimeout", "is_peer_fallout", "is_collective_timeout"]


class LaunchError(RuntimeError):
    """Base class of the errors :func:`commlab.launch.launch` raises after processes have started."""


class RankError(LaunchError):
    """A rank raised an exception or exited without returning.

    Attributes:
        rank: the failing rank (global rank in ``range(world_size)``).
        world_size: number of ranks launched.
        exc_type: name of the exception type raised in that rank (``"SystemExit"``/``"exit code N"``
            for a rank that exited without raising).
        exc_message: ``str()`` of that exception.
        remote_traceback: the traceback text formatted in that rank.
        outputs: captured output of every rank, in rank order (forked ranks only; empty under torchrun).
    """

    def __init__(self, rank: int, world_size: int, exc_type: str, exc_message: str,
                 remote_traceback: str, outputs: Sequence[str] = ()):
        self.rank = rank
        self.world_size = world_size
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.outputs = list(outputs)
        text = f"rank {rank} of {world_size} failed with {exc_type}: {exc_message}"
        if remote_traceback:
            text += f"\n\n--- traceback in rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class LaunchTimeout(LaunchError, TimeoutError):
    """The launch did not finish within its timeout.

    Attributes:
        world_size, timeout_s: as passed to :func:`commlab.launch.launch`.
        joined: ranks that reached the rendezvous.
        finished: ranks that returned a value.
        running: ranks that had not delivered a result when the deadline passed (they are terminated),
            including those in ``unfinished_sends``.
        unfinished_sends: ``{rank: [UnfinishedSends, ...]}`` for the ranks whose function had returned but
            whose sends had not completed: they were waiting for their sends, not computing.
    """

    def __init__(self, world_size: int, timeout_s: float, joined: Sequence[int],
                 finished: Sequence[int], outputs: Sequence[str] = (),
                 unfinished_sends: Mapping[int, Sequence[UnfinishedSends]] | None = None):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.joined = sorted(joined)
        self.finished = sorted(finished)
        self.running = [r for r in range(world_size) if r not in set(finished)]
        self.outputs = list(outputs)
        self.unfinished_sends = {r: list(s) for r, s in sorted((unfinished_sends or {}).items())
                                 if r not in set(finished)}
        missing = [r for r in range(world_size) if r not in set(joined)]
        if self.unfinished_sends:
            named = "; ".join(describe_unfinished(r, s) for r, s in self.unfinished_sends.items())
            others = [r for r in self.running if r not in self.unfinished_sends]
            many = sum(u.count for sends in self.unfinished_sends.values() for u in sends) > 1
            text = (f"launch timed out after {timeout_s:g} s: {named}, and {'they' if many else 'it'} had not "
                    f"completed by the deadline: {ADVICE}")
            if others:
                text += f". Ranks {others} were still running their function (finished: {self.finished})"
        elif missing:
            text = (f"launch timed out after {timeout_s:g} s: {len(self.joined)} of {world_size} ranks "
                    f"reached the rendezvous (joined: {self.joined}; never joined: {missing})")
        else:
            text = (f"launch timed out after {timeout_s:g} s: all {world_size} ranks joined, "
                    f"ranks {self.running} were still running (finished: {self.finished}). A rank that "
                    "skips a collective its peers call, or a loop that never ends, looks like this; "
                    "pass a larger timeout= if the work is simply long")
        super().__init__(text)


_PEER_FALLOUT = ("connection closed by peer", "connection reset by peer", "broken pipe",
                 "read error", "write error", "socket closed", "connection refused")


def is_peer_fallout(message: str) -> bool:
    """Whether an error message is a rank's reaction to a peer's death ("connection closed by peer", ...)
    rather than a failure of its own."""
    low = message.lower()
    return any(p in low for p in _PEER_FALLOUT)


# gloo: "Timed out waiting 3000ms for recv operation to complete"; NCCL (TORCH_NCCL_BLOCKING_WAIT): "... ran for
# 3000 milliseconds before timing out"; a store: "wait timeout after 3000ms".
_TIMED_OUT = ("timed out waiting", "before timing out", "wait timeout")


def is_collective_timeout(message: str) -> bool:
    """Whether an error message is a collective (or store wait) that gave up at its timeout: the rank waited for
    peers that never came, which says nothing about why they did not."""
    low = message.lower()
    return any(p in low for p in _TIMED_OUT)
