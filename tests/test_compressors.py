"""Single-process tests of the compressors: round trips, exact bytes, statistics, edge cases, error feedback."""

import math

import pytest
import torch

from commlab.compress import (QSGD, Compressor, ErrorFeedback, Payload, RandomK, RoundingQuantizer, SignCompressor,
                              TopK, expected_union_support, pack_bits, pack_nibbles, qsgd_variance_bound,
                              sparse_ring_fill_in, topk_global, union_support_sizes, unpack_bits, unpack_nibbles)
from commlab.compress.bitpack import pack_bits_, packed_bits_nbytes, packed_nibbles_nbytes
from commlab.compress.sparse import index_dtype, resolve_k

FACTORIES = {
    "topk": lambda: TopK(ratio=0.25),
    "topk_k": lambda: TopK(k=3),
    "randomk": lambda: RandomK(ratio=0.25, seed=3),
    "qsgd4": lambda: QSGD(levels=7, seed=1),
    "qsgd8": lambda: QSGD(bits=8, seed=1),
    "int8": lambda: RoundingQuantizer(8),
    "int4": lambda: RoundingQuantizer(4),
    "sign": lambda: SignCompressor(),
}
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------------------- bit packing

@pytest.mark.parametrize("numel", list(range(0, 18)) + [1000, 1001])
def test_bits_and_nibbles_round_trip_for_every_count(numel):
    g = torch.Generator().manual_seed(numel)
    bits = torch.randint(0, 2, (numel,), generator=g).bool()
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bits_nbytes(numel) == math.ceil(numel / 8)
    assert torch.equal(unpack_bits(packed, numel), bits)
    nib = torch.randint(0, 16, (numel,), generator=g)
    packed = pack_nibbles(nib)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nibbles_nbytes(numel) == math.ceil(numel / 2)
    assert torch.equal(unpack_nibbles(packed, numel), nib.to(torch.uint8))


def test_documented_bit_and_nibble_order():
    # element 8i+j -> bit j of byte i, LSB first; padding bits are 0
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0, 1])).tolist() == [1, 2]
    assert pack_bits(torch.tensor([0, 0, 0, 0, 0, 0, 0, 1])).tolist() == [128]
    # element 2i -> low nibble, 2i+1 -> high nibble; odd count padded with 0
    assert pack_nibbles(torch.tensor([1, 2, 3])).tolist() == [0x21, 0x03]
    # any layout is read in row-major order
    m = torch.tensor([[1, 0], [1, 1]], dtype=torch.uint8)
    assert torch.equal(pack_bits(m.t()), pack_bits(m.t().contiguous()))


def test_every_byte_value_packs_and_unpacks_from_any_offset():
    # All 256 bit patterns (and every nibble pair), read from views that start at every byte offset: the
    # word-at-a-time packing must not depend on the alignment of the input.
    byte = torch.arange(256)
    bits = ((byte[:, None] >> torch.arange(8)) & 1).reshape(-1)
    nibs = torch.stack([byte & 15, byte >> 4], dim=1).reshape(-1)
    for offset in range(9):
        padded_bits = torch.cat([torch.zeros(offset, dtype=torch.long), bits]).bool()[offset:]
        assert torch.equal(pack_bits(padded_bits), byte.to(torch.uint8))
        assert torch.equal(pack_bits(padded_bits.to(torch.uint8), check=False), byte.to(torch.uint8))
        assert torch.equal(pack_bits_(padded_bits.clone()), byte.to(torch.uint8))  # packs in its input's memory
        padded_nibs = torch.cat([torch.zeros(offset, dtype=torch.uint8), nibs.to(torch.uint8)])[offset:]
        assert torch.equal(pack_nibbles(padded_nibs), byte.to(torch.uint8))
    assert torch.equal(unpack_bits(byte.to(torch.uint8), 2048), bits.bool())
    assert torch.equal(unpack_nibbles(byte.to(torch.uint8), 512), nibs.to(torch.uint8))
    # an odd count of nibbles past a whole number of words (4 per int32)
    assert pack_nibbles(torch.tensor([1, 2, 3, 4, 5, 6, 7])).tolist() == [0x21, 0x43, 0x65, 0x07]


def test_packing_rejects_bad_input():
    with pytest.raises(ValueError, match="0..1"):
        pack_bits(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="0..15"):
        pack_nibbles(torch.tensor([16]))
    with pytest.raises(ValueError, match="0..15"):
        pack_nibbles(torch.tensor([-1, 3]))
    with pytest.raises(TypeError, match="integer"):
        pack_bits(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(ValueError, match="bytes"):
        unpack_nibbles(torch.zeros(2, dtype=torch.uint8), 5)
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.zeros(2, dtype=torch.int8), 9)
    with pytest.raises(ValueError, match="numel"):
        unpack_bits(torch.zeros(0, dtype=torch.uint8), -1)


