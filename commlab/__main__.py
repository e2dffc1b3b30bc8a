"""Command line: ``python -m commlab bench ...``.

``bench`` measures (collectives, algorithms, emulated topologies, compressors); ``plan`` ranks parallel layouts;
``selftest`` checks commlab on the world it finds (under torchrun or SLURM, or forked ranks); ``clinic`` injects
a hang into a gloo job and names its rank and line; ``overlap-check`` reads a profiler trace and says which
communication was hidden, which exposed.
"""

from __future__ import annotations

import argparse
import math
import sys

from commlab.bench.metrics import parse_size


def _sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["selftest"]:  # its own parser, and torchrun's error-file entry point
        from commlab.selftest import main as selftest_main
        return selftest_main(argv[1:])
    if argv[:1] == ["clinic"]:  # its own parser
        from commlab.launch.clinic import main as clinic_main
        return clinic_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m commlab",
                                     description="commlab: benchmarks and tools of the course")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("selftest", add_help=False,
                   help="check ring AllReduce, a 2-D mesh with a TP layer and a data-parallel step on the world it "
                        "finds (torchrun, srun, or -n forked ranks); `selftest --help` for its options")
    sub.add_parser("clinic", add_help=False,
                   help="inject a hang (order, size, dtype, absent, exit, kill, send-first, recv-first) into a gloo "
                        "job and read it with plain/detail/flight-recorder/stacks; `clinic --help` for its options")
    bench = sub.add_parser("bench", help="nccl-tests-style table: ring AllReduce (ours) vs dist.all_reduce")
    bench.add_argument("-n", "--world-size", type=int, default=None,
                       help="ranks to launch (default 4; under torchrun or srun the job's ranks are measured)")
    bench.add_argument("-b", "--min-bytes", default="1K", help="smallest message, e.g. 1K (default 1K)")
    bench.add_argument("-e", "--max-bytes", default=None,
                       help="largest message, e.g. 64M (default 64M; with --two-phase: the gradient's size, default 4M)")
    bench.add_argument("-f", "--step-factor", type=int, default=4, help="size multiplier (default 4)")
    bench.add_argument("-r", "--rounds", type=int, default=5, help="timed rounds per size (default 5)")
    bench.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    bench.add_argument("--torchrun", default=None, metavar="NODESxPROCS",
                       help="start NODES local torchrun agents of PROCS processes each (e.g. 2x2: two 'nodes' on "
                            "loopback, through python -m commlab.launch.torchrun) and measure in their world")
    bench.add_argument("--algorithms", default=None, metavar="LIST",
                       help="compare AllReduce algorithms instead: 'all' or a comma list of "
                            "ring,halving-doubling,recursive-doubling,binomial-tree,torch; calibrates α and "
                            "β first and prints measured beside predicted times")
    bench.add_argument("--emulate", default=None, metavar="NODESxDEVICES",
                       help="run on an emulated topology, e.g. 2x4 (its NODES x DEVICES ranks replace "
                            "--world-size; gloo only): topology-unaware ring vs topology-order ring vs "
                            "hierarchical at --max-bytes, measured and predicted")
    bench.add_argument("--inter-gbps", type=float, default=1.6,
                       help="emulated inter-node bandwidth per direction in Gb/s (default 1.6 = 200 MB/s)")
    bench.add_argument("--inter-alpha-us", type=float, default=200.0,
                       help="emulated inter-node latency in microseconds (default 200)")
    bench.add_argument("--check", action="store_true",
                       help="time the ring with its size/dtype agreement check (one small collective per call); "
                            "off by default, like dist.all_reduce, which checks nothing")
    bench.add_argument("--all-to-all", action="store_true",
                       help="the AlltoAll table instead: commlab's pairwise AllToAllV (equal splits) vs "
                            "dist.all_to_all_single, sizes being one rank's whole send buffer, busbw with "
                            "nccl-tests' factor (n-1)/n (--backend and --check apply)")
    bench.add_argument("--compressors", action="store_true",
                       help="compressor throughput beside the torch primitives, and our PowerSGD hook's DDP step "
                            "time beside PyTorch's (uses --world-size and --rounds)")
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="with --compressors: where the throughput is measured (default cpu; the DDP step "
                            "comparison stays on gloo CPU ranks); the tensor is --max-bytes of float32")
    bench.add_argument("--two-phase", action="store_true",
                       help="the two-phase compressed AllReduce vs the all-gather path vs a dense ring AllReduce: "
                            "bytes per rank and time per call for sign, int8 and top-k 1%% on a --max-bytes float32 "
                            "tensor, at 2, 4 and 8 gloo ranks (or --world-size), --rounds calls each")
    bench.add_argument("--overlap", action="store_true",
                       help="bucket size vs step time: our overlapped data parallelism beside DDP with the same "
                            "bucket cap, with overlap fraction and exposed communication (uses --world-size, "
                            "capped at the cores, and 2 x --rounds timed steps)")
    bench.add_argument("--ring-attention", action="store_true",
                       help="ring attention vs all-gathered attention (and DeepSpeed-Ulysses): causal forward + backward "
                            "time per call at a few sequence lengths, the ratio ring / all-gather, and bytes per rank, "
                            "on --world-size ranks (default 2; gloo, or --backend nccl with one GPU per rank), "
                            "--rounds calls each")
    bench.add_argument("--seq-lengths", default=None, metavar="LIST",
                       help="with --ring-attention: comma list of whole-sequence lengths, each a multiple of 2 x "
                            "--world-size (default 512,1024,2048,4096)")
    bench.add_argument("--sharded", action="store_true",
                       help="ZeRO-3 step time: our ShardedDataParallel beside FSDP2 (fully_shard) on the same MLP, "
                            "with and without our prefetch, with our communication time and overlap fraction "
                            "(uses --world-size, capped at the cores, and 2 x --rounds timed steps)")
    plan = sub.add_parser("plan", help="rank TP x PP x DP layouts of a model on a cluster preset (memory + time model)")
    plan.add_argument("--validate", action="store_true",
                      help="check the planner against the published runs of commlab/data/published_layouts.json: "
                           "reported vs predicted TFLOP/s per GPU, error, rank of the published layout in the "
                           "planner's own search, median |error| (the other options but --achievable-fraction and "
                           "--kernels are not used)")
    plan.add_argument("--model", help="a model of commlab/data/models.json, e.g. llama3-405b (required unless "
                                      "--validate)")
    plan.add_argument("--preset",
                      help="a cluster preset of commlab/data/clusters.json, e.g. dgx-h100-ndr (required unless "
                           "--validate)")
    plan.add_argument("--gpus", type=int, help="GPUs to use (a multiple of the preset's devices per node)")
    plan.add_argument("--global-batch", type=int, help="sequences per step")
    plan.add_argument("--software", default=None,
                      help="a software profile of commlab/data/software.json (what the stack overlaps, its pipeline "
                           "message layout, gradient bytes, recomputation), e.g. megatron-core; default "
                           "generic-no-overlap")
    plan.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    plan.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    plan.add_argument("--achievable-fraction", type=float, default=None,
                      help="price compute at this one share of peak FLOP/s for every matmul instead of the kernel "
                           "model (0..1; the time model's constant is 0.5)")
    plan.add_argument("--kernels", action="store_true",
                      help="the kernel model, and fail where the GPU lacks it. It is the default wherever the GPU has "
                           "it: GEMM efficiency by shape from commlab/data/gemm_efficiency.json, memory-bound "
                           "operations and the optimizer step at the device's memory bandwidth, the layers' kernels at "
                           "the stack's share of those rates that measured layers give "
                           "(commlab/data/published_layer_times.json; see planner/kernels.py); a GPU without them gets "
                           "the share 0.5, and the header says so")
    plan.add_argument("--dp-overlap", type=float, default=None,
                      help="share of the DP ReduceScatter/AllGather that may hide behind compute (0..1; default: the "
                           "software profile's)")
    plan.add_argument("--even-stages", action="store_true", help="only pp values that divide the layer count")
    plan.add_argument("--memory-reserve", type=float, default=None,
                      help="share of device memory kept free for what the model does not count (CUDA context, NCCL "
                           "buffers, fragmentation), in [0, 1); default 0.1. Plans within 5 %% of the rest are "
                           "marked fragile (!)")
    exp = sub.add_parser("experiments", help="chapter 8: train with every compressor, record to "
                                             "commlab/data/experiments/ (in a checkout) or --out")
    exp_sub = exp.add_subparsers(dest="action", required=True)
    exp_run = exp_sub.add_parser("run", help="run a grid (resumes: runs already recorded are skipped)")
    exp_run.add_argument("--grid", default="full", choices=["full", "quick"], help="which grid (default full)")
    exp_run.add_argument("--out", default=None, help="JSON-lines file (default in a checkout: "
                         "commlab/data/experiments/<grid>.jsonl)")
    exp_run.add_argument("--fresh", action="store_true", help="discard the recorded runs and start over")
    exp_val = exp_sub.add_parser("slow-link", help="measure step times on an emulated slow link beside the "
                                                   "time model's prediction (commlab/data/experiments/slow_link.json)")
    exp_val.add_argument("--out", default=None, help="JSON file (default in a checkout: "
                         "commlab/data/experiments/slow_link.json)")
    exp_sync = exp_sub.add_parser("sync-link", help="send fewer bytes, or sync less often? per-step compressors "
                                  "against local SGD, DiLoCo and Streaming DiLoCo on an emulated slow link, beside the "
                                  "alpha-beta prediction (commlab/data/experiments/sync_link.json; resumes)")
    exp_sync.add_argument("--out", default=None, help="JSON file of the result (default in a checkout: "
                          "commlab/data/experiments/sync_link.json)")
    exp_sync.add_argument("--records", default=None, help="JSON-lines file of the runs (default in a checkout: "
                          "commlab/data/experiments/sync_link.jsonl); runs already in it are not rerun")
    exp_sync.add_argument("--fresh", action="store_true", help="discard the recorded runs and start over")
    exp_sync.add_argument("--tasks", default="digits,charlm", help="comma-separated tasks (default digits,charlm)")
    exp_sync.add_argument("--inner-steps", type=int, default=10, help="H, inner steps between syncs (default 10)")
    exp_sync.add_argument("--show", action="store_true", help="print the recorded table only (runs nothing)")
    exp_str = exp_sub.add_parser("stragglers", help="slow one DP rank on purpose (a delay, a busy neighbour on its "
                                 "core): per-rank step times beside the max-over-ranks alpha-beta prediction, and the "
                                 "rank the per-rank timings name (commlab/data/experiments/stragglers.json)")
    exp_str.add_argument("--out", default=None, help="JSON file (default in a checkout: "
                         "commlab/data/experiments/stragglers.json)")
    exp_str.add_argument("--world-size", type=int, default=4, help="ranks (default 4; pinned: at most one per "
                         "usable core)")
    exp_str.add_argument("--delays-ms", default="0,5,10,20,40", help="comma-separated delays added to the last "
                         "rank's forward, ms (default 0,5,10,20,40)")
    exp_str.add_argument("--steps", type=int, default=40, help="steps per case (default 40; the first 5 are skipped)")
    exp_str.add_argument("--no-neighbour", action="store_true", help="skip the busy-neighbour case")
    exp_str.add_argument("--no-pin", action="store_true", help="leave the ranks unpinned, sharing the cores (and skip "
                         "the neighbour case); default: one rank per core, min(--world-size, usable cores) ranks")
    exp_str.add_argument("--show", action="store_true", help="print the recorded table only (runs nothing)")
    exp_lw = exp_sub.add_parser("lost-work", help="kill a DP replica at a step: the work a checkpoint restart "
                                "(torchrun, several intervals) and per-step fault tolerance lose, and the time each "
                                "takes, beside the model (commlab/data/experiments/lost_work.json)")
    exp_lw.add_argument("--out", default=None, help="JSON file (default in a checkout: "
                        "commlab/data/experiments/lost_work.json)")
    exp_lw.add_argument("--replicas", type=int, default=4, help="replicas (default 4)")
    exp_lw.add_argument("--steps", type=int, default=80, help="steps per run (default 80)")
    exp_lw.add_argument("--fail-step", type=int, default=37, help="step in which a replica is killed (default 37)")
    exp_lw.add_argument("--missed-steps", type=int, default=10, help="FT: the replacement starts this many steps "
                        "after the failure (default 10)")
    exp_lw.add_argument("--intervals", default="5,10,20,40", help="comma-separated checkpoint intervals, steps "
                        "(default 5,10,20,40)")
    exp_lw.add_argument("--show", action="store_true", help="print the recorded table only (runs nothing)")
    exp_tab = exp_sub.add_parser("table", help="print the measured table beside the source article's claims")
    exp_tab.add_argument("--records", default=None, help="JSON-lines file (default: the recorded "
                         "commlab/data/experiments/full.jsonl)")
    ovc = sub.add_parser("overlap-check", help="read a torch.profiler trace (Chrome JSON, or gzip'd) of a training step: "
                         "hidden and exposed seconds per kind of communication, and the step's critical path")
    ovc.add_argument("trace", metavar="TRACE", help="a trace file, or a directory of rank<R>.json[.gz] (the "
                     "capstone's --profile DIR): every rank, or --rank's")
    ovc.add_argument("--step", type=int, default=None, help="which step, 0-based in time order (default: the last)")
    ovc.add_argument("--rank", type=int, default=None, help="with a directory: only this rank's trace")
    args = parser.parse_args(argv)
    if args.command == "overlap-check":
        return _overlap_check(args, parser)
    if args.command == "experiments":
        return _experiments(args)
    if args.command == "plan":
        return _plan(args, parser)

    if args.command == "bench":
        from commlab.bench import bench_all_reduce
        if args.max_bytes is None:
            args.max_bytes = "4M" if args.two_phase else "64M"
        try:
            lo, hi = parse_size(args.min_bytes), parse_size(args.max_bytes)
        except ValueError as e:
            parser.error(str(e))
        if args.step_factor < 2 or lo > hi or lo < 4:
            parser.error("need 4 <= --min-bytes <= --max-bytes and --step-factor >= 2")
        if (args.world_size is not None and args.world_size < 1) or args.rounds < 1:
            parser.error("need --world-size >= 1 and --rounds >= 1")
        modes = [f"--{m.replace('_', '-')}" for m in ("compressors", "overlap", "sharded", "emulate", "algorithms",
                                                      "two_phase", "ring_attention", "all_to_all") if getattr(args, m)]
        if args.seq_lengths is not None and not args.ring_attention:
            parser.error("--seq-lengths applies to --ring-attention only")
        if len(modes) > 1:
            parser.error(f"{' and '.join(modes)} are separate benchmarks; run them one at a time")
        from commlab.launch.inprocess import runs_in_process
        if args.torchrun or runs_in_process():
            if modes:
                parser.error(f"{modes[0]} starts its own ranks; under torchrun (and with --torchrun) only the "
                             "AllReduce table (ours vs dist.all_reduce) is measured")
            if args.torchrun:
                return _bench_local_torchrun(args, parser, argv)
            return _bench_in_job(args, parser, _sizes(lo, hi, args.step_factor))
        if args.two_phase:
            if args.backend != "gloo" or args.check:
                parser.error("--two-phase starts its own gloo ranks; --backend and --check apply to the AllReduce "
                             "table only")
            if args.world_size is not None and args.world_size < 2:
                parser.error("--two-phase needs --world-size >= 2 (one rank sends nothing)")
            from commlab.bench.two_phase import print_two_phase_bench
            sizes = (2, 4, 8) if args.world_size is None else (args.world_size,)
            return print_two_phase_bench(sizes, numel=max(1, hi // 4), rounds=args.rounds)
        if args.ring_attention:
            return _bench_ring_attention(args, parser)
        if args.world_size is None:
            args.world_size = 4
        if args.device != "cpu" and not args.compressors:
            parser.error("--device applies to --compressors only (the collectives take their device from --backend)")
        if args.sharded and (args.backend != "gloo" or args.check):
            parser.error("--sharded runs on gloo CPU ranks and times its own model; --backend and --check do not apply")
        if args.overlap and (args.backend != "gloo" or args.check):
            parser.error("--overlap runs on gloo CPU ranks and times its own model; --backend and --check do not apply")
        if modes and modes != ["--all-to-all"] and (args.backend != "gloo" or args.check):
            # These benchmarks start their own gloo ranks (--compressors times its kernels on --device); a flag
            # they would ignore is refused, so that a table never says less than the command line asked for.
            parser.error(f"{modes[0]} starts its own gloo ranks; --backend and --check apply to the AllReduce "
                         "table only (python -m commlab bench --backend nccl, one GPU per rank)")
        if args.backend == "nccl":
            _check_nccl_ranks(parser, args.world_size)
        if args.compressors and args.device == "cuda":
            _check_cuda(parser, "--device cuda")
        if args.compressors:
            from commlab.bench.compressors import print_compressor_bench
            return print_compressor_bench(world_size=max(2, args.world_size), numel=max(1, hi // 4),
                                          repeats=args.rounds, device=args.device)
        if args.sharded:
            from commlab.bench.sharded import print_sharded_bench
            return print_sharded_bench(world_size=args.world_size, steps=2 * args.rounds)
        if args.overlap:
            from commlab.bench.overlap import print_overlap_bench
            return print_overlap_bench(world_size=args.world_size, steps=2 * args.rounds)
        if args.emulate:
            return _bench_emulated(args, parser, hi)
        if args.algorithms:
            return _bench_algorithms(args, parser, _sizes(lo, hi, args.step_factor))
        if args.all_to_all:
            from commlab.bench.all_to_all import bench_all_to_all
            rows = bench_all_to_all(args.world_size, _sizes(lo, hi, args.step_factor), rounds=args.rounds,
                                    check=args.check, backend=args.backend)
            wrong = sum(r.wrong for r in rows)
            print(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
            return 0 if wrong == 0 else 1
        rows = bench_all_reduce(args.world_size, _sizes(lo, hi, args.step_factor), rounds=args.rounds,
                                check=args.check, backend=args.backend)
        wrong = sum(r.wrong for r in rows)
        print(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        return 0 if wrong == 0 else 1
    return 2


def _overlap_check(args, parser) -> int:
    """``overlap-check``: one table per trace (commlab.overlap.trace); a bad trace is a usage error."""
    import os
    import re

    from commlab.overlap.trace import TraceError, check_overlap, format_report
    paths = [args.trace]
    if os.path.isdir(args.trace):
        found = {int(m.group(1)): os.path.join(args.trace, f) for f in sorted(os.listdir(args.trace))
                 if (m := re.match(r"rank(\d+)\.json(\.gz)?$", f))}
        if not found:
            parser.error(f"{args.trace} holds no rank<R>.json or rank<R>.json.gz traces")
        if args.rank is not None and args.rank not in found:
            parser.error(f"--rank must be one of {sorted(found)} (the traces in {args.trace}), got {args.rank}")
        paths = [found[args.rank]] if args.rank is not None else [found[r] for r in sorted(found)]
    elif args.rank is not None:
        parser.error("--rank picks a trace from a directory; TRACE is a file")
    for i, path in enumerate(paths):
        try:
            report = check_overlap(path, step=args.step)
        except TraceError as e:
            parser.error(str(e))
        print(("\n" if i else "") + format_report(report))
    return 0


def _bench_ring_attention(args, parser) -> int:
    """``--ring-attention``: ring vs all-gathered attention (and Ulysses) by sequence length, on gloo (or NCCL)
    ranks."""
    if args.check:
        parser.error("--ring-attention checks its inputs on every call; --check applies to the AllReduce table only")
    n = 2 if args.world_size is None else args.world_size
    if n < 2:
        parser.error("--ring-attention needs --world-size >= 2 (one rank passes nothing round a ring)")
    from commlab.bench.context import DEFAULT_SEQS, print_ring_attention_bench
    seqs = DEFAULT_SEQS
    if args.seq_lengths is not None:
        try:
            seqs = tuple(int(x) for x in args.seq_lengths.split(","))
        except ValueError:
            parser.error(f"--seq-lengths takes a comma list of ints, e.g. 512,1024, got {args.seq_lengths!r}")
    if any(s < 1 or s % (2 * n) for s in seqs):
        parser.error(f"--seq-lengths must be positive multiples of 2 x --world-size = {2 * n} (the load-balanced "
                     f"layout cuts the sequence into 2N chunks), got {list(seqs)}")
    if 4 % n:
        parser.error(f"--ring-attention measures 4 heads, which Ulysses spreads over the ranks: --world-size must "
                     f"divide 4, got {n}")
    if args.backend == "nccl":
        _check_nccl_ranks(parser, n)
    return print_ring_attention_bench(n, seqs, rounds=args.rounds, backend=args.backend)


def _bench_in_job(args, parser, sizes) -> int:
    """The AllReduce table in the world of the torchrun/srun job this process is a rank of."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from commlab.bench import bench_all_reduce
    from commlab.launch import init_from_env, read_env

    job = read_env()
    if args.world_size is not None and args.world_size != job.world_size:
        parser.error(f"-n {args.world_size} does not match the job's {job.world_size} ranks ({job.launcher})")
    if args.backend == "nccl":
        _check_nccl_ranks(parser, 1)  # this process's own GPU; the job's other ranks check theirs

    @record  # torchrun's error file gets the root cause and its traceback
    def run() -> int:
        import torch.distributed as dist

        created = not dist.is_initialized()
        # One process group for every size (each launch() below then runs in it, in this process).
        ctx = init_from_env(args.backend)
        rows = bench_all_reduce(ctx.world_size, sizes, rounds=args.rounds, check=args.check, backend=args.backend,
                                progress=ctx.is_main)
        wrong = sum(r.wrong for r in rows)
        if ctx.is_main:
            print(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}", flush=True)
        if created:
            dist.destroy_process_group()
        return 0 if wrong == 0 else 1

    return run()


def _check_cuda(parser, flag: str) -> None:
    """No visible CUDA GPU is a usage error (exit 2, no traceback) naming ``flag``."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        parser.error(f"{flag} needs CUDA GPUs and this machine has none visible (torch {torch.__version__}, "
                     f"CUDA {'built in' if torch.version.cuda else 'not built in'})")


def _check_nccl_ranks(parser, ranks: int) -> None:
    """Refuse ``--backend nccl`` as a usage error (exit 2, no traceback) when this machine cannot give each
    of ``ranks`` local ranks its own GPU."""
    from commlab.launch.device import nccl_gpu_problem
    problem = nccl_gpu_problem(ranks)
    if problem is not None:
        parser.error(problem)


def _bench_local_torchrun(args, parser, argv) -> int:
    """``--torchrun NxP``: the same benchmark in N local torchrun agents of P processes (loopback "nodes")."""
    from commlab.launch.torchrun import run_local_nodes

    try:
        nodes, procs = (int(x) for x in args.torchrun.lower().split("x"))
        if nodes < 1 or procs < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--torchrun takes NODESxPROCS with both >= 1, e.g. 2x2, got {args.torchrun!r}")
    if args.world_size is not None and args.world_size != nodes * procs:
        parser.error(f"-n {args.world_size} does not match --torchrun {args.torchrun} ({nodes * procs} ranks)")
    if args.backend == "nccl":
        _check_nccl_ranks(parser, nodes * procs)  # every local "node" is on this machine
    job, skip = [], False  # the same command for every rank, without --torchrun
    for a in argv:
        if skip:
            skip = False
        elif a == "--torchrun":
            skip = True
        elif not a.startswith("--torchrun="):
            job.append(a)
    print(f"# torchrun: {nodes} local node(s) x {procs} process(es), rendezvous on 127.0.0.1", flush=True)
    results = run_local_nodes(nodes, procs, ["-m", "commlab", *job], timeout_s=600.0, join_timeout_s=60.0)
    # Global rank 0, which prints the table, is on whichever node torchrun numbered first.
    table = [r for r in results if "# AllReduce" in r.output]
    failed = [r for r in results if r.returncode != 0 or r.stopped]
    if failed or not table:
        for r in results:
            print(f"# --- node {r.node_rank}: exit status {r.returncode}"
                  f"{' (stopped at the deadline)' if r.stopped else ''}")
            print(r.output.rstrip("\n"), flush=True)
        return 1
    print(table[0].output.rstrip("\n"), flush=True)
    return 0


def _bench_algorithms(args, parser, sizes) -> int:
    from commlab.bench.algorithms import ALGORITHMS, measure_algorithms
    from commlab.bench.calibrate import calibrate
    from commlab.collectives.cost import predict_flat

    if args.algorithms.strip().lower() == "all":
        names = list(ALGORITHMS)
    else:
        names = []
        for a in args.algorithms.split(","):
            name = a.strip().lower().replace("_", " ").replace("-", " ").replace("halving doubling", "halving-doubling")
            if name and name not in names:  # a repeated name would be measured and counted twice
                names.append(name)
    unknown = [a for a in names if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithms {unknown}; choose from {', '.join(a.replace(' ', '-') for a in ALGORITHMS)}")
    ranks = max(2, args.world_size)  # a ring exchange needs two ranks even when one is measured
    print(f"# calibrating alpha and beta on {ranks} ranks (ring exchange) ...", flush=True)
    fit = calibrate(world_size=ranks, rounds=args.rounds, progress=False)
    print(f"# {fit}", flush=True)
    rows = measure_algorithms(args.world_size, sizes, names, rounds=args.rounds)
    modelled = [a for a in names if a != "torch"]
    print(f"# AllReduce on {args.world_size} ranks, gloo: measured (median of {args.rounds}) / predicted, in us")
    print(f"#{'size (B)':>11} " + " ".join(f"{a:>24}" for a in names) + f"  {'fastest measured':>18}")
    wrong = 0
    for nbytes in sorted({s // 4 * 4 for s in sizes}):  # whole float32 elements, as measured
        at = {r.algorithm: r for r in rows if r.nbytes == nbytes}
        pred = predict_flat(nbytes, args.world_size, fit.as_link(), algorithms=modelled) if modelled else {}
        cells = []
        for a in names:
            p = f"{pred[a] * 1e6:.0f}" if a in pred else "-"
            cells.append(f"{at[a].seconds * 1e6:>12.0f} / {p:>9}")
            wrong += at[a].wrong
        best = min(names, key=lambda a: at[a].seconds)
        print(f" {nbytes:>11} " + " ".join(f"{c:>24}" for c in cells) + f"  {best:>18}")
    print(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return 0 if wrong == 0 else 1


def _bench_emulated(args, parser, nbytes) -> int:
    from commlab.bench.algorithms import measure_emulated, predict_emulated
    from commlab.bench.calibrate import calibrate
    from commlab.topology import EmulatedTopology, Link

    # Each option checked in the unit the user typed, so that the message names the option at fault.
    if not (math.isfinite(args.inter_gbps) and args.inter_gbps > 0):
        parser.error(f"--inter-gbps must be a finite number of Gb/s > 0, got {args.inter_gbps:g}")
    if not (math.isfinite(args.inter_alpha_us) and args.inter_alpha_us >= 0):
        parser.error(f"--inter-alpha-us must be a finite number of microseconds >= 0, got {args.inter_alpha_us:g}")
    link = Link.from_bandwidth(args.inter_gbps * 1e9 / 8, args.inter_alpha_us * 1e-6, "emulated")
    try:
        nodes, devices = (int(x) for x in args.emulate.lower().split("x"))
        topology = EmulatedTopology(nodes, devices, link)
    except ValueError as e:
        parser.error(f"--emulate takes NODESxDEVICES with both >= 1, e.g. 2x4, got {args.emulate!r} ({e})")
    print(f"# calibrating the real transport on {topology.world_size} ranks ...", flush=True)
    fit = calibrate(world_size=max(2, topology.world_size), rounds=args.rounds, progress=False)
    print(f"# {fit}", flush=True)
    measured = measure_emulated(topology, nbytes, rounds=args.rounds)
    predicted = predict_emulated(topology, nbytes, fit.as_link())
    base = "ring, round-robin order"
    print(f"# AllReduce of {nbytes} B on {topology}")
    print(f"#{'variant':>26} {'measured (ms)':>14} {'predicted (ms)':>15} {'x faster than unaware ring':>27} "
          f"{'(predicted)':>12} {'#wrong':>7}")
    for v, row in measured.items():
        model_ratio = f"{predicted[base] / predicted[v]:.2f}" if predicted[v] > 0 else "n/a"
        print(f" {v:>26} {row.seconds * 1e3:>14.1f} {predicted[v] * 1e3:>15.1f} "
              f"{measured[base].seconds / row.seconds:>27.2f} {model_ratio:>12} {row.wrong:>7}")
    wrong = sum(r.wrong for r in measured.values())
    print(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return 0 if wrong == 0 else 1


def _plan(args, parser) -> int:
    from commlab.parallel.planner import (AUTO, DEFAULT_MEMORY_RESERVE, KERNELS, TIMELINE_TOP_K, list_models,
                                          list_software, load_model, load_published, search, validate_published,
                                          validation_table)
    from commlab.parallel.planner.kernels import kernel_model_gap
    from commlab.topology import list_presets, load_preset

    fraction = AUTO if args.achievable_fraction is None else args.achievable_fraction
    if fraction != AUTO and not 0 < fraction <= 1:
        parser.error(f"--achievable-fraction must be in (0, 1], got {fraction}")
    if args.kernels:
        if args.achievable_fraction is not None:
            parser.error("--kernels and --achievable-fraction exclude each other: the kernel model replaces the "
                         "one share of peak")
        fraction = KERNELS
    if args.dp_overlap is not None and not 0 <= args.dp_overlap <= 1:
        parser.error(f"--dp-overlap must be in [0, 1], got {args.dp_overlap}")
    reserve = DEFAULT_MEMORY_RESERVE if args.memory_reserve is None else args.memory_reserve
    if not 0 <= reserve < 1:
        parser.error(f"--memory-reserve must be in [0, 1), got {reserve}")
    if args.software is not None and args.software not in list_software():
        parser.error(f"unknown software profile {args.software!r}; choose from {', '.join(list_software())}")
    def priced(devices) -> str:
        if fraction not in (AUTO, KERNELS):
            return f"achievable fraction of peak {fraction}"
        gaps = {d: kernel_model_gap(d) for d in sorted(set(devices))}
        if fraction == KERNELS and any(gaps.values()):
            parser.error("--kernels: " + "; ".join(g for g in gaps.values() if g))
        lacking = [f"{d}: {g}" for d, g in gaps.items() if g]
        if not lacking:
            return "compute from the kernel model"
        head = "achievable fraction of peak 0.5" if len(lacking) == len(gaps) else \
            "compute from the kernel model, and the fraction of peak 0.5 where a GPU lacks it"
        return f"{head} (no kernel model for {'; '.join(lacking)})"

    if args.validate:
        import time
        started = time.perf_counter()
        devices = [load_preset(e["preset"], nodes=1).device for e in load_published().values()]
        what = priced(devices)
        rows = validate_published(achievable_fraction=fraction)
        print(f"# the planner against published runs: {what}, each row with its software profile")
        print("# ranks in the planner's own search (1 = its top): split = of the published tp x pp split, each "
              "split counted once;")
        print("#   plan = of that split's first plan among all plans; exact = of the published configuration "
              "(split and the knobs the source fixes; n/a: it fixes none)")
        print(validation_table(rows))
        print(f"# {len(rows)} rows in {time.perf_counter() - started:.2f} s")
        return 0
    missing = [f"--{n.replace('_', '-')}" for n in ("model", "preset", "gpus", "global_batch")
               if getattr(args, n) is None]
    if missing:
        parser.error(f"plan needs {', '.join(missing)} (or --validate)")
    try:
        model = load_model(args.model)
    except KeyError:
        parser.error(f"unknown model {args.model!r}; choose from {', '.join(list_models())}")
    if args.preset not in list_presets():
        parser.error(f"unknown preset {args.preset!r}; choose from {', '.join(list_presets())}")
    if args.seq is not None:
        if args.seq < 1:
            parser.error("--seq must be >= 1")
        model = model.with_seq(args.seq)
    if args.top < 1:
        parser.error("--top must be >= 1")
    what = priced([load_preset(args.preset, nodes=1).device])
    try:
        result = search(model, args.preset, args.gpus, args.global_batch, achievable_fraction=fraction,
                        dp_overlap=args.dp_overlap, even_stages=args.even_stages, software=args.software,
                        memory_reserve=reserve)
    except ValueError as e:
        parser.error(str(e))
    print(f"# {model.name}: {model.params / 1e9:.1f}B parameters, seq {model.seq}, global batch {args.global_batch} "
          f"sequences, on {args.gpus} GPUs of {args.preset}; software {args.software or 'generic-no-overlap'}; "
          f"{what}; {reserve:.0%} of device memory reserved, ! = fragile (within 5 % of the rest)")
    print(f"# {result.candidates} layouts considered in {result.elapsed_s:.2f} s: {len(result.plans)} fit, "
          f"{result.rejected_for_memory} rejected for memory, "
          f"{sum(r.kind == 'batch' for r in result.rejected)} for the batch split"
          + "".join(f", {n} because tp does not divide the {model.heads} heads and {model.kv_heads} KV heads"
                    for n in [sum(r.kind == "heads" for r in result.rejected)] if n))
    if not result.plans:
        mem = [r.reason for r in result.rejected if r.kind == "memory"]
        print("# nothing fits" + (f"; smallest need e.g. {min(mem, key=len)}" if mem else ""))
        return 1
    print(f"# step s: the replayed step timeline where the search replayed the plan (every one of the top "
          f"{TIMELINE_TOP_K}), else the analytical sum of terms (marked ~); the term columns are the analytical ones, "
          f"exposed only (slow = compute slowed by the communication hidden beside it, opt = the optimizer step)")
    width = max([34] + [len(p.layout.short()) for p in result.plans[:args.top]])  # HSDP labels are longer
    head = (f"{'#':>2} {'layout':<{width}} {'step s':>8} {'compute':>8} {'loss':>6} {'TP':>7} {'PP':>7} {'bubble':>7} "
            f"{'DP':>7} {'slow':>6} {'opt':>6} {'mem GB':>7} {'tokens/s':>11} {'TFLOP/s/GPU':>12}")
    print(head)
    for i, p in enumerate(result.plans[:args.top], 1):
        r = p.row()
        by_sum = "~" if p.timeline_step_s is None else " "
        print(f"{i:>2} {r['layout']:<{width}} {r['step_s']:>8.3f}{by_sum}{r['compute_s']:>8.3f} {r['loss_s']:>6.3f} {r['tp_s']:>7.3f} "
              f"{r['pp_s']:>7.3f} "
              f"{r['bubble_s']:>7.3f} {r['dp_s']:>7.3f} {r['slowdown_s']:>6.3f} {r['optimizer_s']:>6.3f} "
              f"{r['memory_gb']:>6.1f}{'!' if r['fragile'] else ' '} "
              f"{r['tokens_per_s']:>11.4g} "
              f"{r['tflops_per_gpu']:>12.0f}")
    return 0


def _experiments(args) -> int:
    try:
        return _experiments_action(args)
    except (FileNotFoundError, IsADirectoryError, ValueError) as e:
        print(f"python -m commlab experiments {args.action}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: the runs finished so far are recorded; run the same command again to resume",
              file=sys.stderr)
        return 130


def _experiments_action(args) -> int:
    from commlab import data
    from commlab.experiments import grid

    if args.action == "sync-link":
        from commlab.experiments import sync_link
        if args.show:
            print(sync_link.format_table(sync_link.load(args.out)))
            return 0
        result = sync_link.measure([t.strip() for t in args.tasks.split(",") if t.strip()], h=args.inner_steps,
                                   records_path=args.records, fresh=args.fresh, progress=True)
        path = sync_link.save(result, args.out)
        print(sync_link.format_table(result))
        print(f"recorded in {path}")
        return 0
    if args.action == "stragglers":
        from commlab.experiments import stragglers
        if not args.show:
            try:
                delays = [float(d) / 1e3 for d in args.delays_ms.split(",") if d.strip()]
            except ValueError:
                raise ValueError(f"--delays-ms must be comma-separated milliseconds, got {args.delays_ms!r}") from None
            result = stragglers.measure(args.world_size, delays, neighbour=not args.no_neighbour,
                                        pin=not args.no_pin, steps=args.steps)
            print(f"recorded in {stragglers.save(result, args.out)}")
        print(stragglers.format_table(stragglers.load(args.out)))
        return 0
    if args.action == "lost-work":
        from commlab.experiments import lost_work
        if not args.show:
            try:
                intervals = [int(c) for c in args.intervals.split(",") if c.strip()]
            except ValueError:
                raise ValueError(f"--intervals must be comma-separated steps, got {args.intervals!r}") from None
            cfg = lost_work.JobConfig(replicas=args.replicas, steps=args.steps)
            result = lost_work.measure(cfg, intervals=intervals, fail_step=args.fail_step,
                                       missed_steps=args.missed_steps)
            print(f"recorded in {lost_work.save(result, args.out)}")
        print(lost_work.format_table(lost_work.load(args.out)))
        return 0
    if args.action == "run":
        path = args.out or data.record_path(f"experiments/{args.grid}.jsonl")
        records = grid.run_grid(grid.grid_configs(args.grid), path, fresh=args.fresh)
        print(f"{len(records)} runs recorded in {path}")
        return 0
    if args.action == "slow-link":
        from commlab.experiments import slow_link
        result = slow_link.measure(progress=True)
        path = slow_link.save(result, args.out)
        print(slow_link.format_table(result))
        print(f"recorded in {path}")
        return 0
    from commlab.experiments import analysis
    records = grid.load_records(args.records or grid.default_path("full"))
    try:
        rows = analysis.article_table(records)
    except ValueError as e:
        raise ValueError(f"{e}; the table needs the character-LM runs of the full grid (--grid full)") from None
    print(analysis.format_article_table(rows))
    return 0


if __name__ == "__main__":
    from commlab.launch.env import exit_process
    exit_process(main())
