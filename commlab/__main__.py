"""Command line: ``python -m commlab bench ...``.

Later chapters add ``plan`` and ``train`` subcommands here.
"""

from __future__ import annotations

import argparse
import sys

from commlab.bench.metrics import parse_size


def _sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlab",
                                     description="commlab: benchmarks and tools of the course")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="nccl-tests-style table: ring AllReduce (ours) vs dist.all_reduce")
    bench.add_argument("-n", "--world-size", type=int, default=4, help="ranks to launch (default 4)")
    bench.add_argument("-b", "--min-bytes", default="1K", help="smallest message, e.g. 1K (default 1K)")
    bench.add_argument("-e", "--max-bytes", default="64M", help="largest message, e.g. 64M (default 64M)")
    bench.add_argument("-f", "--step-factor", type=int, default=4, help="size multiplier (default 4)")
    bench.add_argument("-r", "--rounds", type=int, default=5, help="timed rounds per size (default 5)")
    bench.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    bench.add_argument("--check", action="store_true",
                       help="time the ring with its size/dtype agreement check (one small collective per call); "
                            "off by default, like dist.all_reduce, which checks nothing")
    args = parser.parse_args(argv)

    if args.command == "bench":
        from commlab.bench import bench_all_reduce
        try:
            lo, hi = parse_size(args.min_bytes), parse_size(args.max_bytes)
        except ValueError as e:
            parser.error(str(e))
        if args.step_factor < 2 or lo > hi or lo < 4:
            parser.error("need 4 <= --min-bytes <= --max-bytes and --step-factor >= 2")
        if args.world_size < 1 or args.rounds < 1:
            parser.error("need --world-size >= 1 and --rounds >= 1")
        rows = bench_all_reduce(args.world_size, _sizes(lo, hi, args.step_factor), rounds=args.rounds,
                                check=args.check, backend=args.backend)
        wrong = sum(r.wrong for r in rows)
        print(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        return 0 if wrong == 0 else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
