"""Grader for lab 5: the learner's QSGD quantizer, 8-bit codes and one norm per tensor (chapter 6, §6.3).

The learner writes a class ``cls(levels, seed)`` following :mod:`commlab.compress.base`'s protocol, with the
payload of ``commlab.compress.QSGD(levels, bits=8, bucket_size=None)``: ``codes``, one int8 ``+-xi_i`` per
element; ``norm``, ``||x||_2`` as one float32; ``meta`` ``{"levels": s, "bits": 8, "bucket_size": None}``.
``xi_i`` rounds ``r_i = s |x_i| / ||x||`` stochastically (Alistarh et al. 2017, §3.1), so that the output
``||x|| sign(x_i) xi_i / s`` is unbiased.

Cases: the payload's form and bytes against commlab's QSGD; the round trip (shape, dtype, allowed levels);
each side decodes the other's payloads; unbiasedness (the mean of many draws within a few standard errors,
from the exact rounding variance); the variance within the paper's bound (Lemma 3.1); an all-zero tensor;
the seed (same seed, same draws). A failure names the input and what is wrong; the reference's output is
not printed.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from commlab.compress import QSGD, Payload, qsgd_variance_bound
from commlab.exercises.report import CheckReport, is_stub_result, raised

__all__ = ["check_qsgd", "QSGD_DRAWS"]

#: Draws of the unbiasedness and variance cases: 2000 draws of 64 elements, about a second.
QSGD_DRAWS = 2000
_LEVELS = 7


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"a 3 x 5 float32 matrix": torch.randn(3, 5, generator=g),
            "a 1-D float32 vector of 101 entries": torch.randn(101, generator=g) * 1e-3,
            "a float64 vector of 8 entries": torch.randn(8, generator=g, dtype=torch.float64)}


def _ratio(x: torch.Tensor, s: int) -> torch.Tensor:
    """r_i = s |x_i| / ||x||, computed with the float32 norm that is sent (as commlab's QSGD does)."""
    norm = torch.linalg.vector_norm(x.reshape(-1).double()).float().double()
    return (s * x.reshape(-1).double().abs() / norm).clamp(max=s)


def _form_problem(p, x: torch.Tensor, s: int) -> str | None:
    if not isinstance(p, Payload):
        return f"compress returned a {type(p).__name__}; return a commlab.compress.Payload"
    if set(p.tensors) != {"codes", "norm"}:
        return f"the payload's tensors are {sorted(p.tensors)}; send exactly 'codes' and 'norm'"
    codes, norm = p.tensors["codes"], p.tensors["norm"]
    if codes.dtype != torch.int8:
        return (f"codes are {str(codes.dtype).replace('torch.', '')}: one int8 per element holds a sign and a "
                f"level 0..s (s <= 127)")
    if codes.numel() != x.numel():
        return f"codes hold {codes.numel()} values for {x.numel()} elements: one code per element"
    if norm.dtype != torch.float32 or norm.numel() != 1:
        return (f"norm is {norm.numel()} value(s) of {str(norm.dtype).replace('torch.', '')}: send ||x||_2 as one "
                "float32")
    if tuple(p.shape) != tuple(x.shape) or p.dtype != x.dtype:
        return "the payload's shape and dtype must be the input's, so the receiver can rebuild it"
    if p.meta.get("levels") != s or p.meta.get("bits") != 8 or "bucket_size" not in p.meta \
            or p.meta["bucket_size"] is not None:
        return f"meta is {p.meta!r}; the receiver needs {{'levels': s, 'bits': 8, 'bucket_size': None}}"
    return None


def _levels_problem(p, x: torch.Tensor, s: int) -> str | None:
    codes = p.tensors["codes"].reshape(-1).to(torch.int64)
    flat = x.reshape(-1)
    r = _ratio(x, s)
    low = r.floor().to(torch.int64)
    level = codes.abs()
    bad = ((level != low) & (level != low + 1)) | ((level > 0) & ((codes < 0) != (flat < 0)))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        if level[i] > 0 and (codes[i] < 0) != (flat[i] < 0):
            return f"element {i} is {float(flat[i]):.4g} but its code {int(codes[i])} has the other sign"
        return (f"element {i}: level {int(level[i])}, but s |x_i| / ||x|| = {float(r[i]):.4f}; the level is its "
                "floor or the floor + 1")
    norm = float(torch.linalg.vector_norm(flat.double()))
    if not math.isclose(float(p.tensors["norm"]), norm, rel_tol=1e-6):
        return f"norm is {float(p.tensors['norm']):.6g}, not the Euclidean norm ||x||_2 of the tensor"
    return None


def check_qsgd(cls: Callable, levels: int = _LEVELS) -> CheckReport:
    """Grade a QSGD class ``cls(levels, seed)`` (8-bit codes, one norm per tensor)."""
    report = CheckReport(f"QSGD exercise ({getattr(cls, '__name__', 'cls')})")
    s = levels
    ref = QSGD(levels=s, bits=8, seed=0, bucket_size=None)
    inputs = _inputs()

    desc = "protocol: name, linear = False (each rank has its own norm)"
    try:
        q = cls(s, 0)
        first = q.compress(next(iter(inputs.values())).clone())
    except Exception as e:  # the learner's code: report any error as a failed case
        report.cases.append((desc, False, f"cls({s}, 0).compress {raised(e)}"))
        return report
    if is_stub_result(first):
        report.not_attempted = f"{getattr(cls, '__name__', 'cls')}.compress"
        return report
    ok = isinstance(getattr(q, "name", None), str) and getattr(q, "linear", None) is False
    report.cases.append((desc, ok, "" if ok else "set a `name` (a str) and `linear = False`: two ranks' codes "
                         "with different norms cannot be added"))

    for label, x in inputs.items():
        desc = f"{label}: payload form and bytes (those of commlab's QSGD), levels, round trip"
        try:
            p = cls(s, 0).compress(x.clone())
            problem = _form_problem(p, x, s)
            if problem is None and p.nbytes != ref.compress(x).nbytes:
                problem = f"the payload is {p.nbytes} bytes; one int8 per element and a float32 norm are fewer"
            problem = problem or _levels_problem(p, x, s)
            if problem is None:
                out = cls(s, 0).decompress(p)
                if out is None:
                    problem = "decompress returned None"
                elif not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
                    problem = (f"decompress returned {getattr(out, 'shape', type(out).__name__)} "
                               f"{getattr(out, 'dtype', '')}; rebuild the input's shape and dtype")
                elif not torch.allclose(out, ref.decompress(p), rtol=1e-6, atol=0):
                    problem = "decompress does not give ||x|| * code / s for this payload"
                elif not torch.allclose(cls(s, 0).decompress(rp := ref.compress(x)), ref.decompress(rp),
                                        rtol=1e-6, atol=0):
                    problem = "decompress of commlab's QSGD payload for the same input gives other values"
        except Exception as e:
            problem = raised(e)
        report.cases.append((desc, problem is None, problem or ""))

    x = torch.randn(64, generator=torch.Generator().manual_seed(12))
    desc = f"unbiased: the mean of {QSGD_DRAWS} draws is x, within 5 standard errors"
    try:
        q = cls(s, 1)
        draws = torch.stack([q.decompress(q.compress(x)).double() for _ in range(QSGD_DRAWS)])
        r = _ratio(x, s)
        frac = r - r.floor()
        unit = float(torch.linalg.vector_norm(x.double())) / s
        se = unit * (frac * (1 - frac) / QSGD_DRAWS).sqrt()
        dev = (draws.mean(0) - x.double()).abs()
        z = torch.where(se > 0, dev / se.clamp(min=1e-300), dev / (unit * 1e-9))
        if bool((z < 5).all()):
            report.cases.append((desc, True, ""))
        else:
            i = int(z.argmax())
            report.cases.append((desc, False, f"element {i}: the mean of the draws is off by {float(z[i]):.1f} "
                                 "standard errors: round up with probability r - floor(r), using fresh uniforms "
                                 "from the compressor's generator at every call"))
        desc = "variance within QSGD's bound min(n/s^2, sqrt(n)/s) ||x||^2 (Lemma 3.1)"
        var = float(((draws - x.double()) ** 2).sum(1).mean())
        bound = qsgd_variance_bound(x.numel(), s, None) * float(x.double().pow(2).sum())
        report.cases.append((desc, var <= bound, "" if var <= bound else
                             f"E||Q(x) - x||^2 = {var:.4g} is above the bound {bound:.4g}"))
    except Exception as e:
        report.cases.append((desc, False, raised(e)))

    desc = "an all-zero tensor gives zeros (no division by a zero norm)"
    try:
        z0 = torch.zeros(6)
        q = cls(s, 0)
        out = q.decompress(q.compress(z0))
        ok = isinstance(out, torch.Tensor) and bool(torch.equal(out, z0))
        report.cases.append((desc, ok, "" if ok else "the output is not all zeros (NaN from 0 / 0?): treat a zero "
                             "norm as a tensor of zero levels"))
    except Exception as e:
        report.cases.append((desc, False, raised(e)))

    desc = "the seed: the same seed gives the same draws, another seed others"
    try:
        a, b, c = (cls(s, seed).compress(x).tensors["codes"] for seed in (3, 3, 4))
        ok = torch.equal(a, b) and not torch.equal(a, c)
        if ok:
            msg = ""
        elif torch.equal(a, b):
            msg = "seeds 3 and 4 give the same codes: the rounding must be random, drawn from the seeded generator"
        else:
            msg = ("two compressors with seed 3 give different codes: draw the uniforms from a torch.Generator "
                   "seeded with `seed` (one per compressor), not from the global generator")
        report.cases.append((desc, ok, msg))
    except Exception as e:
        report.cases.append((desc, False, raised(e)))
    return report
