"""Compressors named by short specs: ``"int:8"``, ``"topk:0.01"``, ``"cast:fp16"``, ...

:func:`parse_spec` splits and validates a spec (the kinds: :data:`METHOD_KINDS`); :func:`compressor_for` builds
the :class:`commlab.compress.base.Compressor` it names. The chapter 8 experiments (:mod:`commlab.experiments.methods`,
which re-exports both) and the outer sync of :mod:`commlab.sync` read the same specs, so a method is written one
way everywhere. Specs live here, in layer 4, so that layer 4 can name compressors without importing the
experiments above it.

Book: chapter 8, §8.2 (the methods compared).
"""

from __future__ import annotations

import torch

from commlab.compress.cast import CastCompressor
from commlab.compress.quantize import QSGD, QSGD_BUCKET_SIZE, RoundingQuantizer
from commlab.compress.sign import SignCompressor
from commlab.compress.sparse import RandomK, TopK

__all__ = ["METHOD_KINDS", "OPTIONAL_ARGUMENT", "parse_spec", "compressor_for", "qsgd_settings"]

#: Spec prefix -> what its argument means.
METHOD_KINDS = {"dense": None, "cast": "fp16 or bf16", "int": "bits (8 or 4)",
                "qsgd": "bits (4 or 8), optionally :all (one bucket) or :D (D entries per norm; default 512)",
                "sign": "tensor (one scale per parameter tensor), or nothing", "topk": "share kept in (0, 1]",
                "randomk": "share kept in (0, 1]", "powersgd": "rank >= 1"}

#: Spec kinds whose argument may be left out.
OPTIONAL_ARGUMENT = ("sign",)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Split ``"kind:arg"`` and validate it: ``("topk", "0.01")``, ``("dense", None)``.

    Raises:
        ValueError: unknown kind, a missing or superfluous argument, an argument out of range, or an argument
            not in its one spelling (``"topk:0.010"``, ``"powersgd:02"``: labels and resume keys use the spec).
    """
    if not isinstance(spec, str):
        raise ValueError(f"a method spec is a string such as 'topk:0.01', got {spec!r}")
    kind, sep, arg = spec.partition(":")
    if sep and not arg:
        raise ValueError(f"method {spec!r} ends with ':' but has no argument")
    if arg != arg.strip():
        raise ValueError(f"method {spec!r}: no spaces around the argument")
    if kind not in METHOD_KINDS:
        raise ValueError(f"unknown method {spec!r}; kinds: {', '.join(_usage(k) for k in METHOD_KINDS)}")
    if kind not in OPTIONAL_ARGUMENT and (METHOD_KINDS[kind] is None) != (arg == ""):
        want = f"{kind}:<{METHOD_KINDS[kind]}>" if METHOD_KINDS[kind] else kind
        raise ValueError(f"method {spec!r} must be written {want}")
    try:
        if kind == "cast" and arg not in ("fp16", "bf16"):
            raise ValueError
        if kind == "int" and arg not in ("8", "4"):
            raise ValueError
        if kind == "sign" and arg not in ("", "tensor"):
            raise ValueError
        if kind == "qsgd":
            qsgd_settings(arg)
        if kind in ("topk", "randomk") and not 0 < float(arg) <= 1:
            raise ValueError
        if kind == "powersgd" and int(arg) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"method {spec!r}: the argument of {kind} must be {METHOD_KINDS[kind]}") from None
    if kind == "powersgd" and arg != str(int(arg)):
        raise ValueError(f"method {spec!r}: write it 'powersgd:{int(arg)}'")
    if kind in ("topk", "randomk") and arg not in (f"{float(arg):g}", repr(float(arg))):
        raise ValueError(f"method {spec!r}: write it '{kind}:{float(arg):g}'")
    if kind == "qsgd":
        bits, _, bucket = arg.partition(":")
        if bucket not in ("", "all") and (bucket != str(int(bucket)) or int(bucket) == QSGD_BUCKET_SIZE):
            short = f"qsgd:{bits}" if int(bucket) == QSGD_BUCKET_SIZE else f"qsgd:{bits}:{int(bucket)}"
            raise ValueError(f"method {spec!r}: write it '{short}'")
    return kind, arg or None


def _usage(kind: str) -> str:
    """How a kind is written: ``topk:<share kept in (0, 1]>``, ``dense``, ``sign[:<tensor ...>]``."""
    arg = METHOD_KINDS[kind]
    if arg is None:
        return kind
    return f"{kind}[:<{arg}>]" if kind in OPTIONAL_ARGUMENT else f"{kind}:<{arg}>"


def qsgd_settings(arg: str) -> tuple[int, int | None]:
    """``(bits, bucket_size)`` of a ``qsgd`` argument: ``"4"`` (buckets of QSGD's default 512), ``"4:all"`` (one
    bucket, ``None``) or ``"4:D"``. Raises ValueError (caught and reworded by :func:`parse_spec`)."""
    bits, sep, bucket = arg.partition(":")
    if bits not in ("4", "8") or (sep and not bucket):
        raise ValueError(arg)
    if not sep:
        return int(bits), QSGD_BUCKET_SIZE
    if bucket == "all":
        return int(bits), None
    if not bucket.isdigit() or int(bucket) < 1:
        raise ValueError(arg)
    return int(bits), int(bucket)


def compressor_for(spec: str, seed: int = 0):
    """The :class:`commlab.compress.base.Compressor` a method spec names (``"topk:0.01"``, ``"int:8"``, ...), for
    :class:`commlab.compress.CompressionHookState` or :class:`commlab.sync.DiLoCo`; None for ``"dense"`` and
    ``"powersgd:R"``, which are no compressor of that kind (PowerSGD keeps its state in
    :class:`commlab.compress.PowerSGDState`). ``seed`` seeds Random-K's shared indices and QSGD's rounding.

    Raises:
        ValueError: a spec :func:`parse_spec` refuses, or ``"sign:tensor"`` (its segments come from a bucket).
    """
    kind, arg = parse_spec(spec)
    if spec == "sign:tensor":
        raise ValueError("'sign:tensor' takes its segments from each bucket's parameters (Method sets them); "
                         "build SignCompressor(segments=[sizes of the bucket's tensors]) instead")
    return None if kind in ("dense", "powersgd") else build_compressor(kind, arg, seed)


def build_compressor(kind: str, arg: str | None, seed: int):
    """The compressor of a parsed, non-dense, non-PowerSGD spec (``kind, arg`` from :func:`parse_spec`)."""
    if kind == "cast":
        return CastCompressor(torch.float16 if arg == "fp16" else torch.bfloat16)
    if kind == "int":
        return RoundingQuantizer(bits=int(arg))
    if kind == "qsgd":
        bits, bucket_size = qsgd_settings(arg)
        return QSGD(bits=bits, seed=seed, bucket_size=bucket_size)
    if kind == "sign":
        return SignCompressor()  # sign:tensor: Method sets the segments for each bucket
    if kind == "topk":
        return TopK(ratio=float(arg))
    return RandomK(ratio=float(arg), seed=seed)
