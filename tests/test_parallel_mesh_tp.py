"""The 3D mesh (pure arithmetic and on 8 gloo ranks) and the tensor-parallel layers against their full modules.

Tolerances: the TP layers compute the same sums in a different order (a matmul split into t partial sums,
then all-reduced), so they are not bit-identical to the full module. In float64 the differences are a few
ulps of the values: we require ``allclose(rtol=1e-10, atol=1e-12)``; in float32 ``rtol=1e-5, atol=1e-5``
(measured here: largest absolute difference 3e-15 in float64, 1e-6 in float32).
"""

import pytest
import torch
import torch.distributed as dist

from commlab import RankError, launch
from commlab.parallel.mesh import (MESH_DIMS, ParallelLayout, build_mesh, check_layout, check_order,
                                   cross_node_groups, mesh_groups, order_report)
from commlab.parallel.tensor import (ColumnParallelLinear, TransformerMLP, ParallelMLP, ParallelSelfAttention,
                                     RowParallelLinear, SelfAttention, block_allreduce_nbytes, f, g)

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


# -- pure arithmetic -------------------------------------------------------------------------------------------

def test_coords_put_tp_innermost_and_invert_rank_of():
    lay = ParallelLayout(2, 2, 2, devices_per_node=8)
    assert lay.world_size == 8 and lay.num_nodes == 1
    assert [lay.coords(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                                 (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    for r in range(8):
        assert lay.rank_of(*lay.coords(r)) == r
        assert lay.rank_of(*lay.coords(r, ("tp", "pp", "dp")), order=("tp", "pp", "dp")) == r
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.group_of(5, "dp") == [1, 5] and lay.group_of(5, "tp") == [4, 5]


def test_groups_partition_the_world_for_uneven_sizes():
    lay = ParallelLayout(3, 2, 4, devices_per_node=8)
    for dim in MESH_DIMS:
        for order in (MESH_DIMS, ("tp", "pp", "dp"), ("pp", "dp", "tp")):
            groups = lay.groups(dim, order)
            assert sorted(r for grp in groups for r in grp) == list(range(24))
            assert all(len(grp) == lay.size(dim) for grp in groups)
    assert lay.groups("tp")[1] == [4, 5, 6, 7]
    assert [lay.node_of(r) for r in (0, 7, 8, 23)] == [0, 0, 1, 2] and lay.num_nodes == 3


def test_flipped_order_makes_tp_cross_nodes():
    lay = ParallelLayout(2, 2, 2, devices_per_node=4)
    default = cross_node_groups(lay)
    assert default["tp"] == [] and default["pp"] == []
    assert default["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    flipped = ("tp", "pp", "dp")
    assert lay.groups("tp", flipped) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("dp", flipped) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    crossing = cross_node_groups(lay, flipped)
    assert crossing["tp"] == lay.groups("tp", flipped) and crossing["dp"] == []
    text = order_report(lay, flipped)
    assert "tp: [[0, 4], [1, 5], [2, 6], [3, 7]]  (4 of 4 cross nodes)" in text
    assert "tp: [[0, 1], [2, 3], [4, 5], [6, 7]]  (all inside a node)" in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(dp=2, pp=2, tp=4, devices_per_node=6), r"tp=4 does not divide devices_per_node=6.*inside a node"),
    (dict(dp=0, pp=1, tp=1, devices_per_node=1), r"dp must be an int >= 1, got 0"),
    (dict(dp=1, pp=1.0, tp=1, devices_per_node=1), r"pp must be an int >= 1"),
    (dict(dp=1, pp=1, tp=True, devices_per_node=1), r"tp must be an int >= 1"),
])
def test_bad_layouts_are_refused_with_reasons(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


def test_bad_orders_and_sizes_name_the_problem():
    lay = ParallelLayout(2, 2, 2, devices_per_node=8)
    with pytest.raises(ValueError, match=r"2 x pp 2 x tp 2 = 8 ranks but the world has 4"):
        check_layout(lay, 4)
    with pytest.raises(ValueError, match=r"duplicate.*\['tp'\]"):
        check_order(("dp", "tp", "tp"))
    with pytest.raises(ValueError, match=r"unknown mesh dimension name\(s\) \['cp'\]"):
        check_order(("dp", "pp", "cp"))
    with pytest.raises(ValueError, match=r"got 2 names.*missing \['tp'\]"):
        check_order(("dp", "pp"))
    with pytest.raises(ValueError, match="unknown mesh dimension 'ep'"):
        lay.groups("ep")
    with pytest.raises(ValueError, match=r"rank must be an int in 0..7"):
        lay.coords(8)
    with pytest.raises(ValueError, match=r"tp coordinate must be an int in 0..1"):
        lay.rank_of(0, 0, 2)


# -- build_mesh on gloo ranks ----------------------------------------------------------------------------------

def _mesh_groups_reduce(order):
    lay = ParallelLayout(2, 2, 2, devices_per_node=4)
    mesh = build_mesh(lay, world_size=8, order=order)
    out = {}
    for dim, group in mesh_groups(mesh).items():
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=group)
        out[dim] = (int(x.item()), sorted(dist.get_process_group_ranks(group)))
    return tuple(mesh.mesh_dim_names), tuple(mesh.mesh.shape), out


@pytest.mark.slow
@pytest.mark.parametrize("order", [MESH_DIMS, ("tp", "pp", "dp")])
def test_build_mesh_groups_all_reduce_within_the_expected_ranks(order):
    lay = ParallelLayout(2, 2, 2, devices_per_node=4)
    results = launch(_mesh_groups_reduce, 8, order, timeout=60)
    for rank, (names, shape, out) in enumerate(results):
        assert names == order and shape == (2, 2, 2)
        for dim in MESH_DIMS:
            want = lay.group_of(rank, dim, order)
            assert out[dim] == (sum(want), want), (rank, dim)


def _bad_mesh(per_rank_layout):
    lay = per_rank_layout(dist.get_rank())
    try:
        build_mesh(lay)
    except ValueError as exc:
        return str(exc)
    return None


def _product_mismatch(rank):
    return ParallelLayout(2, 2, 1, devices_per_node=4)


def _one_rank_differs(rank):
    return ParallelLayout(1, 2, 2, devices_per_node=4) if rank == 3 else ParallelLayout(2, 1, 2, devices_per_node=4)


def test_build_mesh_errors_are_raised_identically_on_every_rank():
    msgs = launch(_bad_mesh, 8, _product_mismatch, timeout=60)
    assert len(set(msgs)) == 1 and "= 4 ranks but the world has 8" in msgs[0]
    msgs = launch(_bad_mesh, 4, _one_rank_differs, timeout=60)
    assert len(set(msgs)) == 1 and "ranks passed different layouts" in msgs[0]
    assert "rank 3: (dp=1, pp=2, tp=2" in msgs[0]


# -- tensor-parallel layers ------------------------------------------------------------------------------------

def _tp_group(dp, pp, tp):
    mesh = build_mesh(ParallelLayout(dp, pp, tp, devices_per_node=tp * 2))
    return mesh, mesh.get_group("tp")


def _data(shape, seed, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _maxdiff(pairs, dtype):
    """Per named pair: (max abs difference, allclose at TOL[dtype])."""
    return {name: (float((a - b).abs().max()), bool(torch.allclose(a, b, **TOL[dtype]))) for name, (a, b) in pairs.items()}


def _compare_layers(dp, pp, tp, dtype):
    mesh, group = _tp_group(dp, pp, tp)
    dp_coord = mesh.get_local_rank("dp")
    b, s, h, heads, ffn = 2, 5, 16, 4, 32
    report = {}

    def run(full, par, name, sublayers):
        """Same input and same loss weights for both; compare output, input gradient, and each sublayer's
        gathered weight, weight gradient and bias gradient with the full module's."""
        in_f = full.in_features if isinstance(full, torch.nn.Linear) else h
        out_f = full.out_features if isinstance(full, torch.nn.Linear) else h
        # Different DP replicas see different data; the TP ranks of one replica see the same.
        x = _data((b, s, in_f), 100 + dp_coord, dtype).requires_grad_()
        xp = x.detach().clone().requires_grad_()
        w_out = _data((b, s, out_f), 7, dtype)
        y = full(x)
        (y * w_out).sum().backward()
        yp = par(xp)
        (yp * w_out).sum().backward()
        pairs = {"out": (yp, y), "dx": (xp.grad, x.grad)}
        for sub in sublayers:
            ours, ref = (par, full) if sub == "" else (getattr(par, sub), getattr(full, sub))
            pairs[f"{sub}.weight"] = (ours.full_weight(), ref.weight)
            pairs[f"{sub}.bias"] = (ours.full_bias(), ref.bias)
            pairs[f"{sub}.weight.grad"] = (ours.full_weight(grad=True), ref.weight.grad)
            pairs[f"{sub}.bias.grad"] = (ours.full_bias(grad=True), ref.bias.grad)
        report[name] = _maxdiff({k: (a.detach(), c.detach()) for k, (a, c) in pairs.items()}, dtype)

    torch.manual_seed(0)
    col_full = torch.nn.Linear(h, ffn, dtype=dtype)
    run(col_full, ColumnParallelLinear(col_full, group, gather_output=True), "column", [""])
    row_full = torch.nn.Linear(ffn, h, dtype=dtype)
    run(row_full, RowParallelLinear(row_full, group, input_is_parallel=False), "row", [""])
    mlp = TransformerMLP(h, ffn, dtype=dtype)
    run(mlp, ParallelMLP(mlp, group), "mlp", ["fc1", "fc2"])
    for causal in (True, False):
        attn = SelfAttention(h, heads, causal=causal, dtype=dtype)
        run(attn, ParallelSelfAttention(attn, group), f"attn_causal={causal}", ["qkv", "proj"])
    # from_seed builds the same shards as sharding the full layer built from that seed.
    torch.manual_seed(3)
    ref = TransformerMLP(h, ffn, dtype=dtype)
    seeded = ParallelMLP.from_seed(h, ffn, group, seed=3, dtype=dtype)
    report["from_seed"] = {"fc1.weight": (0.0, torch.equal(seeded.fc1.full_weight(), ref.fc1.weight.detach()))}
    return report


@pytest.mark.slow
@pytest.mark.parametrize("dp, pp, tp, dtype", [
    (2, 1, 1, torch.float64),   # tp = 1: the layers must reduce to the full module, with no communication
    (2, 2, 2, torch.float64),   # 8 ranks, 4 TP groups of 2 (different data per DP replica)
    (2, 1, 4, torch.float64),   # 8 ranks, 2 TP groups of 4
    (1, 1, 4, torch.float32),
])
def test_tp_layers_equal_the_full_modules_in_output_and_gradients(dp, pp, tp, dtype):
    results = launch(_compare_layers, dp * pp * tp, dp, pp, tp, dtype, timeout=60)
    bad = [(rank, layer, what, diff) for rank, report in enumerate(results)
           for layer, rows in report.items() for what, (diff, ok) in rows.items() if not ok]
    assert bad == [], bad
    assert set(results[0]) == {"column", "row", "mlp", "attn_causal=True", "attn_causal=False", "from_seed"}


def _indivisible_shards():
    _, group = _tp_group(1, 1, 4)
    msgs = []
    for build in (lambda: ParallelSelfAttention(SelfAttention(12, 6), group),
                  lambda: ParallelMLP(TransformerMLP(8, 18), group),
                  lambda: ColumnParallelLinear(torch.nn.Linear(8, 6), group),
                  lambda: RowParallelLinear(torch.nn.Linear(6, 8), group)):
        try:
            build()
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def test_shards_that_do_not_divide_by_tp_are_refused():
    results = launch(_indivisible_shards, 4, timeout=60)
    assert all(r == results[0] for r in results)
    heads, ffn, col, row = results[0]
    assert "heads (6) must be divisible by the tensor-parallel size (4)" in heads
    assert "ffn_hidden (18) must be divisible by the tensor-parallel size (4)" in ffn
    assert "out_features (6) must be divisible by fused (1) x the tensor-parallel size (4)" in col
    assert "in_features (6) must be divisible by the tensor-parallel size (4)" in row


def _f_and_g():
    _, group = _tp_group(1, 1, 2)
    r = dist.get_rank()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = f(x, group)
    (y * (r + 1)).sum().backward()
    fx, fgrad = y.detach().tolist(), x.grad.tolist()
    x2 = torch.full((3,), float(r + 1), requires_grad=True)
    z = g(x2, group)
    (z * (r + 1)).sum().backward()
    return fx, fgrad, z.detach().tolist(), x2.grad.tolist()


def test_f_and_g_are_conjugate():
    results = launch(_f_and_g, 2, timeout=60)
    # f: identity forward; backward sums the ranks' gradients (1 + 2 = 3).
    assert [r[0] for r in results] == [[1.0] * 3, [2.0] * 3]
    assert [r[1] for r in results] == [[3.0] * 3, [3.0] * 3]
    # g: forward sums (1 + 2 = 3); backward passes each rank's own gradient through.
    assert [r[2] for r in results] == [[3.0] * 3, [3.0] * 3]
    assert [r[3] for r in results] == [[1.0] * 3, [2.0] * 3]


def _timed_mlp():
    from commlab.launch import Clock
    from commlab.parallel.tensor.communications import CommTimer, timed, untimed
    _, group = _tp_group(1, 1, 2)
    mlp = ParallelMLP(TransformerMLP(8, 16), group)
    timer = CommTimer(Clock())
    x = torch.randn(4, 8, requires_grad=True)
    with timed(group, timer):
        mlp(x).sum().backward()          # g forward, f backward: two AllReduces
        with untimed():
            mlp(x)                       # not counted
        try:
            with timed(group, CommTimer(Clock())):
                pass
            nested = None
        except RuntimeError as e:
            nested = str(e)
    outside = timer.calls
    mlp(x).sum().backward()              # after the block: not counted either
    return timer.calls, outside, timer.seconds() > 0, nested


def test_comm_timer_counts_the_tp_collectives_inside_timed_only():
    for calls, outside, positive, nested in launch(_timed_mlp, 2, timeout=60):
        assert calls == outside == 2 and positive
        assert "already being timed" in nested


def test_block_allreduce_nbytes():
    assert block_allreduce_nbytes(2, 1024, 4096, 2, tp=8) == {"forward": 2 * 1024 * 4096 * 2,
                                                              "backward": 2 * 1024 * 4096 * 2}
    assert block_allreduce_nbytes(2, 1024, 4096, 2, tp=1) == {"forward": 0, "backward": 0}
    with pytest.raises(ValueError, match="seq must be an int >= 1"):
        block_allreduce_nbytes(2, 0, 4096, 2, tp=2)


# -- sequence parallelism (Korthikanti et al. 2022, §4.2.2) -----------------------------------------------------

def _sequence_parallel_vs_tp():
    from commlab.launch import Clock
    from commlab.parallel.tensor.communications import (CommTimer, gather_sequence, reduce_scatter_sequence,
                                                        timed)
    _, group = _tp_group(1, 1, 2)
    r = dist.get_rank()
    b, s, h, heads, ffn = 2, 6, 16, 4, 32
    dtype = torch.float64
    report = {}

    def run(make, name):
        full = make()
        tp_block, sp_block = make_parallel(full, False), make_parallel(full, True)
        x = _data((b, s, h), 100, dtype)
        w_out = _data((b, s, h), 7, dtype)
        xt, xs = x.clone().requires_grad_(), x.chunk(2, dim=1)[r].clone().requires_grad_()
        yt = tp_block(xt)
        (yt * w_out).sum().backward()
        ys = sp_block(xs)
        (ys * w_out.chunk(2, dim=1)[r]).sum().backward()
        pairs = {"out": (ys, yt.chunk(2, dim=1)[r]), "dx": (xs.grad, xt.grad.chunk(2, dim=1)[r])}
        for (pname, ps), (_, pt) in zip(sp_block.named_parameters(), tp_block.named_parameters()):
            pairs[f"{pname}.grad"] = (ps.grad, pt.grad)
        report[name] = _maxdiff({k: (a.detach(), c.detach()) for k, (a, c) in pairs.items()}, dtype)

    def make_parallel(full, sp):
        cls = ParallelMLP if isinstance(full, TransformerMLP) else ParallelSelfAttention
        return cls(full, group, sequence_parallel=sp)

    torch.manual_seed(0)
    run(lambda: TransformerMLP(h, ffn, dtype=dtype), "mlp")
    for causal in (True, False):
        run(lambda: SelfAttention(h, heads, causal=causal, dtype=dtype), f"attn_causal={causal}")
    # The operators themselves, against torch's collectives.
    x = torch.full((1, 2, 3), float(r + 1), dtype=dtype, requires_grad=True)
    gathered = gather_sequence(x, group)
    (gathered * torch.arange(4.0, dtype=dtype).view(1, 4, 1)).sum().backward()
    y = torch.arange(12.0, dtype=dtype).view(1, 4, 3).mul(r + 1).requires_grad_()
    scattered = reduce_scatter_sequence(y, group)
    scattered.sum().backward()
    ops = (gathered.detach()[0, :, 0].tolist(), x.grad[0, :, 0].tolist(), scattered.detach()[0, :, 0].tolist(),
           y.grad[0, :, 0].tolist())
    try:
        reduce_scatter_sequence(torch.zeros(1, 5, 3), group)
        odd = None
    except ValueError as e:
        odd = str(e)
    # Activation memory: bytes autograd saves for backward (distinct storages), LayerNorm then the MLP block.
    def saved(fn, z):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(z)
        return sum(seen.values())
    full, ln = TransformerMLP(h, ffn, dtype=dtype), torch.nn.LayerNorm(h, dtype=dtype)
    tp_mlp, sp_mlp = ParallelMLP(full, group), ParallelMLP(full, group, sequence_parallel=True)
    x = _data((b, s, h), 9, dtype).requires_grad_()
    xs = x.detach().chunk(2, dim=1)[r].clone().requires_grad_()
    memory = {"tp layer": saved(lambda z: tp_mlp(ln(z)), x), "sp layer": saved(lambda z: sp_mlp(ln(z)), xs),
              "tp block": saved(tp_mlp, x), "sp block": saved(sp_mlp, xs)}
    timer = CommTimer(Clock())
    mlp = ParallelMLP(TransformerMLP(h, ffn, dtype=dtype), group, sequence_parallel=True)
    with timed(group, timer):
        mlp(_data((b, 3, h), 5, dtype).requires_grad_()).sum().backward()
    return report, ops, odd, timer.calls, memory


def test_sequence_parallel_blocks_equal_the_tp_blocks():
    results = launch(_sequence_parallel_vs_tp, 2, timeout=60)
    bad = [(rank, block, what, diff) for rank, (report, *_) in enumerate(results)
           for block, rows in report.items() for what, (diff, ok) in rows.items() if not ok]
    assert bad == [], bad
    assert set(results[0][0]) == {"mlp", "attn_causal=True", "attn_causal=False"}
    assert {"fc1.weight.grad", "fc2.bias.grad", "dx"} <= set(results[0][0]["mlp"])
    (ops0, ops1) = (results[0][1], results[1][1])
    # g: all-gather along the sequence forward (rank 0's rows, then rank 1's), reduce-scatter backward: rank 0
    # gets the summed gradient of rows 0-1 (weights 0, 1 from each rank: 2 * [0, 1]), rank 1 of rows 2-3.
    assert ops0[0] == ops1[0] == [1.0, 1.0, 2.0, 2.0]
    assert ops0[1] == [0.0, 2.0] and ops1[1] == [4.0, 6.0]
    # ḡ: reduce-scatter forward (rows 0-1 of the sum 3 * arange on rank 0, rows 2-3 on rank 1), all-gather back.
    assert ops0[2] == [0.0, 9.0] and ops1[2] == [18.0, 27.0]
    assert ops0[3] == ops1[3] == [1.0] * 4
    assert "must be divisible by the tensor-parallel size (2), got shape [1, 5, 3]" in results[0][2]
    # Forward: all-gather + reduce-scatter; backward: all-gather, reduce-scatter, and the bias's all-reduce.
    assert [res[3] for res in results] == [5, 5]
    # Measured activation memory: the LayerNorm region's activations (its input, b*s*h float64, and its mean and
    # 1/std, b*s each) are split by t = 2; inside the block the saved tensors are TP's (fc1 saves the gathered
    # input: Megatron re-gathers it in backward instead, which this block does not do).
    b, s, h = 2, 6, 16
    for *_, memory in results:
        assert memory["sp block"] == memory["tp block"]
        assert memory["tp layer"] - memory["sp layer"] == (b * s * h + 2 * b * s) * 8 // 2
