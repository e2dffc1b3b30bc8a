"""Text the book shows in a cell's output: tables, docstrings and source listings that fit the text column.

The book's text column is 688 px wide, about 85 characters of code font. A table printed with ``print``
is a ``<pre>`` block that scrolls sideways once it is wider; a Markdown table, displayed through
:class:`IPython.display.Markdown`, is rendered by myst-nb as an HTML table that wraps its cells (with
``render_markdown_format: gfm`` in the notebook's ``mystnb`` metadata; commonmark, the default, has no
tables). A docstring
printed with ``print`` shows its reStructuredText markup (````code````, ``:func:`x```); :func:`docstring_markdown`
turns the few constructs the package's docstrings use into Markdown. :func:`source_listing` shows a
function's source as a highlighted block with long lines wrapped, so that the book shows the package's code
(never a copy) without a sideways scroll.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from typing import Any, Sequence

__all__ = ["markdown_table", "docstring_markdown", "source_listing", "wrap", "COLUMN_CHARS"]

#: Characters of code font that fit the book's 688 px text column.
COLUMN_CHARS = 84


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None):
    """A Markdown table as an :class:`IPython.display.Markdown` object (rendered as an HTML table).

    Args:
        headers: column titles.
        rows: one sequence of cell values per row (formatted with ``str``; format numbers before).
        align: one of ``l``, ``r``, ``c`` per column (default: the first column left, the others right).

    Raises:
        ValueError: a row whose length differs from ``headers``, or an ``align`` of the wrong length or letters.
    """
    from IPython.display import Markdown

    align = align if align is not None else "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers) or set(align) - set("lrc"):
        raise ValueError(f"align must give one of l, r, c for each of the {len(headers)} columns, got {align!r}")
    for i, r in enumerate(rows):
        if len(r) != len(headers):
            raise ValueError(f"row {i} has {len(r)} cells for {len(headers)} columns")
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |",
             "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return Markdown("\n".join(lines))


_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):`~?([^`]+)`")


def docstring_markdown(obj: Any, paragraphs: slice | None = None):
    """``obj``'s docstring (or the paragraphs ``paragraphs`` of it) as :class:`IPython.display.Markdown`.

    Converts the reStructuredText the package writes: double-backquoted literals to single ones, Sphinx roles
    (``:func:`name```) to literals of their target, and joins each paragraph's lines so that Markdown wraps it
    (list items stay items).
    """
    from IPython.display import Markdown

    doc = inspect.getdoc(obj) or ""
    parts = doc.split("\n\n")
    if paragraphs is not None:
        parts = parts[paragraphs]
    out = []
    for p in parts:
        p = _ROLE.sub(lambda m: f"`{m.group(1)}`", p).replace("``", "`")
        items = re.split(r"\n(?=\* )", p)
        out.append("\n".join(" ".join(line.strip() for line in item.splitlines()) for item in items))
    return Markdown("\n\n".join(out))


def _split_points(line: str) -> list[int]:
    """Positions where ``line`` may break and stay valid Python: after a comma, or before ``and``/``or``/``if``/
    ``for``/``+``, outside string literals and inside brackets (where a newline continues the statement)."""
    points, depth, quote, i = [], 0, None, 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if line.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif ch in "\"'":
            quote = ch * 3 if line.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch == "#":
            break
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth > 0 and ch == "," and line[i + 1:i + 2] == " ":
            points.append(i + 1)
        elif ch == " " and any(line.startswith(w, i + 1) for w in ("and ", "or ", "if ", "for ", "+ ")):
            if depth > 0:
                points.append(i)
            elif not line[:i].lstrip().startswith(("if ", "elif ", "while ", "return ", "for ", "assert ")):
                pass  # at depth 0 only inside a statement that a backslash may continue: see below
            else:
                points.append(-i)  # negative: needs a backslash continuation
        i += 1
    return points


def _wrap_line(line: str, width: int) -> list[str]:
    """Break ``line`` at the last safe point before ``width`` (repeatedly); a line with none stays whole."""
    out, indent = [], len(line) - len(line.lstrip())
    cont = " " * (indent + 8)
    while len(line) > width:
        pts = _split_points(line)
        fits = [p for p in pts if 0 < p <= width and line[:p].strip()]
        slash = [-p for p in pts if p < 0 and -p <= width - 2]
        if fits:
            p = fits[-1]
            out.append(line[:p].rstrip())
        elif slash:
            p = slash[-1]
            out.append(line[:p].rstrip() + " \\")
        else:
            break
        line = cont + line[p:].lstrip()
    return out + [line]


def source_listing(obj: Any, width: int = COLUMN_CHARS, start: str | None = None, docstring: bool = True):
    """The source of ``obj`` as a highlighted Markdown code block, lines longer than ``width`` wrapped.

    A long line is broken only where Python allows it (after a comma or before an operator inside brackets,
    or with a backslash before ``and``/``or`` in a condition; never inside a string), so the listing still
    parses and highlights; a wrapped line continues with 8 more spaces of indent, and a line with no such
    point stays whole. ``start``: begin at the first line containing this text. ``docstring=False`` drops
    the docstring (the prose around the listing says what it says). Shown as Markdown: the notebook needs
    myst-nb's ``render_markdown_format: gfm`` (notebook metadata ``mystnb``) for fences and tables.

    Raises:
        ValueError: ``start`` not found in the source.
    """
    from IPython.display import Markdown

    src = textwrap.dedent(inspect.getsource(obj))
    if not docstring and getattr(obj, "__doc__", None):
        m = re.search(r'\n(\s*)("""|\'\'\').*?\2\n', src, flags=re.S)
        if m:
            src = src[:m.start()] + "\n" + src[m.end():]
    if start is not None:
        i = src.find(start)
        if i < 0:
            raise ValueError(f"{start!r} is not in the source of {getattr(obj, '__qualname__', obj)!r}")
        src = textwrap.dedent(src[src.rfind("\n", 0, i) + 1:])
    lines = [w for line in src.rstrip().splitlines() for w in _wrap_line(line, width)]
    return Markdown("```python\n" + "\n".join(lines) + "\n```")


def wrap(text: str, width: int = COLUMN_CHARS) -> str:
    """``text`` with every line longer than ``width`` wrapped at spaces, continuation lines indented by 2
    more than their line; for printing prose-like results (error messages, lists) that fit the column."""
    out = []
    for line in str(text).splitlines() or [""]:
        indent = len(line) - len(line.lstrip())
        out += textwrap.wrap(line, width=width, subsequent_indent=" " * (indent + 2), break_long_words=False,
                             break_on_hyphens=False) or [line]
    return "\n".join(out)
