"""The pipeline's communication plan: derived from the schedule, deadlock-free under NCCL's rendezvous rules
(checked by a small simulator), and what the engine really sends on gloo."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commlab import launch
from commlab.parallel.pipeline import (ACTIVATION, FORWARD, GRADIENT, SCHEDULES, CommGroup, Message,
                                       Op, RendezvousDeadlock, communication_plan, make_schedule, pipeline_step,
                                       simulate_plan, split_sequential, ungrouped_plan)
from commlab.parallel.pipeline.communications import activation_nbytes

ALL_PM = [(p, m) for p in range(1, 9) for m in range(1, 17)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_grouped_plan_cannot_deadlock_for_any_p_up_to_8_and_m_up_to_16(name):
    for p, m in ALL_PM:
        simulate_plan(communication_plan(make_schedule(name, p, m)))  # raises RendezvousDeadlock if stuck


def _megatron_form(plan):
    """The plan with each group whose send and receive go to different neighbours split in two, the send
    first (how Megatron-LM posts the warm-up and cool-down: send_forward, then recv_forward)."""
    out = []
    for items in plan:
        split = []
        for it in items:
            if isinstance(it, CommGroup) and it.sends and it.recvs and it.sends[0].dst != it.recvs[0].src:
                split += [CommGroup(it.stage, sends=it.sends), CommGroup(it.stage, recvs=it.recvs)]
            else:
                split.append(it)
        out.append(split)
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_megatrons_form_with_split_warm_up_and_cool_down_groups_completes_too(name):
    for p, m in ALL_PM:
        simulate_plan(_megatron_form(communication_plan(make_schedule(name, p, m))))


def test_the_simulator_catches_the_old_ungrouped_plan_in_the_1f1b_steady_state():
    deadlocked = set()
    for p, m in ALL_PM:
        try:
            simulate_plan(ungrouped_plan(make_schedule("1f1b", p, m)))
        except RendezvousDeadlock:
            deadlocked.add((p, m))
    # Every pipeline with a steady state (two stages or more, two micro-batches or more) deadlocks;
    # with one stage or one micro-batch there is no forward/backward crossing.
    assert deadlocked == {(p, m) for p, m in ALL_PM if p >= 2 and m >= 2}
    with pytest.raises(RendezvousDeadlock, match=r"rank 0 at \[send a1:0->1\]; rank 1 at \[send g0:1->0\]"):
        simulate_plan(ungrouped_plan(make_schedule("1f1b", 2, 2)))
    # GPipe never has a send crossing a send on the same pair, so even ungrouped it completes.
    for p, m in ALL_PM:
        simulate_plan(ungrouped_plan(make_schedule("gpipe", p, m)))


def test_an_inconsistent_plan_is_refused():
    a0, a1 = Message(ACTIVATION, 0, 0, 1), Message(ACTIVATION, 1, 0, 1)
    with pytest.raises(ValueError, match=r"message 0 from rank 0 to rank 1 \(a0:0->1\) is sent but never received"):
        simulate_plan([[CommGroup(0, sends=(a0,))], []])
    with pytest.raises(ValueError, match="sent as a0:0->1, received as a1:0->1"):
        simulate_plan([[CommGroup(0, sends=(a0,))], [CommGroup(1, recvs=(a1,))]])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (3, 4), (4, 8), (8, 16)])
def test_the_plan_receives_each_input_before_its_computation_and_sends_each_output_after(name, p, m):
    schedule = make_schedule(name, p, m)
    plan = communication_plan(schedule)
    for s, items in enumerate(plan):
        assert [it for it in items if isinstance(it, Op)] == schedule[s]  # the schedule's order, untouched
        received, produced, sent = set(), set(), set()
        for it in items:
            if isinstance(it, CommGroup):
                assert it.stage == s and len(it.sends) <= 1 and len(it.recvs) <= 1 and (it.sends or it.recvs)
                for msg in it.sends:
                    assert (msg.kind, msg.microbatch) in produced  # sent only after it was computed
                    sent.add((msg.kind, msg.microbatch))
                received |= {(msg.kind, msg.microbatch) for msg in it.recvs}
            elif it.kind == FORWARD:
                assert s == 0 or (ACTIVATION, it.microbatch) in received
                if s < p - 1:
                    produced.add((ACTIVATION, it.microbatch))
            else:
                assert s == p - 1 or (GRADIENT, it.microbatch) in received
                if s > 0:
                    produced.add((GRADIENT, it.microbatch))
        assert sent == produced  # every output leaves the stage
        groups = [it for it in items if isinstance(it, CommGroup)]
        # One group per boundary between computations, at most: never two groups in a row.
        assert all(not (isinstance(a, CommGroup) and isinstance(b, CommGroup)) for a, b in zip(items, items[1:]))
        assert len(groups) <= 2 * m + 1


def test_the_1f1b_steady_state_uses_megatrons_two_grouped_exchanges():
    plan = communication_plan(make_schedule("1f1b", 4, 8))
    names = [it.name for it in plan[1] if isinstance(it, CommGroup)]
    # Stage 1 of 4: 2 warm-up forwards, 6 steady-state pairs, 2 cool-down backwards.
    assert names.count("send_forward_recv_backward") == 6
    assert names.count("send_backward_recv_forward") == 5
    assert names[0] == "recv_forward" and names[-1] == "send_backward"


def _counted_step(name, m):
    group = dist.new_group(list(range(dist.get_world_size())))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    stage = split_sequential(model, dist.get_world_size())[dist.get_rank(group)]
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    res = pipeline_step(stage, x, y, nn.functional.cross_entropy, m, group, schedule=name)
    return res.nbytes_sent


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_engine_sends_what_the_plan_says(name):
    p, m = 3, 4
    sent = launch(_counted_step, p, name, m, timeout=60)
    # Boundary shapes of split_sequential(model, 3): stage 0 -> 1 carries (2, 5), stage 1 -> 2 carries (2, 4).
    widths = {0: 5, 1: 4}
    for s, nbytes in enumerate(sent):
        plan = communication_plan(make_schedule(name, p, m))[s]
        expected = 0
        for it in plan:
            if isinstance(it, CommGroup):
                for msg in it.sends:
                    boundary = s if msg.kind == ACTIVATION else s - 1
                    expected += activation_nbytes((8 // m, widths[boundary]), torch.float32)
        assert nbytes == expected, s
