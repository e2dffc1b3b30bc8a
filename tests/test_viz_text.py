"""The book's text helpers: rendered tables, docstrings without RST markup, listings and prose that fit the column."""

import pytest

from commlab.overlap.model import bucketed_allreduce_schedule
from commlab.parallel.mesh import ParallelLayout
from commlab.viz.text import COLUMN_CHARS, docstring_markdown, markdown_table, source_listing, wrap


def test_markdown_table_renders_rows_and_rejects_ragged_ones():
    md = markdown_table(["a", "b"], [[1, "x|y"], [2, "z"]]).data
    assert md.splitlines() == ["| a | b |", "|:---|---:|", "| 1 | x\\|y |", "| 2 | z |"]
    with pytest.raises(ValueError, match="row 1 has 1 cells for 2 columns"):
        markdown_table(["a", "b"], [[1, 2], [3]])
    with pytest.raises(ValueError, match="align"):
        markdown_table(["a", "b"], [[1, 2]], align="lx")


def test_docstring_markdown_drops_rst_markup():
    md = docstring_markdown(ParallelLayout, slice(1, 2)).data
    assert "``" not in md and "`devices_per_node`" in md and "\n" not in md.strip()


def test_source_listing_fits_the_column():
    md = source_listing(bucketed_allreduce_schedule, docstring=False).data
    body = md.splitlines()[1:-1]
    assert md.startswith("```python\n") and '"""' not in md and "def bucketed_allreduce_schedule" in md
    compile("\n".join(body), "listing", "exec")  # wrapped only where Python allows: it still parses and highlights
    assert sum(len(line) > COLUMN_CHARS for line in body) <= 1  # one f-string message has no safe break
    with pytest.raises(ValueError, match="not in the source"):
        source_listing(bucketed_allreduce_schedule, start="no such line")


def test_wrap_keeps_short_lines_and_indents_continuations():
    text = "short\n  " + "word " * 40
    out = wrap(text, 30).splitlines()
    assert out[0] == "short" and all(len(line) <= 30 for line in out)
    assert out[1].startswith("  word") and out[2].startswith("    word")