# ------------------------------------------------------------------------------- shared protocol checks

@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,), (7,), (4, 5), (2, 3, 5)])
def test_round_trip_keeps_shape_and_dtype_and_leaves_input_alone(name, dtype, shape):
    comp = FACTORIES[name]()
    assert isinstance(comp, Compressor)
    x = _x(shape, dtype)
    before = x.clone()
    p = comp.compress(x)
    y = comp.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    assert torch.equal(x, before)
    assert p.shape == x.shape and p.dtype == x.dtype
    if x.numel() == 0:
        assert p.nbytes == 0 and p.ratio == 1.0


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_all_zero_input_gives_zeros_not_nan(name, dtype):
    comp = FACTORIES[name]()
    x = torch.zeros(4, 9, dtype=dtype)
    y = comp.decompress(comp.compress(x))
    assert torch.equal(y, x)


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_input_raises(name, bad, dtype):
    x = _x((10,), dtype)
    x[3] = bad
    with pytest.raises(FloatingPointError, match="non-finite"):
        FACTORIES[name]().compress(x)


@pytest.mark.parametrize("name", FACTORIES)
def test_non_contiguous_views_compress_like_their_contiguous_copy(name):
    base = _x((6, 10))
    for view in (base.t(), base[:, ::3], base[1::2]):
        assert not view.is_contiguous()
        a = FACTORIES[name]()
        b = FACTORIES[name]()  # same settings and seed: the same random stream
        ya = a.decompress(a.compress(view))
        yb = b.decompress(b.compress(view.contiguous()))
        assert ya.shape == view.shape and torch.equal(ya, yb)


