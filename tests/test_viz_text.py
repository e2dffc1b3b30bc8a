"""The book's text helpers: rendered tables, docstrings without RST markup, listings and prose that fit the column."""

import pytest

from commlab.overlap.model import bucketed_allreduce_schedule
from commlab.parallel.mesh import ParallelLayout
from commlab.viz.text import docstring_markdown, markdown_table, source_listing, wrap


def test_helpers_render_markdown_and_html_and_refuse_private_functions():
    from commlab.collectives import ring
    from commlab.viz.text import docstring_markdown, markdown_table, rst_to_markdown, source_listing

    assert rst_to_markdown("``n`` and :func:`~commlab.collectives.ring.ring_all_reduce`") == "`n` and `ring_all_reduce`"
    md = docstring_markdown(ring.ring_bytes_sent_per_rank).data
    assert "``" not in md and "`nbytes`" in md and "**Raises**" in md
    html = source_listing(ring.reduce_scatter_send_chunk).data
    assert "pre-wrap" in html and "reduce_scatter_send_chunk" in html
    with pytest.raises(ValueError, match="public functions only"):
        source_listing(ring._agreed_geometry)
    table = markdown_table(["a", "b"], [["x|y", 2]])
    assert table.data.splitlines() == ["| a | b |", "|:---|---:|", "| x\\|y | 2 |"]
    assert "<td style=\"text-align: right\">2</td>" in table._repr_html_() and "x|y" in table._repr_html_()
    assert repr(table) == table.data  # deterministic text/plain, no object address
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        markdown_table(["a", "b"], [["x"]])


def test_docstring_paragraphs_and_listing_options():
    md = docstring_markdown(ParallelLayout, slice(1, 2)).data
    assert "``" not in md and "`devices_per_node`" in md
    with pytest.raises(ValueError, match="row 1 has 1 cells"):
        markdown_table(["a", "b"], [[1, 2], [3]])
    with pytest.raises(ValueError, match="align"):
        markdown_table(["a", "b"], [[1, 2]], align="lx")
    html = source_listing(bucketed_allreduce_schedule, docstring=False).data
    assert '"""' not in html and "bucketed_allreduce_schedule" in html and "Args:" not in html
    assert "def bucketed" not in source_listing(bucketed_allreduce_schedule, start="return").data
    with pytest.raises(ValueError, match="not in the source"):
        source_listing(bucketed_allreduce_schedule, start="no such line")


def test_wrap_keeps_short_lines_and_indents_continuations():
    text = "short\n  " + "word " * 40
    out = wrap(text, 30).splitlines()
    assert out[0] == "short" and all(len(line) <= 30 for line in out)
    assert out[1].startswith("  word") and out[2].startswith("    word")


def test_bench_table_gives_each_size_its_busbw_ratio_and_wrong_count():
    from commlab.bench.allreduce import BenchRow
    from commlab.viz import bench_table

    rows = [BenchRow(4096, 1024, "float32", 4, 1e-4, 2e-4, 0), BenchRow(2**20, 2**18, "float32", 4, 2e-3, 1e-3, 3)]
    md = bench_table(rows)._repr_markdown_().splitlines()
    assert md[0] == "| size | ours: busbw (GB/s) | torch: busbw (GB/s) | ours / torch | wrong |" and len(md) == 4
    # busbw = 2(N-1)/N × size / time (nccl-tests): 1.5 × 4096 B / 100 µs = 0.061 GB/s; ratio = torch/ours time.
    assert md[2] == "| 4 KiB | 0.061 | 0.031 | 2.00 | 0 |"
    assert md[3].endswith("| 0.50 | 3 |")
