"""The grouped point-to-point exchange (commlab.collectives.p2p) on real gloo ranks, and the rule that every
message of the package goes through it."""

import ast
import pathlib
import time

import pytest
import torch
import torch.distributed as dist

from commlab import RankError, launch
from commlab.collectives import p2p
from commlab.collectives.rendezvous import Group, Message, RendezvousDeadlock, simulate_rendezvous
from commlab.topology import EmulatedTopology, Link

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "commlab"


def _two_rank_cycle():
    # Both ranks send to each other and receive from each other in one group: the pattern NCCL only
    # guarantees to progress when grouped (NVIDIA/nccl#479).
    r = dist.get_rank()
    mine = torch.arange(6, dtype=torch.float32) + 10 * r
    theirs = torch.empty(6)
    ex = p2p.exchange([(mine, 1 - r)], [(theirs, 1 - r)])
    ex.wait_recvs()
    ex.wait()
    ex.wait()  # waiting again returns at once (gloo's own receive request would block a second time)
    return theirs, ex.nbytes_sent, ex.nbytes_received, ex.count


def test_two_ranks_exchange_both_ways_in_one_group_and_waiting_twice_returns():
    (t0, sent, received, count), (t1, *_) = launch(_two_rank_cycle, 2, timeout=30)
    assert torch.equal(t0, torch.arange(6, dtype=torch.float32) + 10)
    assert torch.equal(t1, torch.arange(6, dtype=torch.float32))
    assert (sent, received, count) == (24, 24, 2)


def _ring_of_mixed_dtypes():
    r, n = dist.get_rank(), dist.get_world_size()
    a = torch.full((3,), r, dtype=torch.bfloat16)
    b = torch.full((5,), r, dtype=torch.int64)
    got_a, got_b = torch.empty(3, dtype=torch.bfloat16), torch.empty(5, dtype=torch.int64)
    ex = p2p.exchange([(a, (r + 1) % n), (b, (r + 1) % n)], [(got_a, (r - 1) % n), (got_b, (r - 1) % n)])
    ex.wait()
    return got_a.tolist(), got_b.tolist(), ex.nbytes_sent, ex.describe()


def test_several_messages_to_one_peer_match_in_order_and_bytes_come_from_the_dtypes():
    out = launch(_ring_of_mixed_dtypes, 3, timeout=30)
    for r, (got_a, got_b, sent, described) in enumerate(out):
        prev = (r - 1) % 3
        assert got_a == [prev] * 3 and got_b == [prev] * 5
        assert sent == 3 * 2 + 5 * 8  # bfloat16 and int64
        assert "send of 5 int64 (40 bytes) to rank" in described


def _empty_messages():
    r = dist.get_rank()
    ex = p2p.exchange([(torch.empty(0), 1 - r)], [(torch.empty(0), 1 - r)])
    ex.wait()
    # A group whose only non-empty message goes one way still works.
    x = torch.ones(4) * (r + 1)
    y = torch.zeros(4)
    if r == 0:
        one = p2p.exchange([(x, 1), (torch.empty(0), 1)], [(torch.empty(0, dtype=torch.int8), 1)])
    else:
        one = p2p.exchange([(torch.empty(0), 0)], [(y, 0), (torch.empty(0), 0)])
    one.wait()
    return ex.count, one.count, y.tolist()


def test_empty_tensors_are_skipped_on_both_sides():
    (c0, one0, _), (c1, one1, y1) = launch(_empty_messages, 2, timeout=30)
    assert (c0, c1) == (0, 0)
    assert (one0, one1) == (1, 1) and y1 == [1.0] * 4


def _bad_peer(kind):
    group = dist.new_group([0, 1])  # every rank creates it, as new_group requires
    t = torch.ones(2)
    if dist.get_rank() != 0:
        return None
    if kind == "not in group":
        p2p.exchange([(t, 2)], group=group)
    elif kind == "self":
        p2p.exchange([(t, 0)])
    elif kind == "not an int":
        p2p.exchange(recvs=[(t, 1.0)])
    elif kind == "out of range":
        p2p.exchange([(t, 7)])
    elif kind == "two devices":
        p2p.exchange([(t, 1)], [(torch.empty(2, device="meta"), 1)])
    return None


@pytest.mark.slow
@pytest.mark.parametrize("kind, words", [
    ("self", "rank 0 was asked to send to itself"),
    ("not an int", "receive from peer 1.0; a peer is a global rank (int)"),
    ("out of range", "send to rank 7; the world has ranks 0..2"),
    ("not in group", "global rank 2, which is not a member of the group (its global ranks: [0, 1])"),
    ("two devices", "all tensors of one group must be on one device"),
])
def test_a_bad_peer_or_mixed_devices_are_refused_before_anything_is_posted(kind, words):
    with pytest.raises(RankError) as info:
        launch(_bad_peer, 3, kind, timeout=30)
    assert info.value.rank == 0 and info.value.exc_type == "ValueError"
    assert words in info.value.exc_message


def _outsider_exchanges():
    group = dist.new_group([0, 1])
    if dist.get_rank() != 2:
        return None
    got = torch.zeros(3)
    try:
        p2p.exchange([(torch.ones(3), 0)], [(got, 1)], group=group).wait()
    except RuntimeError as e:
        return str(e), got.tolist()
    return "no error", got.tolist()


