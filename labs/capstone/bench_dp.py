"""Benchmark: the capstone at 1 x 1 x DP through commlab's data-parallel path and through torch's DDP.

    python labs/capstone/bench_dp.py            # 8 gloo ranks, 3 alternating rounds of 12 steps each

Same model, bucket cap, batch and steps; each round runs ours then DDP, and the table gives each round's
median step time (steps after the first) and the ratio ours/DDP. A benchmark, not a test: on a shared
2-core machine the ratio moves from round to round, so read the median of the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from commlab import launch  # noqa: E402
from labs.capstone.train import Options, train  # noqa: E402


def _median_step(opts: Options) -> float:
    stats: list = []
    train(opts, stats)
    return statistics.median(s.step_s for s in stats[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    args = p.parse_args(argv)
    base = Options(dp=args.dp, steps=args.steps, micro_batch=args.micro_batch, micro_batches=1)
    print(f"# capstone 1x1x{args.dp} on gloo, {args.steps} steps per run, median step time of steps 1..{args.steps - 1}")
    print(f"# {'round':>5} {'ours (ms)':>10} {'DDP (ms)':>10} {'ours/DDP':>9}")
    ratios = []
    for r in range(args.rounds):
        ours = launch(_median_step, args.dp, base, timeout=300, print_output=False)[0]
        ddp = launch(_median_step, args.dp, dataclasses.replace(base, dp_impl="ddp"), timeout=300,
                     print_output=False)[0]
        ratios.append(ours / ddp)
        print(f"  {r:>5} {ours * 1e3:>10.1f} {ddp * 1e3:>10.1f} {ours / ddp:>9.2f}", flush=True)
    print(f"# median ours/DDP over {args.rounds} rounds: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    from commlab.launch.env import exit_process
    exit_process(main())
