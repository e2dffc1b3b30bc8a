"""PowerSGD, the cast compressor and the DDP hooks, against PyTorch's own hooks on real gloo ranks.

Tolerances, measured before they were set (torch 2.13, CPU):

* ``powersgd_hook`` vs PyTorch's ``powerSGD_hook`` (rank 1 and 2, start_iter 2, warm start, error feedback,
  same seed, hence the same initial Q): after 10 SGD steps (lr 0.1, momentum 0.9) on 2 and 4 ranks the
  parameters differ by at most 3.5e-8 absolute, 5e-7 relative to the distance the parameters travelled.
  The algorithms are the same in exact arithmetic (the residuals differ rank by rank, see
  :mod:`commlab.compress.powersgd`, but have the same sum); what differs is float32 rounding (we divide the
  uncompressed part before the sum, keep the residual as M - P Q_local^T, and add P and the uncompressed
  tensors in one buffer). The test allows 1e-5 relative (20x the measurement) and 1e-6 absolute.
* ``compression_hook`` with ``CastCompressor(float16)`` vs ``fp16_compress_hook``: bitwise equal (the same
  operations in the same order).
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab import launch
from commlab.compress import (CastCompressor, CompressionHookState, Payload, PowerSGDState, compression_hook,
                              powersgd_all_reduce, powersgd_hook, powersgd_nbytes)
from commlab.compress.powersgd import compressed_shape, orthogonalize_
from commlab.train import load_digits_split, shard

try:
    from commlab.compress.sparse import TopK as _TopK
except ImportError:  # the sparse compressors are written separately
    _TopK = None


class ConvNet(nn.Module):
    """Conv (8, 1, 3, 3) + Linear (32, 288) + Linear (10, 32), all with biases; 9,594 parameters."""

    def __init__(self, seed=0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.conv = nn.Conv2d(1, 8, 3)
            self.fc1 = nn.Linear(8 * 6 * 6, 32)
            self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x.view(-1, 1, 8, 8))).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


class TopKDouble:
    """A tiny Top-K (by magnitude) following the protocol: payload = values + int64 indices; not linear."""

    name = "topk-double"
    linear = False

    def __init__(self, fraction=0.1):
        self.fraction = fraction

    def compress(self, tensor):
        flat = tensor.reshape(-1)
        k = max(1, int(flat.numel() * self.fraction))
        idx = flat.abs().topk(k).indices
        return Payload({"values": flat[idx], "indices": idx}, tensor.shape, tensor.dtype, {"k": k})

    def decompress(self, payload):
        out = torch.zeros(math.prod(payload.shape), dtype=payload.dtype)
        out[payload.tensors["indices"]] = payload.tensors["values"]
        return out.view(payload.shape)


class ThresholdDouble(TopKDouble):
    """Keeps |x| above a threshold: payload sizes differ by rank (exercises the shape exchange)."""

    name = "threshold-double"

    def compress(self, tensor):
        flat = tensor.reshape(-1)
        idx = torch.nonzero(flat.abs() > 0.5).reshape(-1)
        return Payload({"values": flat[idx], "indices": idx}, tensor.shape, tensor.dtype, {})


class FakeBucket:
    """What a DDP hook sees, built from a list of gradients (for unit tests without DDP)."""

    def __init__(self, grads, index=0, last=True):
        self._params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        self._buf = torch.cat([g.reshape(-1) for g in grads]).clone()
        self._index, self._last = index, last
        self._shapes = [g.shape for g in grads]

    def buffer(self):
        return self._buf

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params

    def gradients(self):
        out, off = [], 0
        for s in self._shapes:
            k = math.prod(s)
            out.append(self._buf[off:off + k].view(s))
            off += k
        return out


def _flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(kind, r=1, steps=10, bucket_cap_mb=25.0, **kw):
    rank, n = dist.get_rank(), dist.get_world_size()
    data = load_digits_split()
    model = ConvNet()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    if kind == "torch-powersgd":
        ddp.register_comm_hook(torch_psgd.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                                                        use_error_feedback=True, warm_start=True, random_seed=0),
                               torch_psgd.powerSGD_hook)
    elif kind == "powersgd":
        ddp.register_comm_hook(PowerSGDState(rank=r, start_iter=2, **kw), powersgd_hook)
    elif kind == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "cast-fp16":
        ddp.register_comm_hook(CompressionHookState(CastCompressor(torch.float16)), compression_hook)
    elif kind == "topk":
        ddp.register_comm_hook(CompressionHookState(kw["compressor"], error_feedback=True), compression_hook)
    # kind == "plain": DDP's own all-reduce
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = shard(data.x_train, rank, n), shard(data.y_train, rank, n)
    for s in range(steps):
        xb, yb = x[s * 16:(s + 1) * 16], y[s * 16:(s + 1) * 16]
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(xb), yb).backward()
        opt.step()
    return _flat_params(model)


def _pair(a, b, **kw):
    return _train(a, **kw), _train(b, **kw)


# ------------------------------------------------------------------------------------ DDP, against torch

@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("r", [1, 2])
def test_powersgd_hook_matches_pytorch(world_size, r):
    """Same model, data, seeds and settings: parameters after 10 steps agree within 1e-5 relative
    (measured 5e-7; see the module docstring). One bucket: PyTorch's hook aborts with several buckets on
    gloo (its second all-reduce, issued from a callback, races with the next bucket's first)."""
    results = launch(_pair, world_size, "powersgd", "torch-powersgd", r=r, timeout=120)
    ours, theirs = results[0]
    start = _flat_params(ConvNet())
    travelled = float((theirs - start).norm())
    assert travelled > 0.1  # the models did move
    assert float((ours - theirs).abs().max()) <= 1e-6
    assert float((ours - theirs).norm()) / travelled <= 1e-5
    for o, t in results[1:]:  # every rank holds the same model (up to the last bits: a CPU matrix product
        # may round differently for differently aligned buffers, which momentum then carries along)
        assert torch.allclose(o, ours, rtol=0, atol=1e-6) and torch.allclose(t, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cast_hook_equals_fp16_compress_hook_bitwise(world_size):
    results = launch(_pair, world_size, "cast-fp16", "torch-fp16", timeout=120)
    for ours, theirs in results:
        assert torch.equal(ours, theirs)


def test_powersgd_hook_with_several_buckets_and_full_rank_equals_plain_ddp():
    """rank >= min(m, n) makes PowerSGD exact, so several small buckets must give plain DDP's result."""
    def run():
        return (_train("powersgd", r=64, bucket_cap_mb=0.01, min_compression_rate=0.01),
                _train("plain", bucket_cap_mb=0.01))
    results = launch(run, 2, timeout=120)
    for ours, plain in results:
        assert float((ours - plain).abs().max()) <= 1e-5


@pytest.mark.parametrize("compressor", [TopKDouble(0.1)] + ([_TopK(0.1)] if _TopK is not None else []),
                         ids=lambda c: c.name)
def test_compression_hook_nonlinear_trains_identically_on_all_ranks(compressor):
    def run():
        try:
            return _train("topk", bucket_cap_mb=0.01, compressor=compressor)
        except TypeError:
            return None
    results = launch(run, 2, timeout=120)
    if results[0] is None:
        pytest.skip(f"{compressor.name}: constructor signature differs")
    assert torch.equal(results[0], results[1]) and bool(torch.isfinite(results[0]).all())
    assert not torch.equal(results[0], _flat_params(ConvNet()))


# ------------------------------------------------------------------------- compression_hook, unit tests

def _hook_units(compressor):
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(6, 5, generator=g), torch.randn(7, generator=g)]
    out = {}
    # One step against a reference: every rank's decompressed payload, averaged.
    bucket = FakeBucket(grads)
    local = torch.cat([x.reshape(-1) for x in grads])
    got = compression_hook(CompressionHookState(compressor), bucket).wait()
    mine = compressor.decompress(compressor.compress(local))
    allm = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(allm, mine)
    out["ref_err"] = float((got - sum(allm) / n).abs().max())
    # Error feedback: nothing is lost, sum_t out_t = sum_t avg(g_t) - avg(final residual).
    state = CompressionHookState(compressor, error_feedback=True)
    sent, true = torch.zeros_like(local), torch.zeros_like(local)
    bucket = FakeBucket([local])  # one bucket, the same parameters every step (as DDP's)
    for t in range(5):
        gt = torch.randn(local.numel(), generator=g)
        bucket.buffer().copy_(gt)
        sent += compression_hook(state, bucket).wait()
        ref = gt.clone()
        dist.all_reduce(ref)
        true += ref / n
    res = state.residuals[0].clone()
    dist.all_reduce(res)
    out["ef_conserves"] = float((sent + res / n - true).abs().max())
    return out


# Linear payloads are divided by N and summed in 16 bits: each value (|x| < 5 here) carries a few roundings of
# relative size 2^-11 (fp16) or 2^-8 (bf16). Non-linear payloads are summed after decompression, in float32.
@pytest.mark.parametrize("compressor, tol", [(CastCompressor(torch.float16), 1e-2), (CastCompressor(torch.bfloat16), 1e-1),
                                             (TopKDouble(0.2), 1e-5), (ThresholdDouble(), 1e-5)] +
                         ([(_TopK(0.2), 1e-5)] if _TopK is not None else []), ids=lambda c: getattr(c, "name", ""))
def test_compression_hook_reference_and_error_feedback(compressor, tol):
    for r in launch(_hook_units, 3, compressor, timeout=60):
        assert r["ref_err"] <= tol
        assert r["ef_conserves"] <= tol


def test_compression_hook_state_validation():
    with pytest.raises(ValueError, match="lacks"):
        CompressionHookState(object())
    with pytest.raises(ValueError, match="error_feedback"):
        CompressionHookState(CastCompressor(), error_feedback=1)


# ------------------------------------------------------------------------------- CastCompressor

def test_cast_compressor_round_trip_bytes_and_policy():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    x[0] = 1e-6  # below float16's smallest normal number, 2**-14: there the spacing is absolute, 2**-24
    normal = x.abs() >= 2 ** -14
    for dtype, rel in [(torch.float16, 2 ** -11), (torch.bfloat16, 2 ** -8)]:
        c = CastCompressor(dtype)
        p = c.compress(x)
        assert p.nbytes == 2000 and p.ratio == 2 and c.linear
        y = c.decompress(p)
        assert y.dtype == torch.float32 and y.shape == x.shape
        # Round to nearest: half a unit in the last place, relative for normal numbers.
        assert float(((y - x).abs() / x.abs())[normal].max()) <= rel
        if dtype == torch.float16:
            assert float((y - x).abs()[~normal].max()) <= 2 ** -25
    with pytest.raises(FloatingPointError, match="exceed the largest finite"):
        CastCompressor(torch.float16).compress(torch.tensor([1.0, 7e4]))
    assert torch.equal(CastCompressor(torch.bfloat16).decompress(CastCompressor(torch.bfloat16).compress(
        torch.tensor([7e4]))), torch.tensor([70144.0]))  # bf16 has float32's range (and 8 bits)
    with pytest.raises(FloatingPointError, match="NaN"):
        CastCompressor().compress(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        CastCompressor(torch.int8)
    with pytest.raises(TypeError):
        CastCompressor().compress(torch.arange(3))
    # float64 input comes back as float64
    assert CastCompressor().decompress(CastCompressor().compress(torch.ones(3, dtype=torch.float64))).dtype == torch.float64


# ------------------------------------------------------------------------------------ PowerSGD, units

@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank"), (dict(rank=1.5), "rank"), (dict(rank=True), "rank"),
    (dict(start_iter=-1), "start_iter"), (dict(start_iter=1), "start_iter must be >= 2"),
    (dict(min_compression_rate=0), "min_compression_rate"),
    (dict(min_compression_rate=float("inf")), "min_compression_rate"),
    (dict(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon"),
    (dict(random_seed=-1), "random_seed"), (dict(warm_start=1), "True or False"),
    (dict(process_group="world"), "process_group"),
])
def test_powersgd_state_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PowerSGDState(**kwargs)


def test_powersgd_state_accepts_start_iter_below_2_without_memory():
    s = PowerSGDState(start_iter=0, use_error_feedback=False, warm_start=False)
    assert s.start_iter == 0 and s.step == 0


def test_orthogonalize_rank_deficient_and_zero_give_no_nan():
    for r in (1, 2, 4):
        zero = orthogonalize_(torch.zeros(6, r))
        assert bool(torch.isfinite(zero).all())
        dup = torch.randn(6, 1, generator=torch.Generator().manual_seed(r)).repeat(1, r)  # rank 1
        q = orthogonalize_(dup.clone())
        assert bool(torch.isfinite(q).all())
        assert torch.allclose(q.T @ q, torch.eye(r), atol=1e-5)  # orthonormal even so
    q = orthogonalize_(torch.randn(50, 2))
    assert torch.allclose(q.T @ q, torch.eye(2), atol=1e-5)
    # Whatever rounding does: duplicated columns, with the second cancelling exactly or leaving noise.
    for seed in range(200):
        col = torch.randn(6, 1, generator=torch.Generator().manual_seed(seed))
        for dup in (col.repeat(1, 2), torch.cat([col, 2 * col], 1), torch.cat([col, -col], 1)):
            q = orthogonalize_(dup.clone())
            assert torch.allclose(q.T @ q, torch.eye(2), atol=1e-5), seed


def test_compressed_shape_rule_and_exact_bytes():
    assert compressed_shape((10,), 1, 2) is None                 # 1-D: never
    assert compressed_shape((8, 3, 3, 3), 1, 2) == (8, 27, 1)    # conv: (out, in*kh*kw); 35*2 < 216
    assert compressed_shape((4, 4), 1, 2) is None                # (4+4)*1*2 = 16, not < 16
    assert compressed_shape((3, 50), 8, 2) is None               # r clipped to 3: 53*3*2 >= 150
    assert compressed_shape((3, 50), 8, 0.1) == (3, 50, 3)
    ts = [torch.empty(32, 288), torch.empty(32), torch.empty(8, 1, 3, 3), torch.empty(4, 4, dtype=torch.bfloat16)]
    b = powersgd_nbytes(ts, rank=2, min_compression_rate=2)
    assert b.dense_nbytes == 4 * (32 * 288 + 32 + 72) + 2 * 16
    assert b.p_nbytes == 4 * (32 * 2 + 8 * 2) and b.q_nbytes == 4 * (288 * 2 + 9 * 2)
    assert b.uncompressed_nbytes == 4 * 32 + 2 * 16
    assert b.total_nbytes == b.uncompressed_nbytes + b.p_nbytes + b.q_nbytes


def _reference_powersgd(ms, r, seed=0):
    """Algorithm 1 on the averaged matrix, single process, with the state's first Q draw."""
    mean = sum(ms) / len(ms)
    gen = torch.Generator().manual_seed(int(np.random.RandomState(seed).randint(1_000_000_000)))
    q = orthogonalize_(torch.randn(mean.shape[1], r, generator=gen))
    p = orthogonalize_(mean @ q)
    return p @ (p.T @ mean)


def _psgd_units():
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    # Different gradients per rank; identical outputs, equal to Algorithm 1 on the mean (P all-reduced).
    w = torch.randn(20, 30, generator=g)
    bias = torch.randn(20, generator=g)
    state = PowerSGDState(rank=2, start_iter=2)
    res = powersgd_all_reduce([w, bias], state)
    allw = [torch.empty_like(w) for _ in range(n)]
    dist.all_gather(allw, w)
    allb = [torch.empty_like(bias) for _ in range(n)]
    dist.all_gather(allb, bias)
    out["w"], out["bias"] = res[0], res[1]
    out["ref_w"], out["mean_b"] = _reference_powersgd(allw, 2), sum(allb) / n
    out["bytes"] = state.last_nbytes
    # Local residual: E = M - P_hat (M^T P_hat)^T, i.e. M minus its projection onto the shared P_hat.
    p_hat = torch.linalg.qr(res[0])[0][:, :2]  # span of the output's columns
    out["residual_is_local_projection_error"] = float((state.residuals[0] - (w - p_hat @ (p_hat.T @ w))).abs().max())
    # Rank-deficient (rank 1) and all-zero matrices, r = 2: exact / zero, no NaN; zero recovers next step.
    u, v = torch.randn(16, 1, generator=torch.Generator().manual_seed(7)), torch.randn(1, 12, generator=g)
    s2 = PowerSGDState(rank=2, start_iter=2)
    z = torch.zeros(16, 12)
    low, zero = powersgd_all_reduce([u @ v, z], s2)
    allv = [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(allv, v)
    out["rank1_err"] = float((low - u @ (sum(allv) / n)).abs().max())
    out["zero"] = zero
    _, again = powersgd_all_reduce([u @ v, u @ v], s2)  # the second matrix was zero last step
    out["recovered_err"] = float((again - u @ (sum(allv) / n)).abs().max())
    # r > min(m, n), with a low min_compression_rate: r clipped to 3, the approximation is exact.
    s3 = PowerSGDState(rank=8, start_iter=2, min_compression_rate=0.1)
    m = torch.randn(3, 50, generator=g)
    allm = [torch.empty_like(m) for _ in range(n)]
    dist.all_gather(allm, m)
    out["clipped_err"] = float((powersgd_all_reduce([m], s3)[0] - sum(allm) / n).abs().max())
    out["clipped_q_shape"] = tuple(s3.q_memory[0].shape)
    # Conv weight and bf16 input: shapes and dtypes kept; bf16 close to the float32 computation.
    conv = torch.randn(8, 3, 3, 3, generator=g)
    s4, s5 = PowerSGDState(rank=1, start_iter=2), PowerSGDState(rank=1, start_iter=2)
    c32 = powersgd_all_reduce([conv], s4)[0]
    c16 = powersgd_all_reduce([conv.to(torch.bfloat16)], s5)[0]
    out["conv_shape"], out["conv_dtype16"] = tuple(c32.shape), c16.dtype
    out["bf16_rel"] = float((c16.float() - c32).norm() / c32.norm())
    out["conv_residual_dtype"] = s5.residuals[0].dtype
    # NaN on one rank: every rank raises, the state keeps its residuals.
    s6 = PowerSGDState(rank=1, start_iter=2)
    powersgd_all_reduce([w], s6)
    before = s6.residuals[0].clone()
    bad = w.clone()
    if rank == 1:
        bad[0, 0] = float("nan")
    try:
        powersgd_all_reduce([bad], s6)
        out["nan_raised"] = False
    except FloatingPointError:
        out["nan_raised"] = True
    out["nan_state_kept"] = torch.equal(s6.residuals[0], before)
    # Warm start: Q is remembered and identical on all ranks.
    q = s6.q_memory[0].clone()
    allq = [torch.empty_like(q) for _ in range(n)]
    dist.all_gather(allq, q)
    out["q_same"] = all(torch.equal(a, q) for a in allq)
    # out=: the averages are written into the given tensors, and those very objects come back (torch's
    # convention), also for a leaf that requires grad and for out being the inputs themselves.
    s7, s8 = PowerSGDState(rank=2, start_iter=2), PowerSGDState(rank=2, start_iter=2)
    given = [torch.empty_like(w).requires_grad_(), torch.empty_like(bias)]
    returned = powersgd_all_reduce([w, bias], s7, out=given)
    plain = powersgd_all_reduce([w, bias], s8)
    inplace = [w.clone(), bias.clone()]
    back = powersgd_all_reduce(inplace, PowerSGDState(rank=2, start_iter=2), out=inplace)
    out["out_is_given"] = (all(r is o for r, o in zip(returned, given)) and all(r is o for r, o in zip(back, inplace))
                           and all(torch.equal(o.detach(), p) for o, p in zip(given, plain))
                           and all(torch.equal(o, p) for o, p in zip(inplace, plain)))
    out["out_errors"] = []
    for bad_out in ([torch.empty_like(w)], [torch.empty_like(w), torch.empty(3)]):
        try:
            powersgd_all_reduce([w, bias], PowerSGDState(rank=2, start_iter=2), out=bad_out)
        except ValueError as e:
            out["out_errors"].append(str(e))
    return out


def test_powersgd_out_returns_the_out_tensors_themselves(psgd_units):
    for a in psgd_units:
        assert a["out_is_given"]
        assert len(a["out_errors"]) == 2
        assert "1 out tensors for 2 tensors" in a["out_errors"][0] and "out[1] has shape [3]" in a["out_errors"][1]


@pytest.fixture(scope="module")
def psgd_units():
    return launch(_psgd_units, 2, timeout=60)


def test_powersgd_p_is_all_reduced_outputs_identical_and_equal_to_algorithm_1(psgd_units):
    a, b = psgd_units
    # Identical up to the last bits of a CPU matrix product (without the P all-reduce they differ at O(1)).
    assert torch.allclose(a["w"], b["w"], rtol=0, atol=1e-6) and torch.equal(a["bias"], b["bias"])
    assert torch.allclose(a["w"], a["ref_w"], rtol=1e-5, atol=1e-5)


def test_powersgd_one_dimensional_tensors_sent_uncompressed(psgd_units):
    a, _ = psgd_units
    assert torch.allclose(a["bias"], a["mean_b"], atol=1e-6)
    assert a["bytes"].uncompressed_nbytes == 20 * 4
    assert a["bytes"].p_nbytes == 20 * 2 * 4 and a["bytes"].q_nbytes == 30 * 2 * 4


def test_powersgd_residual_is_local_projection_error(psgd_units):
    for r in psgd_units:
        assert r["residual_is_local_projection_error"] <= 1e-5


def test_powersgd_rank_deficient_and_zero_matrices(psgd_units):
    for r in psgd_units:
        assert r["rank1_err"] <= 1e-5
        assert torch.equal(r["zero"], torch.zeros(16, 12))
        assert r["recovered_err"] <= 1e-5


def test_powersgd_rank_clipped_to_min_dimension(psgd_units):
    for r in psgd_units:
        assert r["clipped_q_shape"] == (50, 3)
        assert r["clipped_err"] <= 1e-5


def test_powersgd_conv_weights_and_bf16(psgd_units):
    for r in psgd_units:
        assert r["conv_shape"] == (8, 3, 3, 3)
        assert r["conv_dtype16"] == torch.bfloat16
        assert r["bf16_rel"] <= 2e-2  # bf16 keeps 8 significant bits of the inputs and outputs
        assert r["conv_residual_dtype"] == torch.float32


def test_powersgd_nan_on_one_rank_raises_on_every_rank(psgd_units):
    for r in psgd_units:
        assert r["nan_raised"] and r["nan_state_kept"]
        assert r["q_same"]


def _before_start_iter():
    rank = dist.get_rank()
    state = PowerSGDState(rank=1, start_iter=2)
    g = torch.full((4, 40), float(rank + 1))
    outs = []
    for _ in range(3):
        outs.append(powersgd_hook(state, FakeBucket([g, g[0]])).wait().clone())
    return outs, state.step


def test_powersgd_hook_plain_average_before_start_iter():
    for outs, step in launch(_before_start_iter, 2, timeout=60):
        assert step == 3
        assert torch.equal(outs[0], torch.full((200,), 1.5)) and torch.equal(outs[1], outs[0])
        assert torch.allclose(outs[2], outs[0], atol=1e-5)  # rank 1 of a rank-1 matrix is exact


# ------------------------------------------------------------------------------- state for checkpoints

def _resume_with_hook_state(kind):
    """Six steps through a BucketedDataParallel (several buckets) with the hook, against three steps, a restart
    into new objects from the model's, the optimizer's and the hook state's state dicts, and three more; and
    the same restart without the hook state."""
    from commlab.compress import RandomK, TopK
    from commlab.overlap import BucketedDataParallel
    rank, n = dist.get_rank(), dist.get_world_size()
    data = load_digits_split()
    x, y = shard(data.x_train, rank, n), shard(data.y_train, rank, n)

    def build():
        model = ConvNet()
        wrapped = BucketedDataParallel(model, bucket_cap_bytes=4096)
        if kind == "powersgd":
            state, hook = PowerSGDState(rank=2, start_iter=2), powersgd_hook
        else:
            state = CompressionHookState(TopK(ratio=0.1) if kind == "topk" else RandomK(ratio=0.1), None, True)
            hook = compression_hook
        wrapped.register_comm_hook(state, hook)
        return model, wrapped, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def run(parts, steps):
        _, wrapped, _, opt = parts
        for s in steps:
            opt.zero_grad()
            nn.functional.cross_entropy(wrapped(x[s * 16:(s + 1) * 16]), y[s * 16:(s + 1) * 16]).backward()
            opt.step()

    def restart(with_hook_state):
        first = build()
        run(first, range(3))
        again = build()
        again[0].load_state_dict(first[0].state_dict())
        again[3].load_state_dict(first[3].state_dict())
        if with_hook_state:
            sd = first[2].state_dict()
            if kind == "powersgd":
                again[2].load_state_dict(sd)
            else:
                names = dict(again[1].module.named_parameters())
                again[2].load_state_dict(sd, {b.index: [names[m] for m in b.names] for b in again[1].buckets})
        run(again, range(3, 6))
        return _flat_params(again[0]), first[2].state_dict()

    whole = build()
    run(whole, range(6))
    resumed, sd = restart(True)
    fresh, _ = restart(False)
    errors = []
    if kind == "powersgd":
        bad = [(PowerSGDState(rank=1, start_iter=2), (sd,))]
    else:
        wrong = {b: [nn.Parameter(torch.zeros(3))] for b in sd["bucket_numels"]}
        cls = TopK if kind == "topk" else RandomK
        bad = [(CompressionHookState(cls(ratio=0.1), None, True), (sd, wrong)),
               (CompressionHookState(cls(ratio=0.2), None, True), (sd, {}))]
    for target, args in bad:
        try:
            target.load_state_dict(*args)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return torch.equal(resumed, _flat_params(whole[0])), torch.equal(fresh, _flat_params(whole[0])), errors


@pytest.mark.parametrize("kind", ["powersgd", "topk", "randomk"])
def test_hook_state_dicts_resume_bitwise_and_refuse_another_setting(kind):
    for same, same_without, errors in launch(_resume_with_hook_state, 2, kind, timeout=90):
        assert same and not same_without   # the state matters, and its state dict carries all of it
        if kind == "powersgd":
            assert "saved with {'rank': 2" in errors[0] and "this state has {'rank': 1" in errors[0]
        else:
            assert "was saved holding parameters of" in errors[0] and "now it holds [3]" in errors[0]
            assert f"saved for {kind}(0.1) with error_feedback=True, this state has {kind}(0.2)" in errors[1]
