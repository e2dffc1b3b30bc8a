"""commlab's one data-parallel path, BucketedDataParallel: hostile comm hooks, set_buffer, ranks outside their
group, PowerSGD on gradients that require grad, the explicit sync after a pipeline flush, DP inside strided DP
groups, and a synchronous all_reduce_fn as a hook; each against torch's own (DDP, its comm hooks, dist.all_reduce)
on real gloo ranks.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab import RankError, launch
from commlab.collectives import ring_all_reduce
from commlab.compress import (CastCompressor, CompressionHookState, PowerSGDState, TopK, compression_hook,
                              powersgd_all_reduce)
from commlab.overlap import (AllReduceFnState, Bucket, BucketedDataParallel, UnusedParametersError,
                             all_reduce_fn_hook, completed_future)
from commlab.overlap.profile import make_mlp
from commlab.parallel.pipeline import pipeline_step, split_sequential
from commlab.train.data import load_digits_split

WIDTHS = (12, 24, 24, 16, 4)  # 1,412 parameters in 8 tensors
CAP = 400                     # several buckets


def _batches(steps, rank, n=8):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(n, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (n,), generator=g))
            for _ in range(steps)]


def _train(wrapped, model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# ------------------------------------------------------------------------------ comm hook results

def bf16_result_hook(state, bucket):
    """Sends bfloat16 and forgets to decompress: its future yields bfloat16 for a float32 bucket."""
    buf = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def meta_result_hook(state, bucket):
    """Yields a tensor of the right size on another device (the meta device stands in for a GPU/CPU mix-up)."""
    return completed_future(torch.empty(bucket.buffer().numel(), device="meta"))


def _hostile_hook(hook):
    model = make_mlp(WIDTHS)
    wrapped = BucketedDataParallel(model, bucket_cap_bytes=CAP)
    wrapped.register_comm_hook(None, hook)
    x, y = _batches(1, dist.get_rank())[0]
    nn.functional.cross_entropy(wrapped(x), y).backward()


def test_a_hook_result_of_another_dtype_is_refused_naming_the_hook():
    with pytest.raises(RankError) as info:
        launch(_hostile_hook, 2, bf16_result_hook, timeout=60)
    msg = str(info.value)
    assert info.value.exc_type == "ValueError"
    assert "bf16_result_hook" in msg and "torch.bfloat16" in msg and "torch.float32" in msg and "set_buffer" in msg


def test_a_hook_result_on_another_device_is_refused_naming_the_hook():
    with pytest.raises(RankError) as info:
        launch(_hostile_hook, 2, meta_result_hook, timeout=60)
    msg = str(info.value)
    assert info.value.exc_type == "ValueError"
    assert "meta_result_hook" in msg and "on meta" in msg and "lives on cpu" in msg


def _hook_raising_on_first_call():
    """A comm hook that raises on its first call only: the step it raised in ends, and the next step (with and
    without an explicit finish() in between) averages correctly, against the whole batch in one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = {"n": 0}

    def flaky(state, bucket):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("flaky hook: first call fails")
        buf = bucket.buffer() / world
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

    out = {}
    for explicit_finish in (True, False):
        calls["n"] = 0
        model = make_mlp(WIDTHS)
        wrapped = BucketedDataParallel(model, bucket_cap_bytes=CAP)
        wrapped.register_comm_hook(None, flaky)
        x, y = _batches(1, rank)[0]
        with pytest.raises(RuntimeError, match="first call fails"):
            nn.functional.cross_entropy(wrapped(x), y).backward()
        if explicit_finish:
            with pytest.raises(RuntimeError, match="first call fails"):
                wrapped.finish()             # raises the hook's error once more, and ends the step
            wrapped.finish()                 # idempotent
        assert wrapped.pending() == 0
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(wrapped(x), y).backward()
        out[explicit_finish] = [p.grad.clone() for p in model.parameters()]
    return out


