"""A 3D-parallelism planner explorer: pick a model, a cluster preset and a GPU count, see the top layouts.

Three layers, as in :mod:`commlab.widgets.calculator`:

* :func:`plan_rows` and :func:`table_text` / :func:`table_html` -- pure: the top-k layouts of
  :func:`commlab.parallel.planner.search` as plain dicts (times in seconds, memory in GB = 1e9 bytes,
  throughput in tokens/s and model TFLOP/s per GPU) and their tables;
* :func:`explorer` -- the ipywidgets front end (model and preset dropdowns, GPU count, global batch,
  compute model and achievable fraction, top-k), redrawn on every change;
* :func:`static_figure` -- the same information as a matplotlib Figure for the online book: each top
  layout's step time split into :data:`TERMS` (compute, loss, the slowdown of compute beside hidden
  communication, TP, PP, bubble, exposed DP, the optimizer step), with its memory per GPU.
"""

from __future__ import annotations

import html
from typing import Sequence

from commlab import checks
from commlab.parallel.planner import AUTO, DEFAULT_ACHIEVABLE_FRACTION, list_models, load_model, search
from commlab.topology import list_presets

__all__ = ["TERMS", "plan_rows", "table_text", "table_html", "static_figure", "explorer"]

#: The step-time terms, in the order they are stacked: (key of a row, label).
TERMS: tuple[tuple[str, str], ...] = (("compute_s", "compute"), ("loss_s", "loss (cross-entropy)"),
                                      ("slowdown_s", "compute slowed by overlap"), ("tp_s", "TP AllReduce"),
                                      ("pp_s", "PP send/recv"), ("bubble_s", "pipeline bubble"),
                                      ("dp_s", "DP AllReduce (exposed)"), ("optimizer_s", "optimizer step"))


def plan_rows(model: str = "llama3-405b", preset: str = "dgx-h100-ndr", gpus: int = 16384,
              global_batch: int = 2048, top_k: int = 5,
              achievable_fraction: float | str = AUTO) -> tuple[list[dict], dict]:
    """The ``top_k`` fastest layouts that fit, and a summary.

    Returns:
        ``(rows, summary)``: rows as :meth:`commlab.parallel.planner.Plan.row` (seconds, GB, tokens/s,
        TFLOP/s per GPU); summary with ``candidates``, ``fit``, ``rejected_for_memory``, ``rejected_batch``,
        ``rejected_heads`` (tp not dividing the attention heads),
        ``elapsed_s``, ``params`` (the model's parameter count) and ``compute_model`` (``"kernels"`` or the
        share of peak that priced compute: the default ``"auto"`` is the kernel model where the preset's GPU
        has it, else 0.5).

    Raises:
        KeyError: unknown model or preset. ValueError: ``gpus`` not a multiple of devices per node,
            ``top_k < 1``, a bad batch.
    """
    checks.integer("top_k", top_k)
    m = load_model(model)
    result = search(m, preset, gpus, global_batch, achievable_fraction=achievable_fraction)
    summary = {"candidates": result.candidates, "fit": len(result.plans),
               "rejected_for_memory": result.rejected_for_memory,
               "rejected_batch": sum(r.kind == "batch" for r in result.rejected),
               "rejected_heads": sum(r.kind == "heads" for r in result.rejected),
               "elapsed_s": result.elapsed_s, "params": m.params, "compute_model": result.compute_model}
    return [p.row() for p in result.plans[:top_k]], summary


_COLUMNS = (("layout", "layout", "{}"), ("step_s", "step (s)", "{:.3f}"), ("compute_s", "compute", "{:.3f}"),
            ("loss_s", "loss", "{:.3f}"), ("tp_s", "TP", "{:.3f}"), ("pp_s", "PP", "{:.3f}"), ("bubble_s", "bubble", "{:.3f}"),
            ("dp_s", "DP", "{:.3f}"), ("slowdown_s", "slowed", "{:.3f}"), ("optimizer_s", "optimizer", "{:.3f}"),
            ("memory_gb", "GB/GPU", "{:.1f}"), ("tokens_per_s", "tokens/s", "{:.4g}"),
            ("tflops_per_gpu", "TFLOP/s/GPU", "{:.0f}"))


def table_text(rows: Sequence[dict]) -> str:
    """The rows as a fixed-width text table."""
    cells = [[c[1] for c in _COLUMNS]] + [[fmt.format(r[k]) for k, _, fmt in _COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def table_html(rows: Sequence[dict], caption: str = "") -> str:
    """The rows as an HTML table, the fastest (first) row in bold."""
    head = "".join(f"<th>{html.escape(c[1])}</th>" for c in _COLUMNS)
    body = []
    for i, r in enumerate(rows):
        style = ' style="font-weight:bold"' if i == 0 else ""
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(fmt.format(r[k]))}</td>" for k, _, fmt in _COLUMNS)
                    + "</tr>")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{cap}<tr>{head}</tr>{''.join(body)}</table>"


