"""PowerSGD's two AllReduces for one matrix: the shapes each step produces and the bytes each AllReduce carries.

The shapes come from :func:`commlab.compress.powersgd.compressed_shape` (the rule the compressor applies) and
the bytes from :func:`commlab.compress.powersgd.powersgd_nbytes` (what one rank puts into each collective),
so the figure shows what :func:`commlab.compress.powersgd_all_reduce` does (Vogels et al. 2019, Algorithm 1,
with Algorithm 2's error feedback).
"""

from __future__ import annotations

from typing import Sequence

import torch

from commlab.compress.powersgd import compressed_shape, powersgd_nbytes

__all__ = ["powersgd_steps", "plot_powersgd_round"]


def powersgd_steps(shape: Sequence[int], r: int, min_compression_rate: float = 2) -> list[dict]:
    """The steps of one PowerSGD round on one rank for a gradient of ``shape`` at approximation rank ``r``.

    Returns:
        One dict per step, in order: ``{"label": str, "shape": (rows, cols) or None, "all_reduce": bool,
        "nbytes": int}``; ``nbytes`` is what this rank contributes to that AllReduce (float32 P or Q), 0 for a
        local step.

    Raises:
        ValueError: a tensor that PowerSGD sends uncompressed at this ``r`` (one dimension, or
            ``(m + n) r · min_compression_rate >= m n``): there would be nothing to draw.
    """
    layout = compressed_shape(tuple(shape), r, min_compression_rate)
    if layout is None:
        raise ValueError(f"a tensor of shape {tuple(shape)} is sent uncompressed at approximation rank r={r} "
                         f"(min_compression_rate {min_compression_rate}); choose a 2-D shape with "
                         "(m + n) r · rate < m n")
    m, n, rr = layout
    b = powersgd_nbytes([torch.empty(tuple(shape), device="meta")], rank=r,
                        min_compression_rate=min_compression_rate)
    return [
        dict(label="M_w = G_w + E_w", shape=(m, n), all_reduce=False, nbytes=0),
        dict(label="P_w = M_w Q", shape=(m, rr), all_reduce=False, nbytes=0),
        dict(label="AllReduce P", shape=(m, rr), all_reduce=True, nbytes=b.p_nbytes),
        dict(label="orthogonalise P", shape=(m, rr), all_reduce=False, nbytes=0),
        dict(label="Q_w = M_wᵀ P̂", shape=(n, rr), all_reduce=False, nbytes=0),
        dict(label="AllReduce Q", shape=(n, rr), all_reduce=True, nbytes=b.q_nbytes),
        dict(label="M̃ = P̂ Qᵀ / N", shape=(m, n), all_reduce=False, nbytes=0),
    ]


def plot_powersgd_round(shape: Sequence[int] = (128, 128), r: int = 2, N: int = 4):
    """Draw one PowerSGD round for one matrix on ``N`` ranks; returns the matplotlib Figure.

    Left to right: the matrix ``M_w`` of each rank, ``P_w = M_w Q``, the AllReduce of P, orthogonalisation,
    ``Q_w = M_wᵀ P̂``, the AllReduce of Q, and the approximation of the average. Matrices are drawn to scale
    (rows down, columns across, the thin factors widened to stay visible); each AllReduce box gives the bytes
    one rank contributes and the dense bytes it replaces.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    steps = powersgd_steps(shape, r)
    m, n = steps[0]["shape"]
    dense = powersgd_nbytes([torch.empty(tuple(shape), device="meta")], rank=r).dense_nbytes
    fig, ax = plt.subplots(figsize=(7.2, 3.1))
    ax.axis("off")
    scale = 1.0 / max(m, n)
    slot = 1.0  # every step gets the same width, so that labels never collide
    for i, s in enumerate(steps):
        rows, cols = s["shape"]
        cx = i * slot + slot / 2
        label_y = 0.62 if i % 2 == 0 else 0.8
        if s["all_reduce"]:
            ax.add_patch(FancyBboxPatch((cx - 0.42, -0.4), 0.84, 0.8, boxstyle="round,pad=0.03",
                                        facecolor="#fdd49e", edgecolor="tab:red", lw=1.2))
            ax.text(cx, 0.14, s["label"].replace(" ", "\n"), ha="center", va="center", fontsize=9, weight="bold")
            ax.text(cx, -0.2, f"{s['nbytes']:,} B\nper rank", ha="center", va="center", fontsize=8.5)
            continue
        h, w = rows * scale, max(cols * scale, 0.06)
        w = min(w, 0.7)
        stack = N if i == 0 or s["label"].startswith(("P_w", "Q_w")) else 1
        for k in range(min(stack, 3)):
            off = 0.04 * k
            ax.add_patch(Rectangle((cx - w / 2 + off, -h / 2 - off), w, h,
                                   facecolor="#c6dbef" if stack > 1 else "#a1d99b", edgecolor="black", lw=0.6))
        ax.text(cx, label_y, s["label"], ha="center", va="bottom", fontsize=8.5)
        ax.plot([cx, cx], [h / 2 + 0.02, label_y - 0.02], color="lightgrey", lw=0.6)
        ax.text(cx, -0.62, f"{rows}×{cols}", ha="center", va="top", fontsize=8.5)
    for i in range(len(steps) - 1):
        ax.annotate("", xy=((i + 1) * slot + 0.08, -0.45), xytext=(i * slot + slot - 0.08, -0.45),
                    arrowprops=dict(arrowstyle="->", lw=0.8, color="grey"))
    ax.set_xlim(0, len(steps) * slot)
    ax.set_ylim(-1.05, 1.05)
    total = sum(s["nbytes"] for s in steps)
    ax.set_title(f"One PowerSGD round: {m}×{n} float32 gradient, approximation rank r = {r}, N = {N} ranks\n"
                 f"{total:,} B per rank in two AllReduces instead of {dense:,} B dense", fontsize=9)
    ax.text(0.02, -0.98, "blue: differs per rank (one per rank, stacked); green: the same on every rank",
            fontsize=8.5, ha="left")
    fig.tight_layout()
    return fig