def test_a_hook_that_raises_ends_its_step_and_the_next_step_is_right():
    results = launch(_hook_raising_on_first_call, 2, timeout=60)
    reference = make_mlp(WIDTHS)
    loss = sum(nn.functional.cross_entropy(reference(x), y) for x, y in (_batches(1, r)[0] for r in range(2)))
    (loss / 2).backward()
    want = [p.grad for p in reference.parameters()]
    for per_rank in results:
        for grads in per_rank.values():
            assert _max_diff(grads, want) < 1e-6


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(3, 3)        # registered first: in the last bucket, which finish() launches
        self.mlp = make_mlp(WIDTHS)

    def forward(self, x):
        return self.mlp(x)


def _hook_raising_inside_finish():
    model = _WithUnused()
    wrapped = BucketedDataParallel(model, bucket_cap_bytes=CAP, find_unused_parameters=True,
                                   finish_in_backward=False)

    def last_bucket_fails(state, bucket):
        if bucket.is_last():
            raise RuntimeError("hook fails on the last bucket")
        return completed_future(bucket.buffer() / dist.get_world_size())

    wrapped.register_comm_hook(None, last_bucket_fails)
    x, y = _batches(1, dist.get_rank())[0]
    nn.functional.cross_entropy(wrapped(x), y).backward()   # the last bucket waits for `unused`
    with pytest.raises(RuntimeError, match="fails on the last bucket"):
        wrapped.finish()
    assert wrapped.pending() == 0 and not wrapped.gradients_averaged
    wrapped(x)                               # the step ended: a new forward is allowed
    return True


def test_a_hook_that_raises_inside_finish_still_ends_the_step():
    assert launch(_hook_raising_inside_finish, 2, timeout=60) == [True, True]


def test_set_buffer_replaces_the_buffer_as_grad_bucket_does():
    param = nn.Parameter(torch.zeros(2, 3))
    original = torch.arange(6, dtype=torch.float32)
    bucket = Bucket(original, 0, True, [param])
    half = original.to(torch.float16)
    bucket.set_buffer(half)
    assert bucket.buffer() is half                                     # replaced, not copied into
    assert bucket.gradients()[0].dtype == torch.float16 and bucket.gradients()[0].shape == (2, 3)
    assert bucket.gradients()[0].data_ptr() == half.data_ptr()         # views of the new buffer
    assert original.dtype == torch.float32 and torch.equal(original, torch.arange(6, dtype=torch.float32))
    with pytest.raises(ValueError, match="1-D tensor of 6 elements, got \\[5\\]"):
        bucket.set_buffer(torch.zeros(5))
    with pytest.raises(ValueError, match="on meta"):
        bucket.set_buffer(torch.zeros(6, device="meta"))


def _torch_wrappers_on_the_wire(kind):
    """torch's fp16/bf16_compress_wrapper around a hook that records what it hands to dist.all_reduce, on our
    wrapper and on the reference: DDP with the same wrapped hook for fp16; for bf16, which DDP refuses without
    NCCL, our wrapper with commlab's bfloat16 cast hook (the same arithmetic: cast, divide by N, sum in 16 bits)."""
    wrap = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}[kind]
    batches = _batches(3, dist.get_rank())
    out = {}
    for name in ("ours", "reference"):
        seen = []

        def recording_allreduce(state, bucket, seen=seen):
            seen.append((bucket.buffer().dtype, bucket.buffer().element_size()))
            return default_hooks.allreduce_hook(state, bucket)

        model = make_mlp(WIDTHS)
        if name == "ours":
            wrapped = BucketedDataParallel(model, bucket_cap_bytes=CAP)
            wrapped.register_comm_hook(None, wrap(recording_allreduce))
        elif kind == "fp16":
            wrapped = DDP(model, bucket_cap_mb=CAP / 2 ** 20)
            wrapped.register_comm_hook(None, wrap(recording_allreduce))
        else:
            wrapped = BucketedDataParallel(model, bucket_cap_bytes=CAP)
            wrapped.register_comm_hook(CompressionHookState(CastCompressor(torch.bfloat16)), compression_hook)
        grads = _train(wrapped, model, batches)
        out[name] = (sorted(set(seen), key=str), grads)
    diff = max(_max_diff(a, b) for a, b in zip(out["ours"][1], out["reference"][1]))
    return out["ours"][0], out["reference"][0], diff