def test_a_rank_outside_the_group_is_refused_instead_of_posting_nothing():
    # torch itself only warns ("does not belong to the given group") and returns no requests, so the wait
    # "succeeds" and the receive buffer keeps its old contents.
    *_, (message, got) = launch(_outsider_exchanges, 3, timeout=30)
    assert message.startswith("rank 2 is not a member of the process group passed to exchange")
    assert "NON_GROUP_MEMBER" in message
    assert got == [0.0] * 3


def _nobody_sends():
    if dist.get_rank() == 0:
        ex = p2p.exchange(recvs=[(torch.empty(5), 1)])
        t = time.perf_counter()
        try:
            ex.wait(timeout_s=0.5)
        except RuntimeError as e:
            return str(e), time.perf_counter() - t
    return None


@pytest.mark.timing
def test_a_receive_nobody_matches_fails_at_its_deadline_naming_the_peer():
    (message, waited), _ = launch(_nobody_sends, 2, timeout=30)
    assert message.startswith("rank 0: a grouped exchange did not complete "
                              "(receive of 5 float32 (20 bytes) from rank 1)")
    assert waited < 10  # bounded by the deadline (0.5 s) plus scheduling, not the process group's timeout


def _emulated(topo):
    r = dist.get_rank()
    x = torch.zeros(250_000, dtype=torch.uint8)  # 250 kB at 5 MB/s: 50 ms on the emulated link
    t = time.perf_counter()
    if r == 0:
        p2p.exchange([(x, 1)], emulate=topo).wait()
    else:
        p2p.exchange(recvs=[(x, 0)], emulate=topo).wait()
    return time.perf_counter() - t


@pytest.mark.timing
def test_an_emulated_link_delays_the_sender_by_at_least_its_time():
    topo = EmulatedTopology(2, 1, inter=Link.from_bandwidth(5e6, 0.0, "slow"))
    sender_s, _ = launch(_emulated, 2, topo, timeout=30)
    # A sleep lasts at least as long as asked, on any machine: a lower bound only (the sender's; the
    # receiver's clock starts whenever it gets there).
    assert sender_s >= 0.05


def test_the_two_rank_cycle_deadlocks_ungrouped_and_completes_grouped():
    x0, x1 = Message(0, 1, "x0"), Message(1, 0, "x1")
    ungrouped = [[Group(sends=(x0,)), Group(recvs=(x1,))], [Group(sends=(x1,)), Group(recvs=(x0,))]]
    with pytest.raises(RendezvousDeadlock, match=r"rank 0 at \[send x0:0->1\]; rank 1 at \[send x1:1->0\]"):
        simulate_rendezvous(ungrouped)
    assert simulate_rendezvous([[Group((x0,), (x1,))], [Group((x1,), (x0,))]]) == 1
    # Rank 1 receiving first also completes ungrouped (the ordering answer; grouping needs no ordering).
    assert simulate_rendezvous([[Group(sends=(x0,)), Group(recvs=(x1,))],
                                [Group(recvs=(x0,)), Group(sends=(x1,))]]) == 2


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_grouped_ring_completes_and_a_receive_posted_ahead_of_its_send_deadlocks(n):
    def msg(step, src):
        return Message(src, (src + 1) % n, f"c{step}")
    steps = n - 1
    grouped = [[Group((msg(s, r),), (msg(s, (r - 1) % n),)) for s in range(steps)] for r in range(n)]
    assert simulate_rendezvous(grouped) == steps
    # The old ring's order: step s+1's receive pre-posted in a group of its own, before step s+1's send.
    preposted = [[Group((msg(0, r),), (msg(0, (r - 1) % n),))]
                 + [g for s in range(1, steps) for g in (Group(recvs=(msg(s, (r - 1) % n),)),
                                                          Group(sends=(msg(s, r),)))] for r in range(n)]
    if steps == 1:
        assert simulate_rendezvous(preposted) == 1
    else:
        with pytest.raises(RendezvousDeadlock):
            simulate_rendezvous(preposted)


def test_an_inconsistent_plan_is_refused():
    with pytest.raises(ValueError, match=r"message 0 from rank 0 to rank 1 \(x:0->1\) is sent but never received"):
        simulate_rendezvous([[Group(sends=(Message(0, 1, "x"),))], []])
    with pytest.raises(ValueError, match="rank 1's group 0 sends y:0->1, which is not its own message"):
        simulate_rendezvous([[], [Group(sends=(Message(0, 1, "y"),))]])


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node.func.attr, node.lineno


@pytest.mark.slow
def test_no_message_of_the_package_bypasses_the_grouped_exchange():
    """The rule of commlab.collectives.p2p, checked on the source: no isend/irecv/send/recv call and no
    batch_isend_irecv outside the primitive, so that every message is grouped as NCCL needs. The one exception
    is the hang clinic's pipeline jobs (commlab/launch/failures.py), whose bare blocking sends deadlock on purpose."""
    bare = {"isend", "irecv", "send", "recv", "batch_isend_irecv"}
    allowed = {PACKAGE / "collectives" / "p2p.py", PACKAGE / "launch" / "failures.py"}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in allowed:
            continue
        for name, line in _calls(ast.parse(path.read_text())):
            if name in bare:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: .{name}(...)")
    assert not offenders, "point-to-point calls outside commlab/collectives/p2p.py:\n" + "\n".join(offenders)
