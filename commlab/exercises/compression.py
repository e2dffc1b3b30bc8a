"""Grader for lab 4: the learner's error-feedback wrapper around a compressor.

The learner writes a class ``cls(compressor)`` with ``compress(tensor, key) -> Payload`` and
``decompress(payload)``, keeping one residual per key (the interface of
:class:`commlab.compress.ErrorFeedback`). Each case runs it on fixed tensors and compares with what error
feedback must do, ``p = C(x + e); e' = x + e - D(p)``, explaining the first difference it finds.
"""

from __future__ import annotations

from typing import Callable

import torch

from commlab.compress import SignCompressor, TopK
from commlab.exercises.report import CheckReport, raised

__all__ = ["check_error_feedback"]


def _grads(steps: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(steps)]


def _reference(compressor, grads):
    """Decompressed payloads sent and the final residual, computed directly from the definition."""
    e = torch.zeros_like(grads[0])
    sent = []
    for x in grads:
        corrected = x + e
        d = compressor.decompress(compressor.compress(corrected))
        e = corrected - d
        sent.append(d)
    return sent, e


def _diagnose(compressor, grads, got_sent) -> str:
    """Name the likely mistake behind a wrong payload at some step."""
    plain = [compressor.decompress(compressor.compress(x)) for x in grads]
    if all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got_sent, plain)):
        return "every step sent C(x) of the new gradient alone: the residual is never added back"
    return ("the payloads differ from C(x + e) with e = (x + e) - D(C(x + e)) of the step before; check that the "
            "residual is what was *not* sent (corrected minus decompressed), not the sent part, and that it is "
            "updated after every call")


def check_error_feedback(cls: Callable, steps: int = 5, numel: int = 40) -> CheckReport:
    """Grade an error-feedback class ``cls(compressor)`` with ``compress(tensor, key)`` and ``decompress``.

    Cases: Top-K and sign over ``steps`` calls (payloads equal to the definition's); nothing is lost
    (sum of sent + residual = sum of inputs); two keys keep separate residuals; the input tensor is not
    modified in place.
    """
    report = CheckReport(f"error feedback exercise ({getattr(cls, '__name__', 'cls')})")

    for comp, label in ((TopK(k=4), "Top-K (k=4)"), (SignCompressor(), "scaled sign")):
        desc = f"{label}: {steps} steps match p = C(x + e), e = x + e - D(p)"
        grads = _grads(steps, numel, seed=3)
        try:
            ef = cls(comp)
            got = []
            for x in grads:
                p = ef.compress(x.clone(), "w")
                if p is None and not report.cases and not got:
                    # The stub's None on the very first call: unfilled, say so in one line.
                    report.not_attempted = f"{getattr(cls, '__name__', 'cls')}.compress"
                    return report
                if p is None:
                    raise ValueError("compress returned None: return the payload of the corrected tensor")
                got.append(ef.decompress(p).reshape(-1))
        except Exception as e:  # report, do not crash the notebook
            report.cases.append((desc, False, raised(e)))
            continue
        want, _ = _reference(comp, grads)
        bad = [t for t, (a, b) in enumerate(zip(got, want)) if a.shape != b.shape or not torch.allclose(a, b, atol=1e-5)]
        if not bad:
            report.cases.append((desc, True, ""))
        elif bad[0] == 0:
            report.cases.append((desc, False, "step 0 (zero residual) should send exactly C(x); "
                                 "it sent something else"))
        else:
            report.cases.append((desc, False, f"step {bad[0]} is wrong: " + _diagnose(comp, grads, got)))

    desc = "nothing is lost: sum of sent + residual = sum of inputs"
    grads = _grads(steps, numel, seed=5)
    comp = TopK(k=3)
    try:
        ef = cls(comp)
        total_sent = sum(ef.decompress(ef.compress(x.clone(), "w")).reshape(-1) for x in grads)
        _, residual = _reference(comp, grads)
        ok = torch.allclose(total_sent + residual, sum(grads), atol=1e-5)
        report.cases.append((desc, ok, "" if ok else "what was sent plus the residual differs from the sum of the "
                             "gradients: some part of a gradient was dropped or counted twice"))
    except Exception as e:
        report.cases.append((desc, False, raised(e)))

    desc = "two keys keep separate residuals"
    a, b = _grads(2, numel, seed=7), _grads(2, numel, seed=8)
    comp = TopK(k=3)
    try:
        ef = cls(comp)
        got = []
        for t in range(2):  # interleave the keys, as layers of one model are
            got.append(ef.decompress(ef.compress(a[t].clone(), "layer1")).reshape(-1))
            ef.compress(b[t].clone(), "layer2")
        want, _ = _reference(comp, a)
        ok = torch.allclose(got[1], want[1], atol=1e-5)
        if ok:
            msg = ""
        elif torch.allclose(got[1], comp.decompress(comp.compress(a[1])), atol=1e-5):
            msg = "the second call for key 'layer1' added no residual at all"
        else:
            msg = ("the second call for key 'layer1' used another key's residual: keep a dict key -> residual "
                   "(one shared residual mixes layers)")
        report.cases.append((desc, ok, msg))
    except Exception as e:
        report.cases.append((desc, False, raised(e)))

    desc = "the input tensor is left unchanged"
    try:
        ef = cls(TopK(k=3))
        xs = _grads(2, numel, seed=9)
        copies = [x.clone() for x in xs]
        for x in xs:
            ef.compress(x, "w")
        ok = all(torch.equal(x, c) for x, c in zip(xs, copies))
        report.cases.append((desc, ok, "" if ok else "compress modified its input in place (e.g. x += residual); "
                             "the caller still owns that tensor: work on a copy"))
    except Exception as e:
        report.cases.append((desc, False, raised(e)))
    return report
