"""The Python half of ``scripts/gpu_check.sh``: checks that need CUDA tensors, run one part at a time.

Each part prints a table (check, result, largest error, tolerance) in the format of ``python -m commlab
selftest`` and exits non-zero if a check fails:

* ``codecs [--device cuda]`` (one process): every compressor's round trip ``decompress(compress(x))`` and
  one error-feedback step on the device, against the same compressor on the CPU. The compressors draw
  their randomness on the CPU (Random-K's indices, QSGD's uniforms), so the two must agree; a float
  reduction (a norm, a mean) may round differently on a GPU, which can move a value across a rounding
  boundary, so up to 1 in 10^4 elements may differ by one quantisation level.
* ``steps`` (under torchrun, any world size, tensors on the group's device): one
  :class:`~commlab.overlap.BucketedDataParallel` step (plain, with a commlab hook, with torch's
  ``fp16_compress_wrapper``, with PowerSGD) against the whole batch in one process; its clock marks in
  order; a pipeline step (GPipe and 1F1B, as many stages as ranks; interleaved 1F1B with v = 2 chunks per
  rank and m = 2p when there are >= 2 ranks) against the unpipelined model, with a sane timeline; ZeRO-1,
  and ZeRO-2 and ZeRO-3 (:class:`~commlab.parallel.ShardedDataParallel`), against torch's Adam;
  ``train_data_parallel`` on the device.
* ``collectives`` (under torchrun, >= 2 ranks): ring ReduceScatter / AllGather / AllReduce,
  halving-doubling, recursive doubling, the binomial tree and the hierarchical AllReduce against
  ``dist.all_reduce`` (and ``all_gather``/``reduce_scatter``) on odd sizes; AllToAllV with uneven splits
  against ``dist.all_to_all_single``.

``steps collectives`` runs both parts in one world, one table each. ``--dry-run`` is not a flag here: the shell
script runs the same parts on gloo CPU ranks with small sizes (those two in one torchrun).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.elastic.multiprocessing.errors import record

from commlab.selftest import Check, format_table, max_over_world


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    scale = ref.abs().max().item()
    return (got.to(ref.dtype) - ref).abs().max().item() / max(scale, 1e-30)


# ------------------------------------------------------------------------------------------------ codecs

def _compressors():
    from commlab.compress import (QSGD, CastCompressor, RandomK, RoundingQuantizer, SignCompressor, TopK)
    return [("cast fp16", lambda: CastCompressor(torch.float16)), ("cast bf16", lambda: CastCompressor(torch.bfloat16)),
            ("top-k 1%", lambda: TopK(0.01)), ("random-k 1%", lambda: RandomK(0.01, seed=3)),
            ("QSGD 4-bit", lambda: QSGD(bits=4, seed=3)), ("INT8", lambda: RoundingQuantizer(bits=8)),
            ("INT4", lambda: RoundingQuantizer(bits=4)), ("sign", SignCompressor)]


def _codec_rows(device: torch.device, numel: int) -> list[Check]:
    from commlab.compress import ErrorFeedback

    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for name, make in _compressors():
        cpu, dev = make(), make()
        p_cpu, p_dev = cpu.compress(x), dev.compress(x.to(device))
        y_cpu, y_dev = cpu.decompress(p_cpu), dev.decompress(p_dev).cpu()
        # Elements off by more than float rounding (a value moved across a quantisation boundary).
        off = (y_dev - y_cpu).abs() > 1e-6 * max(y_cpu.abs().max().item(), 1e-30)
        share = off.float().mean().item()
        same_bytes = p_cpu.nbytes == p_dev.nbytes
        detail = f"{int(off.sum())} of {numel} elements off; payload {p_dev.nbytes} B" + (
            "" if same_bytes else f" (CPU: {p_cpu.nbytes} B)")
        rows.append(Check(f"{name}: round trip on {device.type} vs CPU", share if same_bytes else 1.0, 1e-4, detail))
        ef_cpu, ef_dev = ErrorFeedback(make()), ErrorFeedback(make())
        for _ in range(2):  # the second step adds the first step's residual
            q_cpu, q_dev = ef_cpu.compress(x, "g"), ef_dev.compress(x.to(device), "g")
        z_cpu, z_dev = ef_cpu.compressor.decompress(q_cpu), ef_dev.compressor.decompress(q_dev).cpu()
        off = (z_dev - z_cpu).abs() > 1e-6 * max(z_cpu.abs().max().item(), 1e-30)
        rows.append(Check(f"{name} + error feedback, 2 steps", off.float().mean().item(), 1e-4,
                          f"{int(off.sum())} elements off"))
    return rows


# ------------------------------------------------------------------------------------------------- steps

def _mlp(seed: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).to(device)


def _batch(device: torch.device, rows: int = 64):
    g = torch.Generator().manual_seed(7)
    return torch.randn(rows, 32, generator=g).to(device), torch.randint(0, 10, (rows,), generator=g).to(device)


def _dp_rows(device: torch.device) -> list[Check]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from commlab.compress import (CastCompressor, CompressionHookState, PowerSGDState, TopK, compression_hook,
                                  powersgd_hook)
    from commlab.overlap import BucketedDataParallel

    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = _batch(device, 16 * n)
    ref = _mlp(0, device)
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_grads = [p.grad for p in ref.parameters()]
    mine = slice(rank * 16, (rank + 1) * 16)
    hooks = [("plain", None, None, 1e-5),
             ("compression_hook(fp16)", CompressionHookState(CastCompressor(torch.float16)), compression_hook, 2e-3),
             ("torch fp16_compress_wrapper", None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
              2e-3),
             ("powersgd_hook (start_iter 2)", PowerSGDState(rank=2, start_iter=2), powersgd_hook, None),
             # Lossless Top-K through the two-phase path: all_to_all_single and all_gather_into_tensor on the device.
             ("compression_hook(two-phase, top-k 100%, EF)",
              CompressionHookState(TopK(ratio=1.0), error_feedback=True, aggregation="two_phase"), compression_hook, 1e-5)]
    rows = []
    for name, state, hook, tol in hooks:
        model = BucketedDataParallel(_mlp(0, device), bucket_cap_bytes=4096)
        if hook is not None:
            model.register_comm_hook(state, hook)
        for step in range(3):  # PowerSGD compresses from the third step on
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        grads = [p.grad for p in model.module.parameters()]
        if tol is None:  # a low-rank approximation: finite, and the same on every rank
            flat = torch.cat([g.reshape(-1) for g in grads])
            spread = flat.clone()
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
            err = (spread - flat).abs().max().item() if bool(torch.isfinite(flat).all()) else float("inf")
            rows.append(Check(f"BucketedDataParallel, {name}", max_over_world(err, device), 1e-6,
                              "finite and equal on every rank"))
        else:
            err = max(_rel_err(g, r) for g, r in zip(grads, ref_grads))
            rows.append(Check(f"BucketedDataParallel, {name}", max_over_world(err, device), tol,
                              f"{len(model.buckets)} buckets vs the whole batch in one process"))
        rec = model.last_step
        order_bad = 0
        for b in rec.buckets:
            times = [b.ready_s, b.launch_s, b.launched_s]
            order_bad += sum(t is None or t < 0 for t in times + [b.done_s])
            order_bad += sum(a > b_ + 1e-6 for a, b_ in zip(times, times[1:]))
        rows.append(Check(f"  clock marks of {name}: present, >= 0, ready <= launch <= launched",
                          float(max_over_world(order_bad, device)), 0.0,
                          f"last gradient {rec.last_grad_s * 1e3:.3f} ms, wait ended {rec.wait_end_s * 1e3:.3f} ms"))
    return rows


def _deep_mlp(seed: int, device: torch.device, stages: int) -> nn.Sequential:
    # At least two modules per stage, however many ranks there are (an 8-GPU node runs 8 stages).
    torch.manual_seed(seed)
    hidden = [m for _ in range(max(2, stages)) for m in (nn.Tanh(), nn.Linear(64, 64))]
    return nn.Sequential(nn.Linear(32, 64), *hidden, nn.Tanh(), nn.Linear(64, 10)).to(device)


def _pipeline_rows(device: torch.device) -> list[Check]:
    from commlab.parallel.pipeline import pipeline_step, split_sequential

    p, stage = dist.get_world_size(), dist.get_rank()
    x, y = _batch(device, 32)
    full = _deep_mlp(1, device, p)
    nn.functional.cross_entropy(full(x), y).backward()
    rows = []
    for schedule in ("gpipe", "1f1b"):
        model = copy.deepcopy(full)
        model.zero_grad(set_to_none=True)
        stages = split_sequential(model, p)
        result = pipeline_step(stages[stage], x, y, nn.functional.cross_entropy, 4, None, schedule)
        ref = dict(full.named_parameters())
        names = {id(q): k for k, q in model.named_parameters()}
        err = max(_rel_err(q.grad, ref[names[id(q)]].grad) for q in stages[stage].parameters())
        rows.append(Check(f"pipeline {schedule}, {p} stage(s), 4 micro-batches: gradients", max_over_world(err, device),
                          1e-5, f"loss {result.loss:.6f} vs the unpipelined model"))
        bad = sum(op.start_s < 0 or op.end_s < op.start_s for op in result.timeline)
        rows.append(Check(f"  {schedule} timeline: {len(result.timeline)} ops, start >= 0, end >= start",
                          float(bad), 0.0, f"step {result.step_s * 1e3:.3f} ms, idle {result.idle_fraction:.2f}, "
                          f"bubble formula {result.bubble_fraction:.2f}"))
    if p >= 2:
        rows += _interleaved_rows(device, full, p, stage)
    return rows


def _interleaved_rows(device: torch.device, full: nn.Sequential, p: int, stage: int) -> list[Check]:
    """Interleaved 1F1B, v = 2 chunks per rank, m = 2p micro-batches of 4 rows (a multiple of p, as
    Megatron-LM requires, and more than p, so that the steady state's grouped forward-backward pairs run),
    against the unpipelined model on the same 8p rows."""
    from commlab.parallel.pipeline import pipeline_step, split_interleaved

    v, m = 2, 2 * p
    x, y = _batch(device, 4 * m)
    ref = copy.deepcopy(full)
    ref.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(ref(x), y).backward()
    model = copy.deepcopy(full)
    model.zero_grad(set_to_none=True)
    chunks = split_interleaved(model, p, v)[stage]
    result = pipeline_step(chunks, x, y, nn.functional.cross_entropy, m, None, "interleaved")
    grads = dict(ref.named_parameters())
    names = {id(q): k for k, q in model.named_parameters()}
    err = max([_rel_err(q.grad, grads[names[id(q)]].grad) for c in chunks for q in c.parameters()], default=0.0)
    bad = sum(op.start_s < 0 or op.end_s < op.start_s for op in result.timeline)
    return [Check(f"pipeline interleaved, {p} stages x {v} chunks, {m} micro-batches: gradients",
                  max_over_world(err, device), 1e-5, f"loss {result.loss:.6f} vs the unpipelined model"),
            Check(f"  interleaved timeline: {len(result.timeline)} ops, start >= 0, end >= start", float(bad), 0.0,
                  f"step {result.step_s * 1e3:.3f} ms, idle {result.idle_fraction:.2f}, "
                  f"bubble formula {result.bubble_fraction:.2f}")]


def _zero_rows(device: torch.device) -> list[Check]:
    from commlab.parallel.data_parallel import ZeroOneOptimizer

    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = _batch(device, 8 * n)
    ref, model = _mlp(2, device), _mlp(2, device)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = ZeroOneOptimizer(model.parameters(), None, torch.optim.Adam, lr=1e-2)
    for _ in range(3):
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        # Each rank's mean loss over its share, so that the averaged gradient is the whole batch's.
        part = slice(rank * 8, (rank + 1) * 8)
        nn.functional.cross_entropy(model(x[part]), y[part]).backward()
        opt.step()
    err = max(_rel_err(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    # Adam divides by the root of tiny second moments, which magnifies the rounding of the sharded sum.
    return [Check(f"ZeRO-1 (Adam, {n} shard(s)), 3 steps: parameters", max_over_world(err, device), 1e-4,
                  "vs torch.optim.Adam on the whole batch")]


def _sharded_rows(device: torch.device) -> list[Check]:
    """ZeRO-2 and ZeRO-3 (ShardedDataParallel) against torch's Adam on the whole batch; under NCCL this is where
    the asynchronous AllGather / ReduceScatter handles and the resized CUDA parameter storage run."""
    from commlab.parallel import ShardedDataParallel

    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = _batch(device, 8 * n)
    part = slice(rank * 8, (rank + 1) * 8)
    rows = []
    for stage in (2, 3):
        ref = _mlp(2, device)
        sdp = ShardedDataParallel(_mlp(2, device), stage=stage)
        opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt = sdp.make_optimizer(torch.optim.Adam, lr=1e-2)
        grad_err = 0.0
        for _ in range(3):
            opt_ref.zero_grad()
            nn.functional.cross_entropy(ref(x), y).backward()
            nn.functional.cross_entropy(sdp(x[part]), y[part]).backward()
            grads = zip(sdp.full_gradients(), ref.parameters())
            grad_err = max(grad_err, max(_rel_err(a, p.grad) for a, p in grads))
            opt_ref.step()
            opt.step()
            opt.zero_grad()
        err = max(_rel_err(a, b) for a, b in zip(sdp.full_parameters(), ref.parameters()))
        rows.append(Check(f"ZeRO-{stage} (ShardedDataParallel, Adam, {n} shard(s)), 3 steps: gradients",
                          max_over_world(grad_err, device), 1e-5, "vs torch.optim.Adam on the whole batch"))
        rows.append(Check(f"ZeRO-{stage} (ShardedDataParallel, Adam, {n} shard(s)), 3 steps: parameters",
                          max_over_world(err, device), 1e-4, "vs torch.optim.Adam on the whole batch"))
        if stage == 3:
            # FSDP2's layout: outside forward and backward the module's parameters are this rank's shards.
            held = sum(p.untyped_storage().nbytes() for p in sdp.module.parameters())
            shard = sum(s.numel() * s.element_size() for s in sdp.shard_parameters())
            full = sum(p.numel() * p.element_size() for p in ref.parameters())
            rows.append(Check("ZeRO-3: outside forward and backward the module holds only its shards (bytes)",
                              max_over_world(float(abs(held - shard)), device), 0.0,
                              f"{held} of the model's {full} bytes on this rank"))
    return rows


def _train_rows(device: torch.device) -> list[Check]:
    from commlab.collectives import ring_all_reduce
    from commlab.train import train_data_parallel

    result = train_data_parallel(ring_all_reduce, steps=20)
    falls = result.losses[-1] < result.losses[0]
    return [Check("train_data_parallel (digits MLP, commlab ring), 20 steps", 0.0 if falls else 1.0, 0.0,
                  f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, test accuracy {result.test_accuracy:.3f}")]


# ------------------------------------------------------------------------------------------- collectives

def _collective_rows(device: torch.device) -> list[Check]:
    from commlab.collectives import (all_to_all_v, hierarchical_all_reduce, make_hierarchy_groups, rhd_all_reduce,
                                     recursive_doubling_all_reduce, ring_all_gather, ring_all_reduce,
                                     ring_reduce_scatter, tree_all_reduce)
    from commlab.collectives.common import all_gather_single, chunk_bounds

    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    algorithms = [("ring AllReduce", ring_all_reduce), ("halving-doubling AllReduce", rhd_all_reduce),
                  ("recursive doubling AllReduce", recursive_doubling_all_reduce),
                  ("binomial tree AllReduce", tree_all_reduce)]
    if n >= 4 and n % 2 == 0:
        groups = make_hierarchy_groups([r // (n // 2) for r in range(n)])
        algorithms.append((f"hierarchical AllReduce (2 x {n // 2})", lambda t: hierarchical_all_reduce(t, groups)))
    for count in (1, 1023, 1 << 20):
        x = torch.randn(count, generator=torch.Generator().manual_seed(rank * 7 + count)).to(device)
        ref = x.clone()
        dist.all_reduce(ref)
        for name, fn in algorithms:
            rows.append(Check(f"{name}, {count} x float32", max_over_world(_rel_err(fn(x), ref), device), 1e-5,
                              "vs dist.all_reduce"))
        a, b = chunk_bounds(count, n)[rank]
        rows.append(Check(f"ring ReduceScatter, {count} x float32",
                          max_over_world(_rel_err(ring_reduce_scatter(x), ref[a:b]), device), 1e-5,
                          "vs dist.all_reduce's chunk"))
        gathered = torch.empty(n * count, device=device)
        all_gather_single(gathered, x)
        rows.append(Check(f"ring AllGather, {count} x float32",
                          max_over_world(_rel_err(ring_all_gather(x), gathered), device), 0.0,
                          "vs dist.all_gather_into_tensor"))
    # AllToAllV: uneven split sizes with zeros among them (rank i sends (i + 2j) % 3 rows of 5 to rank j, times a
    # scale), every message a grouped point-to-point on the device, against NCCL's own all_to_all_single.
    for scale in (1, 4096):
        splits = [[(i + 2 * j) % 3 * scale for j in range(n)] for i in range(n)]
        ins, outs = splits[rank], [row[rank] for row in splits]
        x = torch.randn(sum(ins), 5, generator=torch.Generator().manual_seed(rank + scale)).to(device)
        ref = x.new_empty((sum(outs), 5))
        dist.all_to_all_single(ref, x, outs, ins)
        rows.append(Check(f"AllToAllV, uneven splits x {scale}, rows of 5 x float32",
                          max_over_world(_rel_err(all_to_all_v(x, outs, ins), ref), device), 0.0,
                          "vs dist.all_to_all_single"))
    return rows


# ------------------------------------------------------------------------------------------------- main

def _table(part: str, rows: list[Check], world: int, backend: str, launcher: str) -> str:
    # selftest's table, under this script's own heading
    return f"# gpu_check {part}: {world} rank(s), backend {backend}, launcher {launcher}\n" + \
        format_table(rows, world, backend, launcher).split("\n", 1)[1]


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", choices=["codecs", "steps", "collectives"], metavar="part",
                        help="codecs, steps or collectives; steps and collectives together run in one world")
    parser.add_argument("--device", default=None, help="codecs: cuda (default when available) or cpu")
    parser.add_argument("--numel", type=int, default=1 << 20, help="codecs: elements of the test tensor")
    args = parser.parse_args(argv)
    if "codecs" in args.parts and len(args.parts) > 1:
        parser.error(f"codecs runs alone, in one process without torchrun; got {' '.join(args.parts)}")
    if args.parts == ["codecs"]:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        rows = _codec_rows(device, args.numel)
        print(_table(f"codecs on {device}", rows, 1, device.type, "none"))
        return 0 if all(r.ok for r in rows) else 1

    from commlab.launch import init_from_env
    ctx = init_from_env()
    device = ctx.device
    if "collectives" in args.parts and ctx.world_size < 2:
        raise SystemExit("gpu_check collectives needs >= 2 ranks")
    ok = True
    for part in args.parts:   # one table each, in the order given
        if part == "steps":
            rows = _dp_rows(device) + _pipeline_rows(device) + _zero_rows(device) + _sharded_rows(device) + \
                _train_rows(device)
        else:
            rows = _collective_rows(device)
        if ctx.rank == 0:
            print(_table(part, rows, ctx.world_size, ctx.backend, ctx.launcher), flush=True)
        ok = ok and all(r.ok for r in rows)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from commlab.launch.env import exit_process
    exit_process(main())