def static_figure(model: str = "llama3-405b", preset: str = "dgx-h100-ndr", gpus: int = 16384,
                  global_batch: int = 2048, top_k: int = 5,
                  achievable_fraction: float | str = AUTO):
    """The top layouts as a matplotlib Figure: horizontal bars of step time (s) split into :data:`TERMS`,
    each labelled with memory per GPU (GB) and model TFLOP/s per GPU.

    Raises:
        as :func:`plan_rows`; ValueError also when no layout fits.
    """
    import matplotlib.pyplot as plt

    rows, summary = plan_rows(model, preset, gpus, global_batch, top_k, achievable_fraction)
    if not rows:
        raise ValueError(f"no layout of {model} fits on {gpus} GPUs of {preset} "
                         f"({summary['rejected_for_memory']} rejected for memory)")
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.6))
    left = [0.0] * len(rows)
    for i, (key, label) in enumerate(TERMS):
        vals = [r[key] for r in rows]
        ax.barh(range(len(rows)), vals, left=left, color=f"C{i}", label=label)
        left = [a + b for a, b in zip(left, vals)]
    for i, r in enumerate(rows):
        ax.text(left[i], i, f"  {r['memory_gb']:.0f} GB, {r['tflops_per_gpu']:.0f} TFLOP/s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["layout"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(left) * 1.35)
    ax.set_xlabel("predicted step time (s)")
    ax.set_title(f"{model} on {gpus} GPUs of {preset}, batch {global_batch}: top {len(rows)} of {summary['fit']} "
                 f"layouts that fit ({summary['rejected_for_memory']} rejected for memory)", fontsize=9)
    # Outside the axes: inside, it would cover the labels at the ends of the bars.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def explorer(model: str = "llama3-405b", preset: str = "dgx-h100-ndr", gpus: int = 16384, global_batch: int = 2048,
             top_k: int = 5):
    """An ipywidgets planner: model and preset dropdowns, GPU count, global batch (sequences), the compute
    model (the kernel model by default, or one share of peak set by a slider) and top-k; shows
    :func:`table_html` and the search summary, or the error message.

    Returns:
        an ``ipywidgets.VBox`` with ``controls`` (dict of input widgets), ``table`` (HTML widget) and
        ``rows()`` (the current rows) attached for scripts and tests.

    Raises:
        ImportError: ipywidgets is not installed.
    """
    import ipywidgets as w

    style = {"description_width": "140px"}
    controls = {
        "model": w.Dropdown(options=list_models(), value=model, description="model", style=style),
        "preset": w.Dropdown(options=list_presets(), value=preset, description="cluster preset", style=style),
        "gpus": w.BoundedIntText(value=gpus, min=1, max=1_000_000, description="GPUs", style=style),
        "global_batch": w.BoundedIntText(value=global_batch, min=1, max=10_000_000, description="global batch (seq)",
                                         style=style),
        "compute": w.Dropdown(options=[("kernel model", AUTO), ("one share of peak", "fraction")], value=AUTO,
                              description="compute", style=style),
        "achievable_fraction": w.FloatSlider(value=DEFAULT_ACHIEVABLE_FRACTION, min=0.1, max=1.0, step=0.05,
                                             description="fraction of peak", style=style, continuous_update=False,
                                             disabled=True),
        "top_k": w.BoundedIntText(value=top_k, min=1, max=50, description="top k", style=style),
    }
    table = w.HTML()
    current: list[dict] = []

    def redraw(*_):
        by_share = controls["compute"].value != AUTO
        controls["achievable_fraction"].disabled = not by_share
        try:
            rows, s = plan_rows(controls["model"].value, controls["preset"].value, controls["gpus"].value,
                                controls["global_batch"].value, controls["top_k"].value,
                                controls["achievable_fraction"].value if by_share else AUTO)
        except (KeyError, ValueError) as e:
            current.clear()
            table.value = f"<p style='color:#b00'>{html.escape(str(e))}</p>"
            return
        current[:] = rows
        priced = ("the kernel model" if s["compute_model"] == "kernels"
                  else f"{s['compute_model']:g} of peak" + ("" if by_share else " (no kernel model for this GPU)"))
        caption = (f"{s['candidates']} layouts considered: {s['fit']} fit, {s['rejected_for_memory']} rejected "
                   f"for memory, {s['rejected_batch']} for the batch split"
                   + (f", {s['rejected_heads']} for the heads" if s["rejected_heads"] else "")
                   + f"; compute: {priced}")
        table.value = table_html(rows, caption) if rows else f"<p>No layout fits. {html.escape(caption)}</p>"

    for c in controls.values():
        c.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox([w.VBox([controls[k] for k in ("model", "preset", "gpus")]),
                          w.VBox([controls[k] for k in ("global_batch", "compute", "achievable_fraction",
                                                        "top_k")])]), table])
    box.controls, box.table = controls, table
    box.rows = lambda: list(current)
    return box
