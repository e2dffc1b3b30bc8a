"""commlab.sync.cost, checked by hand (no ranks)."""

import pytest

from commlab.sync.cost import (BreakEven, break_even_bandwidth, bytes_sent_per_rank_per_step, exposed_seconds,
                               hiding_sync_delay, outer_sync_seconds, predict_step_seconds, sync_messages)


def test_outer_sync_seconds_by_hand():
    # 4 MB dense Delta on 4 ranks, α = 1 ms, 5 MB/s: 6 α + 2·3/4·4e6 B / 5e6 B/s = 0.006 + 1.2 s.
    assert outer_sync_seconds(4e6, 4, 1e-3, 1 / 5e6) == pytest.approx(1.206)
    # INT8 payload of 1 MB gathered: 3 α + 3·1e6 / 5e6 = 0.003 + 0.6 s; plus 10 ms of codec.
    assert outer_sync_seconds(1e6, 4, 1e-3, 1 / 5e6, "all_gather", codec_s=0.01) == pytest.approx(0.613)
    assert outer_sync_seconds(4e6, 1, 1e-3, 1 / 5e6) == 0.0  # one rank sends nothing
    assert sync_messages(4) == 6 and sync_messages(4, "all_gather") == 3


def test_bytes_per_step_by_hand():
    assert bytes_sent_per_rank_per_step(4e6, 4, every=10) == pytest.approx(6e5)   # 1.5 × 4e6 / 10
    assert bytes_sent_per_rank_per_step(1e6, 4, path="all_gather") == pytest.approx(3e6)


def test_exposed_and_predicted_step_by_hand():
    assert exposed_seconds(0.8, 0, 0.1) == 0.8
    assert exposed_seconds(0.8, 3, 0.1) == pytest.approx(0.5)
    assert exposed_seconds(0.8, 8, 0.1) == 0.0
    # DiLoCo H = 10, a 0.8 s sync: 0.1 + 0.8 / 10.
    assert predict_step_seconds(0.1, 0.8, inner_steps=10) == pytest.approx(0.18)
    # Streaming, F = 2 fragments of 0.4 s each, tau = 4 steps of 0.1 s hide them: no overhead left.
    assert predict_step_seconds(0.1, 0.4, inner_steps=10, fragments=2, sync_delay=4) == pytest.approx(0.1)
    # tau = 2: 0.2 s of each fragment's sync exposed, twice per 10 steps.
    assert predict_step_seconds(0.1, 0.4, inner_steps=10, fragments=2, sync_delay=2) == pytest.approx(0.14)
    with pytest.raises(ValueError, match="sync_delay"):
        predict_step_seconds(0.1, 0.4, inner_steps=10, fragments=2, sync_delay=5)


def test_hiding_sync_delay_by_hand():
    assert hiding_sync_delay(0.1, 0.3) == 3      # 0.3 / 0.1 rounds to 2.9999999999999996
    assert hiding_sync_delay(0.1, 0.31) == 4
    assert hiding_sync_delay(0.1, 0.0) == 0
    with pytest.raises(ValueError, match="base_step_s"):
        hiding_sync_delay(0.0, 0.3)


def test_break_even_bandwidth_by_hand():
    # 2 ranks, α = 1 ms, 0.1 s steps. DiLoCo H = 10 sends a 4 MB Delta (4e5 B per step) and needs 130 steps;
    # a per-step compressor sends 1 MB per step and needs 100. Bytes saved: 100·1e6 - 130·4e5 = 4.8e7; extra fixed
    # time: 130·(0.1 + 2e-3/10) - 100·(0.1 + 2e-3) = 2.826 s; they cross at 4.8e7 / 2.826 B/s.
    out = break_even_bandwidth(0.1, 2, 1e-3, sync_payload_nbytes=4e6, inner_steps=10, compressed_payload_nbytes=1e6,
                               sync_steps=130, compressed_steps=100)
    assert out.verdict == "sync wins below"
    assert out.bytes_per_s == pytest.approx(4.8e7 / 2.826)
    # Same steps to the target: fewer bytes and fewer latencies per step, so the sync always wins.
    assert break_even_bandwidth(0.1, 2, 1e-3, sync_payload_nbytes=4e6, inner_steps=10,
                                compressed_payload_nbytes=1e6) == BreakEven(None, "sync always wins")
    # Twice the steps and more bytes per step (H = 2): never.
    assert break_even_bandwidth(0.1, 2, 1e-3, sync_payload_nbytes=4e6, inner_steps=2, compressed_payload_nbytes=1e6,
                                sync_steps=200, compressed_steps=100).verdict == "sync never wins"


@pytest.mark.parametrize("call, name", [
    (lambda: outer_sync_seconds(-1, 2, 0, 0), "payload_nbytes"),
    (lambda: outer_sync_seconds(1, 0, 0, 0), "n"),
    (lambda: outer_sync_seconds(1, 2, 0, 0, "ring"), "path"),
    (lambda: exposed_seconds(1.0, -1, 0.1), "sync_delay"),
    (lambda: bytes_sent_per_rank_per_step(1, 2, every=0), "every"),
])
def test_bad_cost_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_hiding_sync_delay_refuses_an_overflowing_ratio():
    with pytest.raises(ValueError, match="base_step_s"):
        hiding_sync_delay(5e-324, 1.0)


def test_break_even_says_tie_when_nothing_differs():
    # One rank sends nothing either way: it used to say "sync never wins".
    assert break_even_bandwidth(0.1, 1, 1e-3, sync_payload_nbytes=4e6, inner_steps=10,
                                compressed_payload_nbytes=1e6) == BreakEven(None, "tie")
    # Equal bytes per step (4e5 every 4 steps against 1e5 every step), no latency: the same time at any bandwidth.
    assert break_even_bandwidth(0.1, 2, 0.0, sync_payload_nbytes=4e5, inner_steps=4,
                                compressed_payload_nbytes=1e5).verdict == "tie"