@pytest.mark.parametrize("kind, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_torch_compress_wrappers_send_16_bits(kind, dtype):
    """With set_buffer replacing the buffer, the wrapped hook all-reduces 16-bit values, as under DDP; on 2 ranks
    a 16-bit sum of two values is one rounding, so the gradients equal the reference's bitwise."""
    for ours_wire, ref_wire, diff in launch(_torch_wrappers_on_the_wire, 2, kind, timeout=90):
        assert ours_wire == [(dtype, 2)]
        if kind == "fp16":
            assert ref_wire == [(dtype, 2)]  # what DDP itself sends with the same wrapper
        assert diff == 0.0


# ------------------------------------------------------------------------------ ranks outside their group

def _outside_the_group():
    group = dist.new_group([0])  # rank 1 gets GroupMember.NON_GROUP_MEMBER back
    if dist.get_rank() == 0:
        return {}
    from commlab.parallel import ZeroOneOptimizer

    attempts = {
        "PowerSGDState": lambda: PowerSGDState(group, rank=1, start_iter=2),
        "CompressionHookState": lambda: CompressionHookState(CastCompressor(torch.float16), group),
        "BucketedDataParallel": lambda: BucketedDataParallel(nn.Linear(3, 2), process_group=group),
        "PowerSGD": lambda: powersgd_all_reduce([torch.randn(8, 8)], PowerSGDState(rank=1, start_iter=2), group),
        "ZeroOneOptimizer": lambda: ZeroOneOptimizer(nn.Linear(3, 2).parameters(), group),
        "AllReduceFnState": lambda: AllReduceFnState(ring_all_reduce, group),
    }
    got = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            got[name] = None
        except Exception as exc:  # noqa: BLE001 -- the test compares the type and message
            got[name] = (type(exc).__name__, str(exc))
    return got


def test_a_rank_outside_its_group_gets_the_same_clear_error_everywhere():
    _, got = launch(_outside_the_group, 2, timeout=60)
    assert set(got) == {"PowerSGDState", "CompressionHookState", "BucketedDataParallel", "PowerSGD",
                        "ZeroOneOptimizer", "AllReduceFnState"}
    for name, result in got.items():
        assert result is not None, name
        kind, msg = result
        assert kind == "RuntimeError", (name, kind, msg)
        assert msg.startswith(f"rank 1 is not a member of the process group passed to {name} "), msg
        assert "NON_GROUP_MEMBER" in msg


# ------------------------------------------------------------------------------ PowerSGD detaches

def _powersgd_on_tensors_that_require_grad():
    g = torch.Generator().manual_seed(dist.get_rank())
    leaves = [torch.randn(16, 8, generator=g).requires_grad_(), torch.randn(8, generator=g).requires_grad_()]
    plain = [t.detach().clone() for t in leaves]
    a = powersgd_all_reduce(leaves, PowerSGDState(rank=2, start_iter=2), None)
    b = powersgd_all_reduce(plain, PowerSGDState(rank=2, start_iter=2), None)
    # out= the leaves themselves: written through detached views, as the bucket hook writes into its buffer.
    c = powersgd_all_reduce(leaves, PowerSGDState(rank=2, start_iter=2), None, out=leaves)
    return ([torch.equal(x, y) for x, y in zip(a, b)], [torch.equal(x, y) for x, y in zip(leaves, b)],
            [t.requires_grad for t in a], [t.requires_grad for t in leaves], len(c))


def test_powersgd_accepts_gradients_that_require_grad():
    for same, written, results_require_grad, leaves_require_grad, n_out in launch(
            _powersgd_on_tensors_that_require_grad, 2, timeout=60):
        assert same == [True, True] and written == [True, True]
        assert results_require_grad == [False, False] and leaves_require_grad == [True, True] and n_out == 2


# ------------------------------------------------------------------------------ explicit sync, vs DDP

def _sync_gradients_vs_ddp(micro):
    """Every micro-batch's backward inside no_sync, then sync_gradients(), against DDP's no_sync accumulation
    (its last micro-batch synced); with and without torch's allreduce_hook."""
    rank = dist.get_rank()
    batches = _batches(2 * micro, rank)
    out = {}
    for hook in (None, default_hooks.allreduce_hook):
        m1, m2 = make_mlp(WIDTHS), make_mlp(WIDTHS)
        ours = BucketedDataParallel(m1, bucket_cap_bytes=CAP)
        ddp = DDP(m2, bucket_cap_mb=CAP / 2 ** 20)
        if hook is not None:
            ours.register_comm_hook(None, hook)
            ddp.register_comm_hook(None, hook)
        o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
        diffs, flags = [], []
        for s in range(0, len(batches), micro):
            o1.zero_grad()
            o2.zero_grad()
            for i, (x, y) in enumerate(batches[s:s + micro]):
                with ours.no_sync():
                    nn.functional.cross_entropy(ours(x), y).backward()
                if i < micro - 1:
                    with ddp.no_sync():
                        nn.functional.cross_entropy(ddp(x), y).backward()
                else:
                    nn.functional.cross_entropy(ddp(x), y).backward()
            flags.append(ours.gradients_averaged)        # False: local sums so far
            ours.sync_gradients()
            flags.append(ours.gradients_averaged)        # True
            diffs.append(_max_diff([p.grad for p in m1.parameters()], [p.grad for p in m2.parameters()]))
            o1.step()
            o2.step()
        out["hook" if hook else "plain"] = (max(diffs), flags, ours.last_step.wait_end_s >= ours.last_step.first_grad_s)
    # A synced backward whose buckets are still in flight cannot be overtaken by an explicit sync.
    m3 = make_mlp(WIDTHS)
    lazy = BucketedDataParallel(m3, bucket_cap_bytes=CAP, finish_in_backward=False)
    x, y = batches[0]
    nn.functional.cross_entropy(lazy(x), y).backward()
    try:
        lazy.sync_gradients()
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    lazy.finish()
    return out, refused


def test_sync_gradients_after_no_sync_equals_ddp_accumulation():
    for out, refused in launch(_sync_gradients_vs_ddp, 2, 3, timeout=90):
        for name, (diff, flags, ordered) in out.items():
            assert diff <= 1e-6, (name, diff)
            assert flags == [False, True, False, True] and ordered
        assert refused is not None and "still in flight" in refused


def _sync_gradients_with_a_missing_grad():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    dp = BucketedDataParallel(model, bucket_cap_bytes=16)
    for p in model[1].parameters():
        p.grad = torch.ones_like(p)
    try:
        dp.sync_gradients()
    except UnusedParametersError as exc:
        return exc.names, model[0].weight.grad is None, float(model[1].weight.grad[0, 0])
    return None


def test_sync_gradients_names_parameters_without_grad_after_averaging_the_rest():
    for names, still_none, averaged in launch(_sync_gradients_with_a_missing_grad, 2, timeout=60):
        assert names == ["0.weight", "0.bias"] and still_none and averaged == 1.0


def _all_reduce_fn_hook_vs_ddp():
    batches = _batches(3, dist.get_rank())
    m1, m2 = make_mlp(WIDTHS), make_mlp(WIDTHS)
    ours = BucketedDataParallel(m1, bucket_cap_bytes=CAP)
    ours.register_comm_hook(AllReduceFnState(ring_all_reduce), all_reduce_fn_hook)
    g1, g2 = _train(ours, m1, batches), _train(DDP(m2, bucket_cap_mb=CAP / 2 ** 20), m2, batches)
    return len(ours.buckets), max(_max_diff(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("world_size", [2, 3])
def test_commlab_ring_as_a_hook_equals_ddp(world_size):
    """Our ring sums (a+b)/N where DDP sums a/N + b/N: equal up to float32 rounding of the gradients' size."""
    for buckets, diff in launch(_all_reduce_fn_hook_vs_ddp, world_size, timeout=90):
        assert buckets > 1 and diff <= 1e-6


# ------------------------------------------------------------------------------ DP inside DP groups

def _grad_of(rank):
    # Integer-valued gradients: halves and sums are exact, so the averages can be compared exactly.
    return (torch.arange(37, dtype=torch.float32) % 7 - 3) * (rank + 1)


def _set_grads(params, flat):
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p).clone()
        off += p.numel()


def _dp_in_groups():
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # strided DP groups, as on a mesh with pp=2
    dp_group = groups[rank % 2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(1, 2, bias=False))  # 30 + 5 + 2 = 37 parameters
    params = list(model.parameters())
    out = {}

    dense = BucketedDataParallel(model, bucket_cap_bytes=1, process_group=dp_group)
    _set_grads(params, _grad_of(rank))
    dense.sync_gradients()
    out["dense"] = (torch.cat([p.grad.reshape(-1) for p in params]), len(dense.buckets))
    torch_mean = _grad_of(rank)
    dist.all_reduce(torch_mean, group=dp_group)
    out["torch"] = torch_mean / 2

    topk = BucketedDataParallel(model, bucket_cap_bytes=2 ** 40, process_group=dp_group)
    topk_state = CompressionHookState(TopK(k=5), dp_group)
    topk.register_comm_hook(topk_state, compression_hook)
    _set_grads(params, _grad_of(rank))
    topk.sync_gradients()
    out["topk"] = (torch.cat([p.grad.reshape(-1) for p in params]), topk_state.last_payload_nbytes)

    bf16 = BucketedDataParallel(model, bucket_cap_bytes=2 ** 40, process_group=dp_group)
    bf16_state = CompressionHookState(CastCompressor(torch.bfloat16), dp_group, error_feedback=True)
    bf16.register_comm_hook(bf16_state, compression_hook)
    g = torch.randn(37, generator=torch.Generator().manual_seed(rank))
    _set_grads(params, g)
    bf16.sync_gradients()
    out["bf16"] = (torch.cat([p.grad.reshape(-1) for p in params]), g, bf16_state.residuals[0],
                   bf16_state.last_payload_nbytes)
    return out


def _in_bucket_order(flat, shapes=((5, 6), (5,), (2, 1))):
    """A flat gradient in parameter order, rearranged as the single bucket holds it (reverse order)."""
    parts, off = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        parts.append(flat[off:off + n])
        off += n
    return torch.cat(parts[::-1])


def test_dp_averages_within_each_dp_group_only():
    results = launch(_dp_in_groups, 4, timeout=90)
    members = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    topk = TopK(k=5)
    for rank, out in enumerate(results):
        grp = members[rank]
        expected = sum(_grad_of(r) for r in grp) / 2
        dense, buckets = out["dense"]
        assert torch.equal(dense, expected) and torch.equal(out["torch"], expected) and buckets == 3
        # With Top-K, the average of what each member *sent* (not of the raw gradients), in the bucket's order.
        sparse, payload = out["topk"]
        sent = [topk.decompress(topk.compress(_in_bucket_order(_grad_of(r)))) for r in grp]
        assert torch.equal(_in_bucket_order(sparse), (sent[0] + sent[1]) / 2)
        assert not torch.equal(sparse, expected) and payload == 5 * (4 + 4)
        # bfloat16 with error feedback: close to the mean, half the bytes, residual = what was not sent.
        linear, g, residual, payload = out["bf16"]
        mean_g = sum(results[r]["bf16"][1] for r in grp) / 2
        torch.testing.assert_close(linear, mean_g, rtol=2e-2, atol=2e-2)
        assert payload == 37 * 2
        mine = _in_bucket_order(g)
        torch.testing.assert_close(residual, mine - mine.to(torch.bfloat16).float(), rtol=0, atol=0)


# ------------------------------------------------------------------------------ PP x DP with a pipeline flush

RTOL, ATOL = 1e-5, 1e-6


def deep_mlp(depth=4, hidden=32, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers, width = [], 64
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)


def _batch(n):
    d = load_digits_split(seed=0)
    return d.x_train[:n], d.y_train[:n]


def _pp_dp(compress):
    rank = dist.get_rank()
    # Mesh dp=2 x pp=2: pipelines {0,1} and {2,3}; DP groups join the same stage of both: {0,2}, {1,3}.
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp_group = pp_groups[rank // 2], dp_groups[rank % 2]
    replica = rank // 2
    x, y = _batch(64)
    x, y = x[replica * 32:(replica + 1) * 32], y[replica * 32:(replica + 1) * 32]
    stage = split_sequential(deep_mlp(), 2)[dist.get_rank(pp)]
    dp = BucketedDataParallel(stage, bucket_cap_bytes=1024, process_group=dp_group)
    state = None
    if compress:
        state = CompressionHookState(CastCompressor(torch.bfloat16), dp_group)
        dp.register_comm_hook(state, compression_hook)
    with dp.no_sync():  # the schedule runs every micro-batch's backward itself
        res = pipeline_step(dp, x, y, nn.functional.cross_entropy, 4, pp, schedule="1f1b")
    dp.sync_gradients()  # after the flush: the accumulated sum, averaged over the DP group
    return (res.loss, [q.grad.clone() for q in stage.parameters()], len(dp.buckets), dp.buckets[-1].nbytes,
            None if state is None else state.last_payload_nbytes, dp.gradients_averaged)


@pytest.mark.slow
@pytest.mark.parametrize("compress", [False, True], ids=["dense", "bf16 hook"])
def test_pipelines_side_by_side_with_dp_sync_equal_the_whole_batch(compress):
    x, y = _batch(64)
    ref = deep_mlp()
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_grads = [[q.grad for q in st.parameters()] for st in split_sequential(ref, 2)]
    results = launch(_pp_dp, 4, compress, timeout=90)
    rtol, atol = (2e-2, 2e-3) if compress else (RTOL, ATOL)
    for rank, (loss, grads, buckets, last_nbytes, payload, averaged) in enumerate(results):
        assert buckets > 1 and averaged
        for g, r in zip(grads, ref_grads[rank % 2]):
            torch.testing.assert_close(g, r, rtol=rtol, atol=atol)
        if compress:  # the payload of the last bucket: bfloat16, half its float32 bytes
            assert payload * 2 == last_nbytes
    full = nn.functional.cross_entropy(deep_mlp()(x), y).item()
    assert (results[0][0] + results[2][0]) / 2 == pytest.approx(full, rel=RTOL)


# ------------------------------------------------------------------------------ wrapping a model again

def _wrap_twice():
    import gc

    model = make_mlp(WIDTHS)
    first = BucketedDataParallel(model, bucket_cap_bytes=CAP)
    x, y = _batches(1, dist.get_rank())[0]
    nn.functional.cross_entropy(first(x), y).backward()
    del first
    gc.collect()
    second = BucketedDataParallel(model, bucket_cap_bytes=CAP)  # a notebook cell run again
    model.zero_grad()
    nn.functional.cross_entropy(second(x), y).backward()
    local = make_mlp(WIDTHS)
    nn.functional.cross_entropy(local(x), y).backward()
    mean = [p.grad.clone() for p in local.parameters()]
    for g in mean:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return _max_diff([p.grad for p in model.parameters()], mean)


def test_a_dropped_wrapper_no_longer_hooks_its_model():
    """The ready hooks hold the wrapper weakly and go with it; otherwise the dropped wrapper's hooks would still
    fire on the next backward and refuse it ("backward ... without a forward through it")."""
    assert max(launch(_wrap_twice, 2, timeout=60)) <= 1e-6


# ------------------------------------------------------------------------------ an experiment method as a hook

def _method_hook_over_buckets(spec, ef):
    from commlab.experiments.methods import make_method, method_hook

    batches = _batches(3, dist.get_rank())
    m1, m2 = make_mlp(WIDTHS), make_mlp(WIDTHS)
    ours = BucketedDataParallel(m1, bucket_cap_bytes=CAP)
    method = make_method(spec, ef, clock=ours.clock)
    ours.register_comm_hook(method, method_hook)
    g1, g2 = _train(ours, m1, batches), _train(DDP(m2, bucket_cap_mb=CAP / 2 ** 20), m2, batches)
    costs = method.take_costs()
    return (len(ours.buckets), method.step, len(costs), max(_max_diff(a, b) for a, b in zip(g1, g2)),
            sorted(method.ef.keys()) if method.ef is not None else None)


@pytest.mark.parametrize("spec, ef", [("dense", False), ("sign", True)])
def test_an_experiment_method_as_comm_hook_over_several_buckets(spec, ef):
    """Steps are counted once per step (at the last bucket), costs are kept per bucket, and error feedback keeps
    one residual per bucket; dense through commlab's ring equals DDP."""
    for buckets, steps, costs, diff, residuals in launch(_method_hook_over_buckets, 2, spec, ef, timeout=90):
        assert buckets > 1 and steps == 3 and costs == 3 * buckets
        if spec == "dense":
            assert diff <= 1e-6
        else:
            assert residuals == sorted(["flat"] + [f"flat/{b}" for b in range(1, buckets)])