@pytest.mark.parametrize("name", FACTORIES)
def test_low_precision_inputs_decompress_close_to_float32(name):
    x = _x((64,))
    for dtype in (torch.bfloat16, torch.float16):
        a, b = FACTORIES[name](), FACTORIES[name]()
        y_lo = a.decompress(a.compress(x.to(dtype)))
        y32 = b.decompress(b.compress(x.to(dtype).float()))
        assert y_lo.dtype == dtype
        # the same code path; only the final rounding to the low-precision dtype differs
        assert torch.allclose(y_lo.float(), y32, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------- exact byte counts

def test_exact_payload_bytes():
    x100 = _x((100,))
    assert TopK(k=10).compress(x100).nbytes == 10 * 4 + 10 * 4
    assert TopK(k=10).compress(x100.to(torch.bfloat16)).nbytes == 10 * 2 + 10 * 4
    assert TopK(k=10).compress(x100.double()).nbytes == 10 * 8 + 10 * 4
    assert RandomK(k=10).compress(x100).nbytes == 10 * 4  # indices regenerated, not sent
    x7 = _x((7,))
    assert RoundingQuantizer(4).compress(x7).nbytes == 4 + 4
    assert RoundingQuantizer(8).compress(x7).nbytes == 7 + 4
    assert QSGD(levels=7).compress(x7).nbytes == 4 + 4
    assert QSGD(levels=8).compress(x7).nbytes == 7 + 4
    assert QSGD(levels=3, bits=8).compress(x7).nbytes == 7 + 4
    assert SignCompressor().compress(_x((17,))).nbytes == 3 + 4
    assert SignCompressor().compress(_x((16,))).nbytes == 2 + 4
    p = SignCompressor().compress(_x((1024,)))
    assert p.ratio == 1024 * 4 / (128 + 4)


def test_sign_with_segments_scales_each_segment_by_its_own_mean():
    # Karimireddy et al.'s ||v||_1/d * sign(v), applied to each segment (a bucket's parameter tensors) on its own.
    x = torch.cat([_x((5,)) * 1e-3, _x((0,)), _x((12,), seed=1) * 10.0])
    comp = SignCompressor(segments=[5, 0, 12])
    p = comp.compress(x)
    want = torch.cat([torch.where(part >= 0, 1.0, -1.0) * part.abs().mean() for part in (x[:5], x[5:])])
    assert torch.allclose(comp.decompress(p), want, rtol=1e-6, atol=0)
    assert p.nbytes == 3 + 3 * 4 and p.tensors["scale"][1] == 0 and p.meta == {"segments": (5, 0, 12)}
    whole = SignCompressor(segments=[17])
    assert torch.equal(whole.decompress(whole.compress(x)), SignCompressor().decompress(SignCompressor().compress(x)))
    with pytest.raises(ValueError, match="add up to 16 elements, the input has 17"):
        SignCompressor(segments=[4, 12]).compress(x)
    with pytest.raises(ValueError, match="segments\\[1\\]"):
        SignCompressor(segments=[4, -1])
    bad = x.clone()
    bad[7] = float("nan")
    with pytest.raises(FloatingPointError):
        comp.compress(bad)


def test_int4_really_sends_half_of_int8():
    x = _x((1000,))
    p4, p8 = RoundingQuantizer(4).compress(x), RoundingQuantizer(8).compress(x)
    assert p4.tensors["codes"].numel() * 2 == p8.tensors["codes"].numel() == 1000
    assert p4.nbytes - 4 == (p8.nbytes - 4) // 2
    q4, q8 = QSGD(bits=4).compress(x), QSGD(bits=8).compress(x)
    assert q4.nbytes - 4 * 2 == (q8.nbytes - 4 * 2) // 2 == 500  # two buckets of 512 (the last short): two norms


def test_index_dtype_depends_on_size_only():
    assert index_dtype(10) == torch.int32
    assert index_dtype(2 ** 31 - 1) == torch.int32
    assert index_dtype(2 ** 31) == torch.int64
    assert TopK(k=3).compress(_x((50,))).tensors["indices"].dtype == torch.int32


# ----------------------------------------------------------------------------------------------- Top-K

def test_topk_keeps_the_largest_magnitudes():
    x = torch.tensor([0.1, -5.0, 2.0, -0.3, 4.0, 0.0])
    p = TopK(k=3).compress(x)
    assert p.tensors["indices"].tolist() == [1, 2, 4]
    assert p.tensors["values"].tolist() == [-5.0, 2.0, 4.0]
    assert TopK(k=3).decompress(p).tolist() == [0.0, -5.0, 2.0, 0.0, 4.0, 0.0]


def test_topk_ties_go_to_the_lower_index_deterministically():
    x = torch.tensor([1.0, -1.0, 1.0, 2.0, -1.0, 1.0])
    for _ in range(5):
        assert TopK(k=3).compress(x).tensors["indices"].tolist() == [0, 1, 3]
    assert TopK(k=1).compress(torch.zeros(9)).tensors["indices"].tolist() == [0]


def test_topk_with_k_equal_numel_is_lossless():
    for dtype in FLOATS:
        x = _x((3, 7), dtype)
        for comp in (TopK(k=21), TopK(ratio=1.0), TopK(k=1000)):
            assert torch.equal(comp.decompress(comp.compress(x)), x)


def test_k_rounding_and_clipping():
    assert resolve_k(10, ratio=0.001) == 1      # rounds to 0 -> at least one entry
    assert resolve_k(0, ratio=0.5) == 0         # only an empty tensor sends nothing
    assert resolve_k(10, k=50) == 10            # clipped to numel
    assert resolve_k(1000, ratio=0.0125) == 12  # round half to even: 12.5 -> 12
    assert resolve_k(1000, ratio=0.0135) == 14
    assert TopK(ratio=0.001).compress(_x((10,))).meta["k"] == 1
    assert TopK(k=50).compress(_x((10,))).meta["k"] == 10
    assert TopK().ratio == 0.01


@pytest.mark.parametrize("cls", [TopK, RandomK])
@pytest.mark.parametrize("kwargs, match", [({"ratio": 0}, r"\(0, 1\]"), ({"ratio": 1.5}, r"\(0, 1\]"),
                                           ({"ratio": 0.1, "k": 3}, "not both"), ({"k": 0}, ">= 1"),
                                           ({"k": 2.5}, ">= 1"), ({"ratio": "1%"}, r"\(0, 1\]")])
def test_sparsifiers_reject_bad_settings(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_topk_global_spends_the_budget_where_the_magnitudes_are():
    big, small = _x((50,), seed=1) * 100, _x((4, 25), seed=2)
    payloads = topk_global([big, small], k=20)
    assert [p.meta["k"] for p in payloads] == [20, 0]
    assert payloads[1].nbytes == 0 and torch.equal(TopK().decompress(payloads[1]), torch.zeros(4, 25))
    # layer-wise spends k on each tensor whatever its size
    assert TopK(k=20).compress(small).meta["k"] == 20
    # the union of the per-tensor selections is the Top-K of the concatenation
    a, b = _x((30,), seed=3), _x((5, 6), seed=4).to(torch.bfloat16)
    payloads = topk_global([a, b], k=17)
    assert sum(p.meta["k"] for p in payloads) == 17
    dense = torch.cat([TopK().decompress(p).reshape(-1).double() for p in payloads])
    cat = torch.cat([a.double(), b.reshape(-1).double()])
    ref = TopK(k=17).decompress(TopK(k=17).compress(cat))
    assert torch.equal(dense, ref)
    assert TopK().decompress(payloads[1]).dtype == torch.bfloat16
    assert topk_global([]) == []
    with pytest.raises(FloatingPointError):
        topk_global([a, torch.tensor([float("nan")])], k=3)


# --------------------------------------------------------------------------------------------- Random-K

def test_randomk_ranks_with_the_same_seed_pick_the_same_indices_and_payloads_add():
    r0, r1 = RandomK(k=8, seed=5), RandomK(k=8, seed=5)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        a = torch.randint(-9, 10, (32,), generator=g).float()
        b = torch.randint(-9, 10, (32,), generator=g).float()
        pa, pb = r0.compress(a), r1.compress(b)
        assert pa.meta == pb.meta == {"k": 8, "seed": 5, "step": step}
        summed = type(pa)({"values": pa.tensors["values"] + pb.tensors["values"]}, pa.shape, pa.dtype, pa.meta)
        # linear: decompress(sum of payloads) == sum of decompressed (exact on integer data, scale 32/8 = 4)
        assert torch.equal(r0.decompress(summed), r0.decompress(pa) + r1.decompress(pb))
    idx = [RandomK.indices(32, 8, 5, s) for s in range(3)]
    assert not torch.equal(idx[0], idx[1]) and not torch.equal(idx[1], idx[2])
    assert not torch.equal(RandomK.indices(32, 8, 6, 0), idx[0])
    with pytest.raises(ValueError, match="seed"):
        RandomK(k=1, seed=-1)


def test_randomk_is_unbiased():
    n, k, samples = 20, 5, 4000
    x = _x((n,), torch.float64, seed=7)
    comp = RandomK(k=k, seed=11)
    mean = sum(comp.decompress(comp.compress(x)) for _ in range(samples)) / samples
    # each coordinate: x_i * (n/k) * Bernoulli(k/n), variance x_i^2 (n/k - 1); 6 standard errors
    stderr = x.abs() * math.sqrt((n / k - 1) / samples)
    assert ((mean - x).abs() <= 6 * stderr + 1e-12).all()
    # and the expected squared error equals (n/k - 1)||x||^2 (the price of unbiasedness)
    errs = torch.stack([((comp.decompress(comp.compress(x)) - x) ** 2).sum() for _ in range(2000)])
    assert abs(errs.mean().item() / ((n / k - 1) * (x ** 2).sum().item()) - 1) < 0.15


# ------------------------------------------------------------------------------------------------- QSGD

@pytest.mark.parametrize("kwargs, match", [({"levels": 0}, "1..127"), ({"levels": 128}, "1..127"),
                                           ({"bits": 5}, r"bits must be one of \[4, 8\]"), ({"levels": 8, "bits": 4}, "do not fit"),
                                           ({"levels": 2.0}, "1..127"), ({"seed": -1}, "seed")])
def test_qsgd_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QSGD(**kwargs)


def test_qsgd_settings_and_codes():
    assert (QSGD().levels, QSGD().bits) == (7, 4)
    assert (QSGD(bits=8).levels, QSGD(bits=4).levels) == (127, 7)
    assert QSGD(levels=8).bits == 8 and QSGD(levels=7).bits == 4
    x = torch.tensor([3.0, -4.0, 0.0])  # norm 5
    for comp in (QSGD(levels=5), QSGD(levels=5, bits=8)):
        p = comp.compress(x)
        assert p.tensors["norm"].tolist() == [5.0]
        y = comp.decompress(p)
        # r = 5|v|/5 = |v| is an integer: no randomness, exact
        assert y.tolist() == [3.0, -4.0, 0.0]
    # the same seed gives the same stream
    a, b = QSGD(seed=9), QSGD(seed=9)
    z = _x((50,))
    assert torch.equal(a.decompress(a.compress(z)), b.decompress(b.compress(z)))


@pytest.mark.slow
@pytest.mark.parametrize("levels", [1, 2, 7, 100])
def test_qsgd_is_unbiased_and_its_variance_is_within_the_bound(levels):
    n, samples = 16, 4000
    v = _x((n,), torch.float64, seed=levels)
    comp = QSGD(levels=levels, seed=123)
    outs = torch.stack([comp.decompress(comp.compress(v)) for _ in range(samples)])
    norm = float(torch.linalg.vector_norm(v).float())  # the float32 norm that is sent
    # each coordinate is norm/s * (floor(r) + Bernoulli(frac r)): variance (norm/s)^2 p(1-p) <= (norm/s)^2/4
    stderr = norm / levels / 2 / math.sqrt(samples)
    assert ((outs.mean(0) - v).abs() <= 6 * stderr + 1e-6).all()
    r = levels * v.abs() / norm
    frac = r - r.floor()
    exact_var = (norm / levels) ** 2 * float((frac * (1 - frac)).sum())
    emp_var = float(((outs - v) ** 2).sum(1).mean())
    bound = qsgd_variance_bound(n, levels) * float((v ** 2).sum())
    assert exact_var <= bound
    assert emp_var <= bound
    assert abs(emp_var - exact_var) <= 0.15 * exact_var + 1e-9


def test_qsgd_variance_bound_formula():
    assert qsgd_variance_bound(100, 1) == 10.0         # sqrt(n)/s < n/s^2
    assert qsgd_variance_bound(100, 20) == 100 / 400   # n/s^2 < sqrt(n)/s
    assert qsgd_variance_bound(0, 3) == 0.0
    with pytest.raises(ValueError):
        qsgd_variance_bound(10, 0)
    with pytest.raises(ValueError):
        qsgd_variance_bound(-1, 2)
    # buckets: n is replaced by the bucket size d (QSGD's default 512), a tensor smaller than d is one bucket
    assert qsgd_variance_bound(116705, 7) == qsgd_variance_bound(512, 7, None) == min(512 / 49, math.sqrt(512) / 7)
    assert qsgd_variance_bound(116705, 7, None) == math.sqrt(116705) / 7
    assert qsgd_variance_bound(100, 7, 512) == qsgd_variance_bound(100, 7, None)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="bucket_size"):
            qsgd_variance_bound(10, 3, bad)
        with pytest.raises(ValueError, match="bucket_size"):
            QSGD(bucket_size=bad)


# Codes and norm of QSGD(seed=11) on _x((40,), seed=3), twice in a row, as recorded from the implementation
# before QSGD had buckets (one norm per tensor): one bucket must reproduce them exactly.
_ONE_BUCKET_4BIT = [[9, 144, 154, 33, 144, 130, 17, 24, 25, 139, 137, 16, 40, 169, 152, 137, 18, 25, 153, 161],
                    [8, 145, 154, 17, 144, 130, 33, 24, 25, 154, 153, 17, 24, 153, 152, 153, 1, 25, 153, 145]]
_ONE_BUCKET_8BIT = [-5, 3, 15, -12, -36, -17, 15, 21, 3, -18, 37, -8, 13, 26, -3, 13, -11, 24, -51, -11, -31, -6, 4,
                    17, -8, 21, -10, -27, -1, -13, -24, -3, 28, 9, -21, 15, -21, -18, 22, -30]


@pytest.mark.parametrize("bucket_size", [None, 40, 1000])
def test_qsgd_with_one_bucket_reproduces_the_unbucketed_codes(bucket_size):
    x = _x((40,), seed=3)
    q4, q8 = QSGD(levels=7, seed=11, bucket_size=bucket_size), QSGD(bits=8, seed=11, bucket_size=bucket_size)
    for expected in _ONE_BUCKET_4BIT:
        p = q4.compress(x)
        assert p.tensors["codes"].tolist() == expected and p.tensors["norm"].tolist() == [5.510150909423828]
    assert q8.compress(x).tensors["codes"].tolist() == _ONE_BUCKET_8BIT


def _qsgd_reference(v: torch.Tensor, s: int, d: int, u: torch.Tensor) -> torch.Tensor:
    """QSGD of float64 ``v`` bucket by bucket, written out from the definition, with the uniforms ``u``."""
    out = []
    for start in range(0, v.numel(), d):
        b, ub = v[start:start + d], u[start:start + d]
        norm = float(torch.linalg.vector_norm(b).float())  # the float32 norm that is sent
        if norm == 0:
            out.append(torch.zeros_like(b))
            continue
        r = (b.abs() / norm * s).clamp(max=s)
        xi = r.floor() + (ub < r - r.floor()).double()
        out.append(torch.sign(b) * xi * (norm / s))
    return torch.cat(out)


@pytest.mark.parametrize("bits", [4, 8])
def test_qsgd_buckets_follow_the_definition_and_count_one_norm_each(bits):
    v = _x((45,), torch.float64, seed=5)
    v[16:32] = 0.0  # an all-zero bucket: zeros out, no division by its zero norm
    comp = QSGD(bits=bits, seed=2, bucket_size=16)  # buckets of 16, 16 and a short last one of 13
    p = comp.compress(v)
    assert p.tensors["norm"].shape == (3,) and p.tensors["norm"][1] == 0
    assert p.tensors["norm"][2].item() == pytest.approx(float(v[32:].norm()), rel=1e-6)  # its own entries only
    assert p.nbytes == (23 if bits == 4 else 45) + 3 * 4 and p.meta["bucket_size"] == 16
    u = torch.rand(45, generator=torch.Generator().manual_seed(2), dtype=torch.float64)  # one uniform per entry
    assert torch.equal(comp.decompress(p), _qsgd_reference(v, comp.levels, 16, u))
    assert QSGD(bucket_size=16).name == "qsgd(s=7,4bit,d=16)" and QSGD(bucket_size=None).name == "qsgd(s=7,4bit,d=n)"


@pytest.mark.parametrize("levels", [1, 7])
def test_bucketed_qsgd_variance_is_within_the_per_bucket_bound(levels):
    # Two full buckets of 16 and a short one of 8; one bucket holds the large entries.
    n, d, samples = 40, 16, 2000
    v = _x((n,), torch.float64, seed=levels)
    v[:16] *= 30
    comp = QSGD(levels=levels, seed=7, bucket_size=d)
    outs = torch.stack([comp.decompress(comp.compress(v)) for _ in range(samples)])
    norms = [float(torch.linalg.vector_norm(v[i:i + d]).float()) for i in range(0, n, d)]
    exact_var = 0.0
    for i, norm in zip(range(0, n, d), norms):
        r = levels * v[i:i + d].abs() / norm
        frac = r - r.floor()
        exact_var += (norm / levels) ** 2 * float((frac * (1 - frac)).sum())
        stderr = norm / levels / 2 / math.sqrt(samples)
        assert ((outs[:, i:i + d].mean(0) - v[i:i + d]).abs() <= 6 * stderr + 1e-6).all()
    emp_var = float(((outs - v) ** 2).sum(1).mean())
    bound = qsgd_variance_bound(n, levels, d) * float((v ** 2).sum())
    assert exact_var <= bound and emp_var <= bound
    assert abs(emp_var - exact_var) <= 0.15 * exact_var
    # the same vector in one bucket: a looser bound, and the small entries' rounding scaled by the large norm
    assert qsgd_variance_bound(n, levels, None) > qsgd_variance_bound(n, levels, d)
    one = QSGD(levels=levels, seed=7, bucket_size=None)
    one_var = float(torch.stack([((one.decompress(one.compress(v)) - v) ** 2).sum() for _ in range(300)]).mean())
    assert one_var > emp_var


def test_decoders_skip_the_overflow_pass_only_when_nothing_can_overflow():
    # A bucket norm of 1e5 (above fp16's 65504): the fp16 output overflows only where a level is large enough.
    big = Payload({"codes": torch.tensor([7, 8], dtype=torch.int8), "norm": torch.tensor([1e5])},
                  torch.Size([2]), torch.float16, {"levels": 127, "bits": 8, "bucket_size": None})
    assert QSGD(bits=8).decompress(big).tolist() == pytest.approx([7 * 1e5 / 127, 8 * 1e5 / 127], rel=1e-3)
    big.tensors["codes"][1] = 100  # 100/127 * 1e5 = 78740 > 65504
    with pytest.raises(FloatingPointError, match="overflow"):
        QSGD(bits=8).decompress(big)
    int8 = Payload({"codes": torch.tensor([100], dtype=torch.int8), "scale": torch.tensor([1e3])},
                   torch.Size([1]), torch.float16, {"bits": 8})
    with pytest.raises(FloatingPointError, match="overflow"):
        RoundingQuantizer(8).decompress(int8)
    sign = Payload({"bits": torch.tensor([1], dtype=torch.uint8), "scale": torch.tensor([1e5])},
                   torch.Size([1]), torch.float16, {})
    with pytest.raises(FloatingPointError, match="overflow"):
        SignCompressor().decompress(sign)


def test_qsgd_names_the_bucket_whose_norm_float32_cannot_hold():
    x = torch.ones(40, dtype=torch.float64)
    x[35] = 1e300
    with pytest.raises(FloatingPointError, match="bucket 2 .entries 32..39."):
        QSGD(bucket_size=16).compress(x)


# ------------------------------------------------------------------------------------ rounding quantizer

@pytest.mark.parametrize("bits", [4, 8])
def test_rounding_error_is_at_most_half_a_step_and_the_extremes_are_exact(bits):
    x = _x((101,))
    comp = RoundingQuantizer(bits)
    p = comp.compress(x)
    qmax = 2 ** (bits - 1) - 1
    scale = p.tensors["scale"].item()
    assert scale == pytest.approx(x.abs().max().item() / qmax)
    y = comp.decompress(p)
    assert ((y - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    i = x.abs().argmax()
    assert y[i].item() == pytest.approx(x[i].item(), rel=1e-6)


def test_rounding_is_biased_for_small_persistent_values():
    # entries below half a step round to 0 every time: the bias error feedback exists to remove
    x = torch.tensor([1.0, 0.05, -0.05, 0.0])
    comp = RoundingQuantizer(4)
    assert comp.decompress(comp.compress(x)).tolist()[1:] == [0.0, 0.0, 0.0]
    ef = ErrorFeedback(comp)
    sent = sum(comp.decompress(ef.compress(x, "w")) for _ in range(30))
    assert sent[1].item() > 0.5 * 30 * 0.05  # with error feedback the small entry gets through


@pytest.mark.parametrize("bits", [3, 16, 8.0, True])
def test_rounding_quantizer_rejects_bad_bits(bits):
    with pytest.raises(ValueError, match=r"bits must be one of \[8, 4\]"):
        RoundingQuantizer(bits)


# ------------------------------------------------------------------------------------------------- sign

def test_sign_zero_is_plus_one_and_the_scale_is_the_mean_magnitude():
    x = torch.tensor([0.0, -0.0, 1.0, -2.0, 3.0])
    comp = SignCompressor()
    p = comp.compress(x)
    assert p.tensors["scale"].dtype == torch.float32 and p.tensors["scale"].item() == pytest.approx(1.2)
    assert unpack_bits(p.tensors["bits"], 5).tolist() == [True, True, True, False, True]
    s = p.tensors["scale"].item()
    assert comp.decompress(p).tolist() == [s, s, s, -s, s]


# --------------------------------------------------------------------------------------- error feedback

@pytest.mark.parametrize("name", ["topk", "sign", "int4", "qsgd4", "randomk"])
def test_error_feedback_residual_is_exactly_what_was_not_sent(name):
    comp = FACTORIES[name]()
    ef = ErrorFeedback(comp)
    assert ef.residual("w") is None and ef.linear == comp.linear and ef.name.startswith("ef-")
    xs = [_x((5, 8), seed=s) for s in range(6)]
    total_sent = torch.zeros(5, 8)
    prev = torch.zeros(5, 8)
    for x in xs:
        p = ef.compress(x, "w")
        sent = ef.decompress(p)
        assert torch.equal(ef.residual("w"), (x + prev) - sent)
        prev = ef.residual("w")
        total_sent += sent
    # nothing is lost, only delayed: everything sent plus what is still held equals everything given
    assert torch.allclose(total_sent + ef.residual("w"), sum(xs), atol=1e-5)


def test_error_feedback_state_is_per_key_and_can_be_reset():
    ef = ErrorFeedback(TopK(k=1))
    ef.compress(torch.tensor([3.0, 1.0, 2.0]), "a")
    ef.compress(torch.tensor([0.0, 5.0]), "b")
    assert ef.residual("a").tolist() == [0.0, 1.0, 2.0]
    assert ef.residual("b").tolist() == [0.0, 0.0]
    assert sorted(ef.keys()) == ["a", "b"]
    # the residual is added on the next call: 2 + 2 = 4 beats 3
    p = ef.compress(torch.tensor([3.0, 0.0, 2.0]), "a")
    assert p.tensors["indices"].tolist() == [2] and p.tensors["values"].tolist() == [4.0]
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.reset()
    assert ef.keys() == []


def test_error_feedback_drops_the_residual_when_shape_or_dtype_changes():
    ef = ErrorFeedback(TopK(k=1))
    ef.compress(torch.tensor([3.0, 1.0, 2.0]), "w")
    # new shape: the old residual no longer lines up, so it is not added
    p = ef.compress(torch.tensor([[0.5], [0.25]]), "w")
    assert p.tensors["values"].tolist() == [0.5]
    assert ef.residual("w").shape == (2, 1)
    # new dtype: dropped as well; bf16 residuals are kept in float32
    p = ef.compress(torch.tensor([[0.0], [0.25]], dtype=torch.bfloat16), "w")
    assert p.tensors["values"].tolist() == [0.25] and p.dtype == torch.bfloat16
    assert ef.residual("w").dtype == torch.float32 and ef.residual("w").tolist() == [[0.0], [0.0]]


def test_error_feedback_keeps_state_on_non_finite_input_and_rejects_integers():
    ef = ErrorFeedback(SignCompressor())
    ef.compress(torch.tensor([1.0, -3.0]), "w")
    before = ef.residual("w").clone()
    with pytest.raises(FloatingPointError):
        ef.compress(torch.tensor([float("nan"), 1.0]), "w")
    assert torch.equal(ef.residual("w"), before)
    with pytest.raises(TypeError, match="floating"):
        ef.compress(torch.tensor([1, 2]), "w")
    with pytest.raises(ValueError, match="compressor"):
        ErrorFeedback(object())


def test_error_feedback_residual_of_low_precision_input_keeps_small_values():
    ef = ErrorFeedback(TopK(k=1))
    x = torch.tensor([1.0, 1e-3], dtype=torch.bfloat16)
    for _ in range(10):
        ef.compress(x, "w")
    # 10 * 1e-3 accumulated in float32, not rounded away in bf16 (bf16 spacing near 1e-2 is ~6e-5)
    assert ef.residual("w")[1].item() == pytest.approx(10 * float(x[1]), rel=1e-3)


# ------------------------------------------------------------------------------------ sparse ring numbers

def test_sparse_ring_fill_in_numbers():
    f = sparse_ring_fill_in(10 ** 6, 10 ** 4, 8)
    # hop 1 carries one rank's share of the chunk: k/n entries
    assert f.reduce_scatter_support[0] == pytest.approx(10 ** 4 / 8)
    assert all(b > a for a, b in zip(f.reduce_scatter_support, f.reduce_scatter_support[1:]))
    assert len(f.reduce_scatter_support) == 7
    assert f.final_support == pytest.approx(10 ** 6 * (1 - 0.99 ** 8))
    assert f.all_gather_support == pytest.approx(f.final_support / 8)
    assert f.all_gather_nbytes_per_rank == 7 * 10 ** 4 * 8
    assert f.dense_ring_nbytes_per_rank == 2 * 7 / 8 * 4e6
    assert f.sparse_ring_nbytes_per_rank == pytest.approx(sum(f.reduce_scatter_nbytes) + 7 * f.all_gather_nbytes)
    # with 1% density and 8 ranks, a correct sparse ring already sends more than all-gathering the payloads
    assert f.sparse_ring_nbytes_per_rank > f.all_gather_nbytes_per_rank
    one = sparse_ring_fill_in(100, 5, 1)
    assert one.reduce_scatter_support == [] and one.sparse_ring_nbytes_per_rank == 0
    for bad in [dict(numel=0, k=1, n=2), dict(numel=10, k=11, n=2), dict(numel=10, k=1, n=0)]:
        with pytest.raises(ValueError):
            sparse_ring_fill_in(**bad)


def test_union_support_of_real_payloads_grows_like_the_formula_for_random_supports():
    numel, k, n = 10000, 100, 8
    payloads = [TopK(k=k).compress(_x((numel,), seed=s)) for s in range(n)]
    sizes = union_support_sizes(payloads)
    assert sizes[0] == k and all(b >= a for a, b in zip(sizes, sizes[1:]))
    for m, size in enumerate(sizes, start=1):
        expected = expected_union_support(numel, k, m)
        # independent random data: Top-K supports behave like random ones; sd of the union < sqrt(expected)
        assert abs(size - expected) <= 6 * math.sqrt(expected)
    # identical supports do not grow at all
    same = [TopK(k=k).compress(_x((numel,), seed=0) * (s + 1)) for s in range(n)]
    assert union_support_sizes(same) == [k] * n
    with pytest.raises(ValueError, match="indices"):
        union_support_sizes([SignCompressor().compress(_x((8,)))])
    with pytest.raises(ValueError, match="shape"):
        union_support_sizes([payloads[0], TopK(k=1).compress(_x((5,)))])


def test_scales_that_float32_cannot_hold_are_refused_not_sent_as_inf():
    import pytest as _pt
    import torch as _t
    from commlab.compress.quantize import QSGD as _Q, RoundingQuantizer as _R
    from commlab.compress.sign import SignCompressor as _S
    with _pt.raises(FloatingPointError, match="does not fit in the float32"):
        _Q().compress(_t.full((4,), 3e38))  # finite entries, but ||v||_2 = 6e38
    assert _t.isfinite(_S().decompress(_S().compress(_t.full((4,), 3e38)))).all()  # mean taken in float64
    with _pt.raises(FloatingPointError, match="does not fit in the float32"):
        _S().compress(_t.tensor([1e300, -1e300], dtype=_t.float64))
    with _pt.raises(FloatingPointError, match="does not fit in the float32"):
        _R(8).compress(_t.tensor([1e300, -1e300, 1.0], dtype=_t.float64))
    with _pt.raises(FloatingPointError, match="does not fit in the float32"):
        _R(8).compress(_t.tensor([1e-300, 0.0], dtype=_t.float64))


def test_random_k_fp16_overflow_on_decompress_is_refused():
    import pytest as _pt
    import torch as _t
    from commlab.compress.sparse import RandomK as _RK
    comp = _RK(ratio=0.01, seed=0)
    with _pt.raises(FloatingPointError, match="overflow"):
        comp.decompress(comp.compress(_t.full((1000,), 700.0, dtype=_t.float16)))
