"""Which chunk moves where at each step of a ring ReduceScatter + AllGather.

The figure is computed by replaying the schedule functions of :mod:`commlab.collectives.ring` (the ones
the real collective runs), so the picture cannot drift from the code.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from commlab.collectives.ring import (all_gather_recv_chunk, all_gather_send_chunk,
                                      reduce_scatter_recv_chunk, reduce_scatter_send_chunk)


def ring_states(n: int) -> list[dict]:
    """Replay a ring AllReduce on ``n`` ranks symbolically.

    Returns:
        A list with one entry per state (the initial one, then after each of the 2(n-1) steps): a dict
        with ``"phase"`` (``"start"``, ``"reduce-scatter"`` or ``"all-gather"``), ``"step"``, ``"sends"``
        (list of ``(rank, chunk)`` sent in that step) and ``"contrib"``, an (n, n) int array whose entry
        [r, c] counts how many ranks' data chunk c on rank r already contains (n = complete).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    # contrib[r, c] as a set of source ranks, so the count proves each chunk sums every rank exactly once.
    have = [[{r} for _ in range(n)] for r in range(n)]
    states = [{"phase": "start", "step": 0, "sends": [], "contrib": _counts(have)}]
    for step in range(n - 1):
        sends = [(p, reduce_scatter_send_chunk(p, step, n)) for p in range(n)]
        payload = {p: set(have[p][c]) for p, c in sends}
        for p in range(n):
            c = reduce_scatter_recv_chunk(p, step, n)
            incoming = payload[(p - 1) % n]
            if have[p][c] & incoming:
                raise AssertionError(f"rank {p} would add a contribution twice at step {step}")
            have[p][c] = have[p][c] | incoming
        states.append({"phase": "reduce-scatter", "step": step + 1, "sends": sends, "contrib": _counts(have)})
    for step in range(n - 1):
        sends = [(p, all_gather_send_chunk(p, step, n)) for p in range(n)]
        payload = {p: set(have[p][c]) for p, c in sends}
        for p in range(n):
            have[p][all_gather_recv_chunk(p, step, n)] = payload[(p - 1) % n]
        states.append({"phase": "all-gather", "step": step + 1, "sends": sends, "contrib": _counts(have)})
    return states


def _counts(have) -> np.ndarray:
    return np.array([[len(s) for s in row] for row in have], dtype=int)


def plot_ring_schedule(n: int = 4, ncols: int = 4, ax_width: float = 1.7):
    """Draw every state of a ring AllReduce on ``n`` ranks as a grid of panels; returns the Figure.

    Each panel is one state: rows are ranks, columns are chunks; the number in a cell is how many
    ranks' data that chunk holds (darker = more), an outlined cell is the chunk that rank sends to its
    successor in the next step. ``ncols`` panels per row of ``ax_width`` inches each keep the numbers at
    9 pt at a 688 px text column (4 x 1.7 in); ``fig.axes[i]`` is state i.
    """
    import math

    import matplotlib.pyplot as plt

    states = ring_states(n)
    rows = math.ceil(len(states) / ncols)
    fig, axes = plt.subplots(rows, ncols, figsize=(ax_width * ncols, ax_width * 1.3 * rows + 0.5),
                             squeeze=False)
    for ax in axes.flat[len(states):]:
        fig.delaxes(ax)  # the grid's unused cells: fig.axes holds exactly one panel per state
    for i, (ax, st) in enumerate(zip(axes.flat, states)):
        ax.imshow(st["contrib"], cmap="Blues", vmin=0, vmax=n + 1)
        for r in range(n):
            for c in range(n):
                ax.text(c, r, str(st["contrib"][r, c]), ha="center", va="center", fontsize=9,
                        color="white" if st["contrib"][r, c] > n / 2 + 0.5 else "black")
        nxt = states[i + 1]["sends"] if i + 1 < len(states) else []
        for r, c in nxt:
            ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="tab:red", lw=2))
        title = "start" if st["phase"] == "start" else f"{st['phase']}\nafter step {st['step']}"
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_xticklabels([f"c{c}" for c in range(n)], fontsize=9)
        ax.set_yticklabels([f"rank {r}" for r in range(n)] if i % ncols == 0 else [], fontsize=9)
    fig.suptitle(f"Ring AllReduce on {n} ranks: number = contributions summed into the chunk;\n"
                 "red outline = chunk sent in the next step", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bench(rows: Sequence, title: str = "AllReduce on gloo"):
    """Time and busbw against message size for ours and torch's (rows from ``commlab.bench``)."""
    import matplotlib.pyplot as plt

    sizes = [r.nbytes for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.loglog(sizes, [r.ours_s * 1e3 for r in rows], "o-", label="ring (ours)")
    a.loglog(sizes, [r.torch_s * 1e3 for r in rows], "s--", label="dist.all_reduce")
    a.set_xlabel("message size (bytes)")
    a.set_ylabel("time (ms)")
    b.semilogx(sizes, [r.ours_busbw / 1e9 for r in rows], "o-", label="ring (ours)")
    b.semilogx(sizes, [r.torch_busbw / 1e9 for r in rows], "s--", label="dist.all_reduce")
    b.set_xlabel("message size (bytes)")
    b.set_ylabel("busbw (GB/s)")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def bench_table(rows: Sequence):
    """The rows of ``commlab.bench.bench_all_reduce`` as a rendered table (a :class:`~commlab.viz.text.Table`):
    size, the busbw (GB/s, nccl-tests' definition) of ours and of ``dist.all_reduce``, their ratio (> 1: ours
    is faster) and the elements that differ from torch's result. Five columns, so that each header fits its
    column in the book's text column (the times are in :func:`plot_bench`'s figure; the benchmark's printed
    table, :func:`commlab.bench.format_table`, has everything but is 120 characters wide).
    """
    from commlab.viz.text import markdown_table
    from commlab.widgets.calculator import format_bytes

    header = ["size", "ours: busbw (GB/s)", "torch: busbw (GB/s)", "ours / torch", "wrong"]
    body = [[format_bytes(r.nbytes), f"{r.ours_busbw / 1e9:.3f}", f"{r.torch_busbw / 1e9:.3f}", f"{r.ratio:.2f}",
             r.wrong] for r in rows]
    return markdown_table(header, body, align="rrrrr")
