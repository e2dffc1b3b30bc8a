"""Context parallelism: ring attention (contiguous and load-balanced), DeepSpeed-Ulysses and all-gathered K/V
against torch's own full attention in one process, on 4 gloo ranks (N = 4 over the world, N = 2 over two
pairs of ranks), and their bad-input errors; the block schedule and the cost formulas as pure arithmetic.

One launch for the whole module (``job``, module-scoped); every assertion reads its results.

Tolerance: float64, ``rtol=1e-10, atol=1e-12``: the blockwise online softmax sums the same terms in another
order, so the results differ from ``scaled_dot_product_attention`` by a few ulps (largest difference measured
here 1.8e-15).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as Fn

from commlab import launch
from commlab.parallel.context import (RingAttentionStats, all_gather_attention, block_plan, covered_pairs,
                                      positions, ring_attention, shard_sequence, ulysses_attention,
                                      unshard_sequence)

B, H, S, D = 2, 4, 16, 8          # seq 16 over N = 4: 4 tokens a rank, chunks of 2 when load-balanced
TOL = dict(rtol=1e-10, atol=1e-12)
METHODS = {"ring": (ring_attention, False), "ring-lb": (ring_attention, True), "ulysses": (ulysses_attention, False),
           "all-gather": (all_gather_attention, False), "all-gather-lb": (all_gather_attention, True)}


def _full(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(4)]  # q, k, v, dout


def _reference(causal, seed):
    q, k, v, dout = _full(seed)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _compare(group, n, rank, method, causal, seed):
    fn, lb = METHODS[method]
    q, k, v, dout = (shard_sequence(t, rank, n, lb) for t in _full(seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    stats = RingAttentionStats()
    kwargs = dict(causal=causal)
    if fn is not ulysses_attention:
        kwargs["load_balance"] = lb
    if fn is ring_attention:
        kwargs["stats"] = stats
    out = fn(q, k, v, group, **kwargs)
    out.backward(dout)
    ref = [shard_sequence(t, rank, n, lb) for t in _reference(causal, seed)]
    got = [out.detach(), q.grad, k.grad, v.grad]
    diffs = {name: (float((a - b).abs().max()), torch.allclose(a, b, **TOL))
             for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
    return dict(diffs=diffs, stats=stats, out=out.detach())


def _compare_gqa(group, n, rank, kv_heads, causal, seed, heads=H, seq=S):
    """Ulysses with ``kv_heads`` K/V heads (each rank sent those its query heads use) against full attention whose
    K/V heads are repeated to the query heads (grouped-query attention by definition)."""
    H, S = heads, seq   # the module's shape unless given
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, S, D, dtype=torch.float64, generator=g) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = H // kv_heads
    ref = Fn.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(rep, 1),
                                          leaves[2].repeat_interleave(rep, 1), is_causal=causal)
    ref.backward(dout)
    local = [shard_sequence(t, rank, n).requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*local, group, causal=causal)
    out.backward(shard_sequence(dout, rank, n))
    got = [out.detach()] + [t.grad for t in local]
    want = [shard_sequence(t, rank, n) for t in [ref.detach()] + [t.grad for t in leaves]]
    return {name: (float((a - b).abs().max()), a.shape == b.shape and torch.allclose(a, b, **TOL))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


def _bf16_ring(rank):
    """Ring attention on bfloat16 inputs (arithmetic and dK/dV in float32) against float64 full attention of the
    same rounded inputs; returns the largest errors and the bytes sent."""
    q, k, v, dout = (t.to(torch.bfloat16) for t in _full(11))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = Fn.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    ref.backward(dout.double())
    ql, kl, vl = (shard_sequence(t, rank, 4, True).requires_grad_() for t in (q, k, v))
    stats = RingAttentionStats()
    out = ring_attention(ql, kl, vl, causal=True, load_balance=True, stats=stats)
    out.backward(shard_sequence(dout, rank, 4, True))
    got = (out, ql.grad, kl.grad, vl.grad)
    want = (ref.detach(), qr.grad, kr.grad, vr.grad)
    errors = [float((a.double() - shard_sequence(b, rank, 4, True)).abs().max()) for a, b in zip(got, want)]
    return dict(errors=errors, dtypes=[str(t.dtype) for t in got], stats=stats)


def _job():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    singles = [dist.new_group([r]) for r in range(4)]
    results = {}
    for (label, group, n, grank) in (("world", None, 4, rank), ("pair", pair, 2, rank % 2),
                                     ("single", singles[rank], 1, 0)):
        for method in METHODS:
            for causal in (False, True):
                results[(label, method, causal)] = _compare(group, n, grank, method, causal, seed=7 + (rank // 2 if
                                                            label == "pair" else 0))
        for causal in (False, True):
            for kv_heads in (1, 2):
                results[(label, f"ulysses-gqa{kv_heads}", causal)] = _compare_gqa(group, n, grank, kv_heads, causal,
                                                                                seed=5 + (rank // 2 if label == "pair"
                                                                                          else 0))
    x = torch.zeros(1, 4, 4, 8, dtype=torch.float64)
    errors = {
        # Ulysses on 4 ranks with 6 heads.
        "heads": _error(lambda: ulysses_attention(*[torch.zeros(1, 6, 4, 8, dtype=torch.float64)] * 3)),
        # load balance needs two chunks a rank: seq_local 3 is odd.
        "odd": _error(lambda: ring_attention(*[torch.zeros(1, 4, 3, 8, dtype=torch.float64)] * 3, load_balance=True)),
        # rank 1 has 5 tokens, the others 4.
        "mismatch": _error(lambda: ring_attention(*[torch.zeros(1, 4, 5 if rank == 1 else 4, 8,
                                                                dtype=torch.float64)] * 3)),
        # rank 3 alone asks for a causal mask.
        "options": _error(lambda: all_gather_attention(x, x, x, causal=rank == 3)),
        # [batch, seq, hidden] instead of [batch, heads, seq, head_dim].
        "dims": _error(lambda: ring_attention(*[torch.zeros(1, 4, 32, dtype=torch.float64)] * 3)),
        "kv_shape": _error(lambda: ulysses_attention(x, torch.zeros(1, 4, 4, 4, dtype=torch.float64), x)),
    }
    # Bytes saved for backward, per rank: ring attention keeps this rank's blocks only.
    saved = {}
    for method in ("ring", "all-gather"):
        q, k, v = (shard_sequence(t, rank, 4).requires_grad_() for t in _full(7)[:3])
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            METHODS[method][0](q, k, v, causal=True)
        saved[method] = sum(seen.values())
    # The group still works after the refused calls (nothing was left half-sent).
    after = ring_attention(x + 1, x + 1, x + 1)
    return dict(results=results, errors=errors, after=float(after.sum()), saved=saved, bf16=_bf16_ring(rank))


@pytest.fixture(scope="module")
def job():
    return launch(_job, 4, timeout=120)


@pytest.mark.parametrize("label", ["world", "pair", "single"])
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("causal", [False, True])
def test_output_and_gradients_equal_full_attention(job, label, method, causal):
    for rank, res in enumerate(job):
        diffs = res["results"][(label, method, causal)]["diffs"]
        assert all(ok for _, ok in diffs.values()), (rank, diffs)


@pytest.mark.parametrize("label", ["world", "pair", "single"])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_with_replicated_kv_heads_equals_full_attention(job, label, kv_heads, causal):
    # H = 4 query heads: K/V heads 1 or 2 are replicated N / gcd(N, kv_heads) times (4 or 2 at N = 4, 2 or 1 at
    # N = 2); dK and dV come back summed over the replicas.
    for rank, res in enumerate(job):
        diffs = res["results"][(label, f"ulysses-gqa{kv_heads}", causal)]
        assert all(ok for _, ok in diffs.values()), (rank, diffs)


def _gqa_outside_verl(causal):
    rank = dist.get_rank()
    return {f"h{h}_kv{kv}": _compare_gqa(None, 3, rank, kv, causal, seed=5, heads=h, seq=12)
            for h, kv in ((12, 4), (6, 2), (12, 6), (6, 1))}


@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_where_n_and_kv_heads_do_not_divide_equals_full_attention(causal):
    # N = 3 with 4 or 2 K/V heads: neither divides the other (outside verl's rule). Each rank is sent only the
    # K/V heads its query heads use (2 of 4 for 12 heads, not the 4 that N / gcd(N, a_kv) = 3 copies gave).
    for rank, res in enumerate(launch(_gqa_outside_verl, 3, causal, timeout=90)):
        for case, diffs in res.items():
            assert all(ok for _, ok in diffs.values()), (rank, case, diffs)


def test_ring_bytes_and_exchanges_are_the_formula(job):
    block = B * H * (S // 4) * D * 8  # bytes of one rank's K (float64) at N = 4
    for res in job:
        st = res["results"][("world", "ring", True)]["stats"]
        assert (st.forward_exchanges, st.backward_exchanges) == (3, 3 + 4)
        assert st.forward_nbytes_sent == 3 * 2 * block
        assert st.backward_nbytes_sent == 3 * 2 * block + 4 * 2 * block


def test_ring_attention_in_bfloat16(job):
    from commlab.parallel.context.cost import ring_attention_nbytes
    want = ring_attention_nbytes(B, S, H, D, 4, 2)   # dK/dV travel in float32
    for res in job:
        bf = res["bf16"]
        assert bf["dtypes"] == ["torch.bfloat16"] * 4
        # bfloat16 keeps 8 significant bits: outputs of order 1 round by up to 1/128 (measured: at most 0.0065).
        assert max(bf["errors"]) < 0.02, bf["errors"]
        assert (bf["stats"].forward_nbytes_sent, bf["stats"].backward_nbytes_sent) == (want["forward"],
                                                                                       want["backward"])


def test_load_balance_evens_the_causal_work(job):
    s = S // 4
    plain = [res["results"][("world", "ring", True)]["stats"].score_entries for res in job]
    balanced = [res["results"][("world", "ring-lb", True)]["stats"].score_entries for res in job]
    assert plain == [(r + 1) * s * s for r in range(4)]       # rank r computes r+1 whole blocks
    assert balanced == [s * s + 3 * s * s // 2] * 4           # its own block, then half a block per step


def test_ring_attention_saves_only_this_ranks_blocks_for_backward(job):
    block = B * H * (S // 4) * D * 8
    for res in job:
        # q, k, v, out and the log-sum-exp (one float64 per row): not the sequence's K/V, not the scores.
        assert res["saved"]["ring"] == 4 * block + block // D
        # All-gathered K/V: at least the gathered K and V and the [s/N, s] scores per head.
        assert res["saved"]["all-gather"] >= 2 * 4 * block + B * H * (S // 4) * S * 8


def test_ulysses_refuses_heads_not_divisible_by_n(job):
    assert all(res["errors"]["heads"] == job[0]["errors"]["heads"] for res in job)
    kind, msg = job[0]["errors"]["heads"]
    assert kind == "CollectiveMismatchError"
    assert "heads (6) must be a multiple of the context-parallel size N = 4" in msg


def test_load_balance_refuses_an_odd_local_sequence(job):
    assert all(res["errors"]["odd"] == job[0]["errors"]["odd"] for res in job)
    assert "seq_local must be even, got 3" in job[0]["errors"]["odd"][1]
    assert "multiple of 2N = 8" in job[0]["errors"]["odd"][1]


def test_ranks_that_disagree_all_raise_the_same_error(job):
    for case, needle in (("mismatch", "rank 1: [1, 4, 5, 8, 1, 4, 5, 8, 1, 4, 5, 8, 0, 0]"),
                         ("options", "rank 3: [1, 4, 4, 8, 1, 4, 4, 8, 1, 4, 4, 8, 1, 0]")):
        assert all(res["errors"][case] == job[0]["errors"][case] for res in job), case
        kind, msg = job[0]["errors"][case]
        assert kind == "CollectiveMismatchError" and needle in msg, msg


def test_wrong_layout_is_named(job):
    kind, msg = job[0]["errors"]["dims"]
    assert kind == "CollectiveMismatchError" and "[batch, heads, seq_local, head_dim] (4 dims)" in msg
    assert "k and v must have q's shape" in job[0]["errors"]["kv_shape"][1]
    assert all(res["errors"] == job[0]["errors"] for res in job)


def test_group_still_works_after_refused_calls(job):
    assert [res["after"] for res in job] == [float(4 * 4 * 8)] * 4  # softmax of equal scores: v's ones


# -- pure arithmetic: layout and schedule --------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("load_balance", [False, True])
def test_block_schedule_computes_each_needed_pair_exactly_once(n, causal, load_balance):
    seq = 4 * n
    want = torch.tril(torch.ones(seq, seq, dtype=torch.int64)) if causal else torch.ones(seq, seq, dtype=torch.int64)
    assert torch.equal(covered_pairs(n, seq, causal, load_balance), want)


def test_zigzag_layout_and_its_inverse():
    assert positions(0, 2, 4, True).tolist() == [0, 1, 6, 7]
    assert positions(1, 2, 4, True).tolist() == [2, 3, 4, 5]
    assert positions(1, 2, 4, False).tolist() == [4, 5, 6, 7]
    x = torch.arange(24.0).view(1, 1, 24, 1)
    for lb in (False, True):
        parts = [shard_sequence(x, r, 3, lb) for r in range(3)]
        assert torch.equal(unshard_sequence(parts, lb), x)
    assert shard_sequence(x, 2, 3, True).flatten().tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert block_plan(0, 1, 2, 4, True, False) is None                    # contiguous: rank 0 skips rank 1's keys
    assert block_plan(0, 1, 2, 4, True, True).q_rows == slice(2, 4)       # zigzag: only its late chunk attends


def test_sequences_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"sequence length \(10\) must be a positive multiple of N = 4"):
        shard_sequence(torch.zeros(1, 1, 10, 2), 0, 4)
    with pytest.raises(ValueError, match=r"sequence length \(12\) must be a positive multiple of 2N = 8"):
        shard_sequence(torch.zeros(1, 1, 12, 2), 0, 4, load_balance=True)
    with pytest.raises(ValueError, match="rank must be an int in 0..3"):
        positions(4, 4, 2, False)


# -- pure arithmetic: cost formulas against hand-computed values ---------------------------------------------

def test_cost_formulas_by_hand():
    from commlab.parallel.context.cost import (all_gather_attention_nbytes, all_gather_attention_seconds,
                                               ring_attention_nbytes, ring_attention_seconds, ulysses_nbytes,
                                               ulysses_seconds)
    # b=1, s=8, h=2, d=4, N=4, bf16 (e=2): K block = 1*2*2*4*2 = 32 bytes; dK travels in float32: 64.
    assert ring_attention_nbytes(1, 8, 2, 4, 4, 2) == {"forward": 3 * 64, "backward": 3 * 64 + 4 * 128}
    assert all_gather_attention_nbytes(1, 8, 2, 4, 4, 2) == {"forward": 192, "backward": 192}
    # Ulysses, h=4: Q = K = 64 bytes; 3/4 of (2Q + 2K) = 192 each way.
    assert ulysses_nbytes(1, 8, 4, 4, 4, 2) == {"forward": 192.0, "backward": 192.0}
    # Grouped-query attention, h=4, h_kv=2, N=2: Q = 1*4*4*4*2 = 128, K = 64; 1/2 of (256 + 128) = 192.
    assert ulysses_nbytes(1, 8, 4, 4, 2, 2, kv_heads=2)["forward"] == 192.0
    a, beta = 1e-5, 1e-9
    assert ring_attention_seconds(1, 8, 2, 4, 4, 2, a, beta) == pytest.approx(
        {"forward": 6 * a + 192 * beta, "backward": (6 + 8) * a + 704 * beta})
    assert all_gather_attention_seconds(1, 8, 2, 4, 4, 2, a, beta) == pytest.approx(
        {"forward": 3 * a + 192 * beta, "backward": 3 * a + 192 * beta})
    # Two AllToAlls of 3 blocks and 1 block (64 bytes each): 2*3 α + 3/4 * 256 β.
    assert ulysses_seconds(1, 8, 4, 4, 4, 2, a, beta)["forward"] == pytest.approx(6 * a + 192 * beta)
    assert ring_attention_nbytes(1, 8, 2, 4, 1, 4) == {"forward": 0, "backward": 0}
    with pytest.raises(ValueError, match=r"query heads \(6 per GPU\) to be a multiple of N = 4"):
        ulysses_nbytes(1, 8, 6, 4, 4, 2)
    with pytest.raises(ValueError, match=r"seq \(10\) must be a multiple of n \(4\)"):
        ring_attention_nbytes(1, 10, 2, 4, 4, 2)


def test_which_method_wins_where():
    from commlab.parallel.context.cost import fastest_context_parallel, sequence_parallel_vs_tp
    link = (5e-6, 1 / 25e9)   # 5 µs, 25 GB/s per direction
    # MHA, 32 heads, N = 8, nothing to hide behind: Ulysses sends 2(N-1)/N of a block per tensor, the ring N-1.
    best, rows = fastest_context_parallel(1, 32768, 32, 128, 8, 2, *link)
    assert best == "ulysses"
    ring, ag, uly = rows
    assert ring.nbytes > ag.nbytes > uly.nbytes
    assert ring.exposed_s == pytest.approx(ring.seconds)   # with no arithmetic to hide behind, all of it shows
    assert ring.kv_nbytes_held == 4 * 32768 // 8 * 32 * 128 * 2 and uly.kv_nbytes_held == ring.kv_nbytes_held / 2
    # Heads not divisible by N: Ulysses is out, and the all-gather's single collective beats N-1 ring steps...
    best, rows = fastest_context_parallel(1, 32768, 12, 128, 8, 2, *link)
    assert best == "all-gather" and not rows[2].feasible and "a multiple of N = 8" in rows[2].why
    # ... unless the ring's steps hide behind the arithmetic (1 s of attention: every transfer hidden).
    best, rows = fastest_context_parallel(1, 32768, 12, 128, 8, 2, *link, attention_seconds=1.0)
    assert best == "ring" and rows[0].exposed_s == 0.0 and rows[0].kv_nbytes_held < rows[1].kv_nbytes_held
    # Sequence parallelism: the same bytes and time as TP's all-reduce (Korthikanti et al. 2022, §4.2.2).
    sp = sequence_parallel_vs_tp(2, 8, 4, 2, 4, 1e-6, 1e-9)
    x = 2 * 8 * 4 * 2
    assert sp["tp"]["nbytes"] == sp["sp"]["nbytes"] == 2 * 3 / 4 * x
    assert sp["tp"]["seconds"] == pytest.approx(sp["sp"]["seconds"]) == pytest.approx(6e-6 + 1.5 * x * 1e-9)


def test_ulysses_replicates_grouped_kv_heads_in_its_bytes():
    from commlab.parallel.context.cost import compare_context_parallel, ulysses_nbytes
    from commlab.parallel.context.ulysses import kv_heads_per_rank
    # verl's cases: N divides a_kv (a_kv / N a rank) or a_kv divides N (one a rank, r = N / a_kv).
    assert [kv_heads_per_rank(32, kv, 16) for kv in (1, 2, 8, 16, 32)] == [1, 1, 1, 1, 2]
    # Neither divides the other: only the heads a rank's queries use. 12 heads, 4 K/V heads, N = 3: 4 queries a
    # rank span 2 K/V heads (N / gcd(N, a_kv) copies would send 4); 24 heads, 12 K/V, N = 8: 3 queries span 2.
    assert kv_heads_per_rank(12, 4, 3) == 2 and kv_heads_per_rank(24, 12, 8) == 2
    # 12 heads, 4 K/V heads, N = 6: 2 queries a rank span 1 or 2 K/V heads; the AllToAll's blocks take the most.
    assert kv_heads_per_rank(12, 4, 6) == 2
    # h=12, h_kv=4, N=3 (b=1, s=6, d=4, bf16): Q = 12*2*4*2 = 192 bytes, one head 16; r K = 3*2 heads = 96.
    assert ulysses_nbytes(1, 6, 12, 4, 3, 2, kv_heads=4)["forward"] == 2 / 3 * (2 * 192 + 2 * 96)
    with pytest.raises(ValueError, match=r"heads \(12\) must be a multiple of n \(5\)"):
        kv_heads_per_rank(12, 4, 5)
    # h=4, h_kv=1, N=4 (b=1, s=8, d=4, bf16): Q = 1*4*2*4*2 = 64, K = 16, r = 4: 3/4 (2*64 + 2*4*16) = 192.
    assert ulysses_nbytes(1, 8, 4, 4, 4, 2, kv_heads=1)["forward"] == 3 / 4 * (2 * 64 + 2 * 4 * 16)
    # Llama 3 405B's attention at CP 16: a = 128, a_kv = 8; feasible, K/V inflated by N / a_kv = 2.
    q, k = 128 * 8192 * 128 * 2, 8 * 8192 * 128 * 2
    assert ulysses_nbytes(1, 131072, 128, 128, 16, 2, kv_heads=8)["forward"] == 15 / 16 * (2 * q + 2 * 2 * k)
    rows = compare_context_parallel(1, 131072, 128, 128, 16, 2, 1e-5, 1e-10, kv_heads=8)
    assert rows[2].feasible and rows[2].kv_nbytes_held == 2 * 2 * k   # r * h_kv / N = 1 head, whole sequence
    with pytest.raises(ValueError, match=r"query heads \(12 per GPU\) to be a multiple of N = 8"):
        ulysses_nbytes(1, 64, 12, 4, 8, 2, kv_heads=4)


def test_context_parallel_bytes_are_per_tp_shard():
    from commlab.parallel.context.cost import (all_gather_attention_nbytes, compare_context_parallel,
                                               ring_attention_nbytes, ulysses_nbytes)
    # Llama 3 405B's long-context run: TP = 8 beside CP = 16, so a GPU holds 16 query heads and 1 K/V head.
    shape = (1, 131072, 128, 128, 16, 2)
    for fn in (ring_attention_nbytes, all_gather_attention_nbytes):
        full, shard = fn(*shape, kv_heads=8), fn(*shape, kv_heads=8, tp=8)
        assert {key: 8 * val for key, val in shard.items()} == full
    k_gpu = 1 * 8192 * 128 * 2                           # one K/V head, s/N tokens, bf16
    assert ring_attention_nbytes(*shape, kv_heads=8, tp=8)["forward"] == 15 * 2 * k_gpu
    # Ulysses: 16 query heads and 1 K/V head per GPU, replicated N = 16 times.
    q_gpu = 16 * 8192 * 128 * 2
    assert ulysses_nbytes(*shape, kv_heads=8, tp=8)["forward"] == 15 / 16 * (2 * q_gpu + 2 * 16 * k_gpu)
    full = compare_context_parallel(*shape, 1e-5, 1e-10, kv_heads=8)
    shard = compare_context_parallel(*shape, 1e-5, 1e-10, kv_heads=8, tp=8)
    for f, p in zip(full[:2], shard[:2]):
        assert f.nbytes == 8 * p.nbytes and f.kv_nbytes_held == 8 * p.kv_nbytes_held
    # TP beyond the K/V heads replicates them (1 a GPU); a TP that splits a head is refused.
    assert ring_attention_nbytes(1, 64, 32, 4, 4, 2, kv_heads=2, tp=8) == ring_attention_nbytes(1, 64, 4, 4, 4, 2,
                                                                                               kv_heads=1)
    with pytest.raises(ValueError, match=r"tp \(3\) must divide heads \(32\)"):
        ring_attention_nbytes(1, 64, 32, 4, 4, 2, kv_heads=8, tp=3)


def test_ring_hiding_splits_attention_time_by_the_backward_ratio():
    from commlab.parallel.context.cost import (ATTENTION_BACKWARD_OVER_FORWARD, compare_context_parallel,
                                               ring_attention_nbytes)
    assert ATTENTION_BACKWARD_OVER_FORWARD == 2.5       # FlashAttention-2's accounting, as the planner's
    alpha, beta, n = 0.0, 1e-9, 4
    fwd_step = ring_attention_nbytes(1, 8, 2, 4, n, 2)["forward"] / (n - 1) * beta   # one step's K/V: 64 B
    # Enough arithmetic for the forward's steps to hide exactly (forward share 1/3.5 of it, over N steps).
    attention = fwd_step * n * 3.5
    ring = compare_context_parallel(1, 8, 2, 4, n, 2, alpha, beta, attention_seconds=attention)[0]
    bwd_compute = attention * 2.5 / 3.5 / n
    k, k_grad = 32, 64
    want = (n - 1) * max(0.0, (2 * k + 2 * k_grad) * beta - bwd_compute) + max(0.0, 2 * k_grad * beta - bwd_compute)
    assert ring.exposed_s == pytest.approx(want)
    assert compare_context_parallel(1, 8, 2, 4, n, 2, alpha, beta, attention_seconds=attention * 0.99)[0].exposed_s \
        > want


def test_two_level_all_to_all_prices_intra_node_peers_on_the_intra_link():
    from commlab.collectives import all_to_all_seconds
    from commlab.parallel.context.cost import ulysses_seconds
    from commlab.collectives import two_level_all_to_all_seconds
    nv, ib = (2e-6, 1 / 400e9), (5e-6, 1 / 50e9)
    nbytes = 16 * 2**20
    # 16 ranks on 2 nodes of 8: 7 peers over NVLink, 8 over the NIC, at the same time.
    got = two_level_all_to_all_seconds(nbytes, 16, 8, *nv, *ib)
    intra, inter = 7 * nv[0] + 7 / 16 * nbytes * nv[1], 8 * ib[0] + 8 / 16 * nbytes * ib[1]
    assert got == pytest.approx(max(intra, inter)) and got == pytest.approx(inter)
    assert got < all_to_all_seconds(nbytes, 16, *ib)      # every byte over the NIC: 15/16 of it
    assert two_level_all_to_all_seconds(nbytes, 8, 8, *nv, *ib) == pytest.approx(all_to_all_seconds(nbytes, 8, *nv))
    # Ulysses across 2 nodes: each of its AllToAlls priced two-level.
    q, k = 16 * 2 * 4 * 2, 4 * 2 * 4 * 2
    r = 4
    want = (two_level_all_to_all_seconds(q + 2 * r * k, 16, 8, *nv, *ib)
            + two_level_all_to_all_seconds(q, 16, 8, *nv, *ib))
    assert ulysses_seconds(1, 32, 16, 4, 16, 2, *ib, kv_heads=4, intra=(8, *nv))["forward"] == pytest.approx(want)
    with pytest.raises(ValueError, match=r"n \(12\) must be a multiple of ranks_per_node \(8\)"):
        two_level_all_to_all_seconds(1.0, 12, 8, *nv, *ib)
