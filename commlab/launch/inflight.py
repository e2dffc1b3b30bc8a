"""Point-to-point sends still in flight when a rank's function returns: kept, delivered, or named.

Covers a gloo behaviour (torch 2.13, ``ProcessGroupGloo.cpp``): a send completes only once its receiver has
posted the matching receive, and a send whose ``Work`` is dropped is lost, leaving the receiver blocked and a
launcher blaming it. :func:`track_sends` wraps ``ProcessGroup.send``, the one method that ``isend``, ``send``
and ``batch_isend_irecv`` all reach (the module's functions cannot be wrapped: ``P2POp`` compares against
them), and keeps every send's ``Work``. After the function returns, :meth:`SendTracker.finish` delivers what is
left until the launch's deadline and names what never completes by rank, destination and bytes. A gloo send is
waited on only when nobody else holds it (two waits on one send wait for two completions), one at a time in a
background thread; NCCL sends are only polled (a ``wait()`` would order the caller's stream), and inside an
NCCL ``batch_isend_irecv`` the batch's ``Work`` (from ``_end_coalescing``) stands for its sends.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import sys
import threading
import time
from typing import Iterator, NamedTuple

import torch.distributed as dist

__all__ = ["UnfinishedSends", "SendTracker", "track_sends", "active_tracker", "describe_unfinished", "ADVICE"]

# Prune completed handles when the list reaches this length, then at twice what survived a prune: amortised
# O(1) per send, and memory bounded by twice the sends genuinely in flight. Small, because holding gloo's
# completed send requests alive slowed the ring AllReduce by a few per cent.
_PRUNE_AT = 4


@dataclasses.dataclass(frozen=True)
class UnfinishedSends:
    """Sends to one destination that had not completed.

    Attributes:
        dst: destination, as a global rank.
        count: number of sends.
        nbytes: their payload in bytes.
    """

    dst: int
    count: int
    nbytes: int


class _Entry(NamedTuple):
    work: object
    group: object
    group_dst: int
    nbytes: int
    poll_only: bool  # True: never wait() on it from here (NCCL and other device backends)


def _refs(entry: _Entry) -> int:
    return sys.getrefcount(entry.work)


# The reference count of an object held by nothing but one _Entry, measured the way _refs measures: a Work
# whose count is no higher has been dropped by its caller (nobody else can wait on it).
_ALONE = _refs(_Entry(object(), None, 0, 0, False))


def _nbytes(tensors) -> int:
    try:
        return sum(int(t.numel()) * t.element_size() for t in tensors)
    except Exception:  # noqa: BLE001 - an odd argument must not break the send itself
        return 0


def _global_rank(group, group_dst: int) -> int:
    try:
        return dist.get_global_rank(group, group_dst)
    except Exception:  # noqa: BLE001 - a group torch no longer knows: report its own numbering
        return group_dst


class SendTracker:
    """The ``Work`` of every point-to-point send issued while it is installed (see :func:`track_sends`).

    Thread-safe: sends issued from other threads (autograd hooks, a comm hook) are recorded too.

    Attributes:
        recorded: how many sends were recorded since the tracker was made.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._entries: list[_Entry] = []            # sends someone may still wait on, or NCCL sends
        self._orphans: collections.deque[_Entry] = collections.deque()  # gloo sends nobody holds any more
        self._waiting_on: _Entry | None = None       # the orphan the background thread is waiting on
        self._coalesced: dict[int, list[_Entry]] = {}  # id(group) -> NCCL sends awaiting their batch's Work
        self._poll_only: dict[int, bool] = {}
        self._next_prune = _PRUNE_AT
        self._thread: threading.Thread | None = None
        self._closed = False
        self.recorded = 0

    # -- recording (called from the wrapped ProcessGroup methods) ---------------------------------------

    def _is_poll_only(self, group) -> bool:
        key = id(group)
        if key not in self._poll_only:
            try:
                self._poll_only[key] = "gloo" not in str(dist.get_backend(group))
            except Exception:  # noqa: BLE001 - unknown: never wait on it from here
                self._poll_only[key] = True
        return self._poll_only[key]

    def _record(self, work, group, group_dst: int, nbytes: int) -> None:
        with self._cv:
            self.recorded += 1
            entry = _Entry(work, group, group_dst, nbytes, self._is_poll_only(group))
            if work is None:  # a coalesced NCCL send: its Work comes with the end of the batch
                self._coalesced.setdefault(id(group), []).append(entry)
                return
            self._entries.append(entry)
            if len(self._entries) >= self._next_prune:
                self._prune_locked()
                self._next_prune = max(_PRUNE_AT, 2 * len(self._entries))

    def _record_batch_end(self, work, group) -> None:
        with self._cv:
            sends = self._coalesced.pop(id(group), [])
            if work is not None:
                self._entries.extend(e._replace(work=work) for e in sends)

    def _prune_locked(self, all_orphans: bool = False) -> None:
        """Drop completed sends; hand gloo sends nobody holds (or, with ``all_orphans``, every gloo send) to
        the background thread."""
        keep = []
        for e in self._entries:
            if _done(e.work):
                continue
            if not e.poll_only and (all_orphans or _refs(e) <= _ALONE):
                self._orphans.append(e)
            else:
                keep.append(e)
        self._entries = keep
        if self._orphans:
            self._start_thread_locked()
            self._cv.notify_all()

    def _start_thread_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._deliver, name="commlab-send-tracker", daemon=True)
            self._thread.start()

    def _deliver(self) -> None:
        # Waits on orphaned gloo sends one at a time; the wait releases the GIL, so the rank runs on.
        while True:
            with self._cv:
                while not self._orphans and not self._closed:
                    self._cv.wait()
                if not self._orphans:
                    return
                self._waiting_on = self._orphans.popleft()
                work = self._waiting_on.work
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the send failed (its peer died, or the group timed out)
                pass
            with self._cv:
                self._waiting_on = None
                self._cv.notify_all()

    # -- reading ----------------------------------------------------------------------------------------

    def _outstanding_locked(self) -> list[_Entry]:
        return list(self._entries) + list(self._orphans) + ([self._waiting_on] if self._waiting_on else [])

    def pending(self) -> int:
        """Sends recorded and not yet completed (completed ones are dropped on the way)."""
        with self._cv:
            self._prune_locked()
            return len(self._outstanding_locked())

    def unfinished(self) -> list[UnfinishedSends]:
        """The sends not yet completed, summed per destination (global rank), in destination order."""
        with self._cv:
            self._prune_locked()
            entries = self._outstanding_locked()
        per: dict[int, list[int]] = {}
        for e in entries:
            count_bytes = per.setdefault(_global_rank(e.group, e.group_dst), [0, 0])
            count_bytes[0] += 1
            count_bytes[1] += e.nbytes
        return [UnfinishedSends(dst, c, b) for dst, (c, b) in sorted(per.items())]

    def finish(self, deadline: float) -> list[UnfinishedSends]:
        """After the rank's function returned: deliver every send it left, until ``time.monotonic()`` reaches
        ``deadline``. The function is over, so nobody else will wait on its gloo sends: all of them go to the
        background thread.

        Returns:
            What is still unfinished at the deadline (empty when everything completed).
        """
        pause = 0.001
        with self._cv:
            self._prune_locked(all_orphans=True)
        while time.monotonic() < deadline:
            with self._cv:
                self._prune_locked()
                if not self._outstanding_locked():
                    return []
                self._cv.wait(timeout=min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, 0.05)
        return self.unfinished()

    def abandon(self) -> None:
        """Give up on every gloo send still outstanding (after the deadline, when the rank is failing anyway).

        A timed-out wait makes gloo fail every pending operation of the group, the background thread's wait
        included, so that the thread ends and the process can exit cleanly (a thread still blocked in a wait
        when the interpreter shuts down aborts it). The group is unusable afterwards.
        """
        with self._cv:
            doomed = [e for e in [self._waiting_on, *self._orphans] if e is not None and not e.poll_only]
            self._orphans.clear()
            self._closed = True
            self._cv.notify_all()
        for e in doomed[:1]:  # one timed-out wait fails them all
            try:
                e.work.wait(datetime.timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - the timeout is the point
                pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def close(self) -> None:
        """Let the background thread end once it has nothing left to wait on."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def _done(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a Work that cannot say is treated as finished (it failed)
        return True


def describe_unfinished(rank: int, sends: list[UnfinishedSends]) -> str:
    """``"rank 0 returned with 2 sends still in flight: 1 to rank 1 (4000 bytes), 1 to rank 3 (12 bytes)"``."""
    total = sum(s.count for s in sends)
    parts = ", ".join(f"{s.count} to rank {s.dst} ({s.nbytes} bytes)" for s in sends)
    return f"rank {rank} returned with {total} send{'s' if total != 1 else ''} still in flight: {parts}"


#: What to do about unfinished sends, appended to the messages that name them.
ADVICE = ("every isend needs a matching irecv/recv posted on its destination, and a rank must wait for its "
          "own sends (req.wait()) before it returns")


# ---------------------------------------------------------------------------------------- installing

_install_lock = threading.Lock()
_active: SendTracker | None = None
_originals: dict[str, object] = {}


def active_tracker() -> SendTracker | None:
    """The tracker installed in this process, or None."""
    return _active


def _wrap_methods(tracker: SendTracker) -> None:
    pg_type = dist.ProcessGroup
    # The class's own attributes (pybind's method descriptors) are what is put back on restore; getattr
    # would give functions that, set back on the class, no longer bind ``self``.
    for name in ("send", "_end_coalescing"):
        if name in vars(pg_type):
            _originals[name] = vars(pg_type)[name]
    send = pg_type.send

    def tracked_send(self, tensors, dst, *args, **kwargs):
        work = send(self, tensors, dst, *args, **kwargs)
        tracker._record(work, self, dst, _nbytes(tensors))
        return work

    tracked_send.__doc__ = send.__doc__
    pg_type.send = tracked_send
    if "_end_coalescing" in _originals:
        end_coalescing = pg_type._end_coalescing

        def tracked_end_coalescing(self, *args, **kwargs):
            work = end_coalescing(self, *args, **kwargs)
            tracker._record_batch_end(work, self)
            return work

        pg_type._end_coalescing = tracked_end_coalescing


def _restore_methods() -> None:
    for name, original in _originals.items():
        setattr(dist.ProcessGroup, name, original)
    _originals.clear()


@contextlib.contextmanager
def track_sends() -> Iterator[SendTracker]:
    """Record every point-to-point send issued in this process while the context is open.

    Nested use yields the tracker already installed. On exit the ``ProcessGroup`` methods are restored; the
    tracker keeps what it holds (read it before dropping it).
    """
    global _active
    with _install_lock:
        outer = _active
        if outer is None:
            _active = SendTracker()
            _wrap_methods(_active)
        tracker = _active
    try:
        yield tracker
    finally:
        if outer is None:
            with _install_lock:
                _restore_methods()
                _active = None
            tracker.close()
