"""Sends still in flight when a rank's function returns: delivered, or named with rank, destination and bytes."""

import time

import pytest
import torch
import torch.distributed as dist

from commlab import LaunchTimeout, launch
from commlab.launch.inflight import UnfinishedSends, active_tracker, describe_unfinished
from tests.helpers import child_pids


def _send_and_drop_the_handle():
    # Rank 0 drops its request and returns; rank 1 posts its receive only after that (the barrier orders the
    # two). Under gloo the message went with the dropped request, and rank 1 waited in recv until the
    # deadline, when the launcher blamed rank 1.
    if dist.get_rank() == 0:
        dist.isend(torch.arange(1000, dtype=torch.float32), 1)
        dist.barrier()
        return "sent"
    dist.barrier()
    x = torch.empty(1000)
    dist.recv(x, 0)
    return x.sum().item()


def test_a_send_whose_handle_was_dropped_is_delivered():
    assert launch(_send_and_drop_the_handle, 2, timeout=20) == ["sent", float(sum(range(1000)))]
    assert child_pids() == []


def _batch_send_and_drop_the_handles():
    # The same through batch_isend_irecv (what the grouped point-to-point exchange is built on).
    if dist.get_rank() == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((10,), 3.0), 1),
                                dist.P2POp(dist.isend, torch.full((5,), 4.0), 1)])
        dist.barrier()
        return "sent"
    dist.barrier()
    a, b = torch.empty(10), torch.empty(5)
    for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, a, 0), dist.P2POp(dist.irecv, b, 0)]):
        req.wait()
    return a.sum().item() + b.sum().item()


def test_sends_of_a_batch_whose_handles_were_dropped_are_delivered():
    assert launch(_batch_send_and_drop_the_handles, 2, timeout=20) == ["sent", 50.0]


def _send_nobody_receives():
    if dist.get_rank() == 0:
        dist.isend(torch.ones(1000), 1)                      # 4000 bytes
        dist.isend(torch.ones(3, dtype=torch.float64), 1)    # 24 bytes
        dist.isend(torch.ones(2, dtype=torch.int16), 2)      # 4 bytes
    return dist.get_rank()


@pytest.mark.timing
@pytest.mark.slow
def test_sends_never_received_are_named_with_rank_destination_and_bytes():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_send_nobody_receives, 3, timeout=4)
    err = info.value
    assert err.unfinished_sends == {0: [UnfinishedSends(dst=1, count=2, nbytes=4024),
                                        UnfinishedSends(dst=2, count=1, nbytes=4)]}
    text = str(err)
    assert "rank 0 returned with 3 sends still in flight: 2 to rank 1 (4024 bytes), 1 to rank 2 (4 bytes)" in text
    assert "matching irecv/recv" in text
    assert err.finished == [1, 2]  # the receivers returned: they are not the ones to blame
    assert time.monotonic() - start < 20
    assert child_pids() == []


def _hold_handles_and_wait_later(n):
    # More sends in flight than the tracker's first prune (64), all held by the caller and waited at the end:
    # the tracker must not wait on any of them itself (two waits on one gloo send would hang the second).
    if dist.get_rank() == 0:
        reqs = [dist.isend(torch.full((4,), float(i)), 1) for i in range(n)]
        for r in reqs:
            r.wait()
        return active_tracker().pending()
    got = torch.empty(4)
    total = 0.0
    for _ in range(n):
        dist.recv(got, 0)
        total += got[0].item()
    return total


def test_handles_held_by_the_caller_are_left_to_the_caller():
    assert launch(_hold_handles_and_wait_later, 2, 200, timeout=30) == [0, float(sum(range(200)))]


def _many_sends(n):
    # Long runs: waited sends are dropped by the tracker; dropped-but-delivered ones too, as they complete.
    rank, t, ack = dist.get_rank(), torch.ones(8), torch.zeros(1)
    for i in range(n):
        if rank == 0:
            if i % 2:
                dist.send(t, 1)            # waited (blocking)
            else:
                dist.isend(t, 1)           # handle dropped at once
            dist.recv(ack, 1)              # at most one message in flight
        else:
            dist.recv(t, 0)
            dist.send(ack, 0)
    tracker = active_tracker()
    for _ in range(200):                   # the last dropped one may still be on its way
        if tracker.pending() == 0:
            break
        time.sleep(0.01)
    return tracker.recorded, tracker.pending()


@pytest.mark.slow
def test_completed_handles_do_not_accumulate():
    (sent0, left0), (sent1, left1) = launch(_many_sends, 2, 1000, timeout=60)
    assert sent0 == 1000 and sent1 == 1000  # every send was seen (rank 1's are the acks) ...
    assert left0 == 0 and left1 == 0        # ... and none is kept once complete


def test_describe_unfinished():
    assert describe_unfinished(3, [UnfinishedSends(0, 1, 12)]) == \
        "rank 3 returned with 1 send still in flight: 1 to rank 0 (12 bytes)"
