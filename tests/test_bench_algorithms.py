"""Side-by-side algorithm benchmarks and the emulated-topology model (correctness, not speed)."""

import pytest

from commlab.__main__ import main
from commlab.bench.algorithms import measure_algorithms, measure_emulated, predict_emulated
from commlab.topology import EmulatedTopology, Link
from tests.helpers import exit_status


def test_measure_algorithms_checks_and_times_every_pair():
    rows = measure_algorithms(3, [4096, 12], ["ring", "binomial tree", "halving-doubling", "torch"], rounds=1,
                              progress=False)
    assert len(rows) == 8 and all(r.wrong == 0 and r.seconds > 0 for r in rows)
    assert [r.nbytes for r in rows[:4]] == [4096] * 4


def test_measure_algorithms_rejects_bad_arguments():
    with pytest.raises(KeyError, match="known"):
        measure_algorithms(2, [16], ["butterfly"])
    with pytest.raises(ValueError):
        measure_algorithms(2, [16], ["ring"], rounds=0)


def test_emulated_variants_are_all_correct():
    topo = EmulatedTopology(2, 2, Link.from_bandwidth(1e9, 1e-5))
    out = measure_emulated(topo, 64 * 1024, rounds=1, progress=False)
    assert set(out) == {"ring, round-robin order", "ring, topology order", "hierarchical"}
    assert all(r.wrong == 0 and r.seconds > 0 for r in out.values())


def test_emulated_model_by_hand():
    topo = EmulatedTopology(2, 2, Link(alpha_s=1e-3, beta_s_per_byte=1e-6))
    free = Link(0.0, 0.0)
    p = predict_emulated(topo, 4000, free)
    # round-robin ring [0, 2, 1, 3]: 6 steps, each queues 2 messages of 1000 B on a NIC: 1 ms + 2 ms.
    assert p["ring, round-robin order"] == pytest.approx(6 * 3e-3)
    # topology order: one message per NIC per step: 1 ms + 1 ms.
    assert p["ring, topology order"] == pytest.approx(6 * 2e-3)
    # hierarchical: 2 inter-node steps, the node's 2 rings queue 1000 B each: 1 ms + 2 ms.
    assert p["hierarchical"] == pytest.approx(2 * 3e-3)
    assert EmulatedTopology(2, 4, free).round_robin_ring() == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(ValueError, match="permutation"):
        topo.predict_ring_seconds(10, [0, 1, 2], free)


@pytest.mark.slow
def test_command_line_algorithms_and_emulation(capsys):
    assert main(["bench", "--algorithms", "ring,binomial-tree,torch", "-n", "2", "-b", "1K", "-e", "4K",
                 "-r", "1"]) == 0
    out = capsys.readouterr().out
    assert "fastest measured" in out and "out of bounds values: 0 OK" in out
    assert main(["bench", "--emulate", "2x1", "-e", "64K", "-r", "1", "--inter-gbps", "8"]) == 0
    out = capsys.readouterr().out
    assert "hierarchical" in out and "out of bounds values: 0 OK" in out


@pytest.mark.parametrize("flags, message", [
    (["--algorithms", "butterfly"], "unknown algorithms"),
    (["--emulate", "2y4"], "--emulate takes NODESxDEVICES"),
])
def test_command_line_rejects_bad_choices(flags, message, capsys):
    # main() in this process (tests/test_bench_cli.py goes through python -m commlab once): a usage error is
    # SystemExit(2) with the message; any other exception fails the test.
    code, err = exit_status(main, ["bench", *flags], capsys)
    assert code == 2 and message in err
