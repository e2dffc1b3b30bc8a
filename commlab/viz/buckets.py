"""Buckets filling in backward order, and their AllReduces overlapping backward.

Two pictures of chapter 9, each computed by the functions the chapter teaches:

* which bucket each parameter tensor falls into, taken in *reverse* registration order (the order backward
  produces the gradients), from :func:`commlab.overlap.assign_buckets`;
* when each bucket is complete and when its AllReduce runs, from
  :func:`commlab.overlap.model.bucketed_allreduce_schedule`. That function returns only the totals; the end of
  bucket ``k`` is the end of the same schedule cut after ``k`` buckets (gradient produced at the same steady
  rate), so :func:`bucket_bars` replays it prefix by prefix rather than re-implementing it.
"""

from __future__ import annotations

from typing import Callable, Sequence

from commlab.overlap import assign_buckets
from commlab.overlap.model import bucketed_allreduce_schedule

__all__ = ["bucket_bars", "plot_bucket_overlap"]


def bucket_bars(grad_nbytes: float, backward_s: float, bucket_cap_bytes: float,
                allreduce_seconds: Callable[[float], float]) -> list[dict]:
    """Per-bucket times of :func:`bucketed_allreduce_schedule` (seconds from the start of backward).

    Returns:
        One dict per bucket, in launch order: ``{"nbytes", "ready_s", "start_s", "end_s"}``: when backward has
        produced its last byte, when its AllReduce starts (ready *and* the previous one done) and ends. The
        last ``end_s`` equals the schedule's ``end_s``.

    Raises:
        ValueError: what :func:`bucketed_allreduce_schedule` rejects.
    """
    total = bucketed_allreduce_schedule(grad_nbytes, backward_s, bucket_cap_bytes, allreduce_seconds)
    bars, produced = [], 0.0
    for _ in range(total.buckets):
        size = min(bucket_cap_bytes, grad_nbytes - produced)
        produced += size
        prefix = bucketed_allreduce_schedule(produced, backward_s * produced / grad_nbytes, bucket_cap_bytes,
                                             allreduce_seconds)
        end = prefix.end_s
        bars.append(dict(nbytes=size, ready_s=backward_s * produced / grad_nbytes,
                         start_s=end - allreduce_seconds(size), end_s=end))
    return bars


def plot_bucket_overlap(tensor_nbytes: Sequence[int], tensor_names: Sequence[str], bucket_cap_bytes: int,
                        backward_s: float, allreduce_seconds: Callable[[float], float],
                        compare_cap_bytes: float | None = None, unit: str = "ms"):
    """Draw the bucket assignment of ``tensor_nbytes`` (in backward order) and the overlap timeline.

    Top: one box per tensor, in the order backward produces them, width proportional to bytes, coloured by
    bucket (``assign_buckets(tensor_nbytes, bucket_cap_bytes)``). Below: for ``bucket_cap_bytes`` (and
    ``compare_cap_bytes``, e.g. one bucket for everything), the backward bar with each bucket's share, and each
    bucket's AllReduce from its start to its end; what lies right of backward's end is exposed. Every
    AllReduce bar carries the gid ``"allreduce:<cap>:<k>"`` so tests can read the picture back.

    Args:
        tensor_nbytes, tensor_names: the gradients in backward order (reverse registration order).
        bucket_cap_bytes: the cap, in bytes.
        backward_s: backward's compute time, in seconds.
        allreduce_seconds: the seconds of one bucket's AllReduce, given its bytes.
        compare_cap_bytes: a second cap to draw below the first (None: none).
        unit: ``"ms"`` or ``"s"`` for the time axis.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    scale = {"ms": 1e3, "s": 1.0}[unit]
    groups = assign_buckets(list(tensor_nbytes), bucket_cap_bytes)
    cmap = plt.get_cmap("tab10")
    caps = [bucket_cap_bytes] + ([compare_cap_bytes] if compare_cap_bytes is not None else [])
    fig, axes = plt.subplots(1 + len(caps), 1, figsize=(7.2, 1.3 + 1.55 * len(caps)),
                             gridspec_kw={"height_ratios": [0.8] + [1.2] * len(caps)})
    ax = axes[0]
    total = float(sum(tensor_nbytes))
    x = 0.0
    for k, g in enumerate(groups):
        for i in g:
            w = tensor_nbytes[i] / total
            ax.add_patch(Rectangle((x, 0), w, 1, facecolor=cmap(k % 10), edgecolor="white", lw=1))
            if w > 0.07:
                ax.text(x + w / 2, 0.5, tensor_names[i], ha="center", va="center", fontsize=8)
            x += w
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xticks([])
    ax.set_title(f"gradients in backward order (last layer first), one colour per bucket\n"
                 f"cap {bucket_cap_bytes / 2**20:g} MiB: {len(groups)} buckets; width ∝ bytes",
                 fontsize=9, loc="left")
    for ax, cap in zip(axes[1:], caps):
        bars = bucket_bars(total, backward_s, cap, allreduce_seconds)
        prev = 0.0
        for k, b in enumerate(bars):
            ax.add_patch(Rectangle((prev * scale, 1.1), (b["ready_s"] - prev) * scale, 0.8,
                                   facecolor=cmap(k % 10), edgecolor="white", lw=0.5, alpha=0.55))
            bar = Rectangle((b["start_s"] * scale, 0.1), (b["end_s"] - b["start_s"]) * scale, 0.8,
                            facecolor=cmap(k % 10), edgecolor="black", lw=0.5)
            bar.set_gid(f"allreduce:{cap}:{k}")
            ax.add_patch(bar)
            prev = b["ready_s"]
        end = max(bars[-1]["end_s"], backward_s)
        ax.axvline(backward_s * scale, color="black", lw=1, ls="--")
        exposed = max(0.0, bars[-1]["end_s"] - backward_s)
        ax.text(backward_s * scale, 2.0, f"backward ends; exposed {exposed * scale:.3g} {unit} ", fontsize=8.5,
                va="bottom", ha="right")
        ax.set_xlim(0, end * scale * 1.02)
        ax.set_ylim(0, 2.5)
        ax.set_yticks([0.5, 1.5])
        ax.set_yticklabels(["AllReduce", "backward"], fontsize=8.5)
        label = "one bucket" if cap >= total else f"cap {cap / 2**20:g} MiB"
        ax.set_title(f"{label}: {len(bars)} bucket{'s' if len(bars) > 1 else ''}", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8.5)
    axes[-1].set_xlabel(f"time from the start of backward ({unit})", fontsize=9)
    fig.tight_layout()
    return fig
