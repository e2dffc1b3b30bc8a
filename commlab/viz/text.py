"""Text the book shows in a cell's output: tables, docstrings, source listings and prose that fit the column.

The chapters quote ``commlab``'s own functions at build time, so the book cannot drift from the code. Printed
raw, these scroll sideways or show markup: the book's text column is 688 px wide, about 85 characters of
code font (the package's lines run to 120), a table printed with ``print`` is a ``<pre>`` block, and a
printed docstring shows its reStructuredText (````nbytes````, ``:func:`...```). These helpers return IPython
display objects instead:

* :func:`markdown_table`: a :class:`Table`, shown as an HTML table whose cells wrap (with a Markdown
  version for JupyterLab and as the plain text that nbval compares);
* :func:`docstring_markdown`: a docstring, or some of its paragraphs, as Markdown;
* :func:`source_listing`: public functions' source, highlighted, long lines wrapped by the page;
* :func:`wrap`: prose-like results (messages, lists) folded to :data:`COLUMN_CHARS` before printing.
"""

from __future__ import annotations

import html
import inspect
import re
import textwrap
from typing import Sequence

from commlab import checks

__all__ = ["markdown_table", "Table", "docstring_markdown", "rst_to_markdown", "source_listing", "wrap",
           "COLUMN_CHARS"]

#: Characters of code font that fit the book's 688 px text column.
COLUMN_CHARS = 84


def source_listing(*objects, start: str | None = None, docstring: bool = True) -> "IPython.display.HTML":  # noqa: F821
    """The source of each function or class, highlighted, as one HTML block whose long lines wrap.

    Each object's source comes from :func:`inspect.getsource`; objects whose name starts with ``_`` are
    refused, since the book shows what a reader may call (describe private helpers in prose).

    Args:
        objects: the functions or classes, shown in this order.
        start: begin each listing at its first line containing this text (the lines before are dropped).
        docstring: ``False`` drops each docstring (the prose around the listing says what it says).

    Raises:
        ValueError: a private object, or ``start`` not in an object's source. TypeError: an object without
        source (a builtin).
    """
    from IPython.display import HTML
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    private = [o.__name__ for o in objects if getattr(o, "__name__", "").startswith("_")]
    if private:
        raise ValueError(f"source_listing shows public functions only, got {private}: "
                         "describe private helpers in prose instead")
    sources = []
    for o in objects:
        src = textwrap.dedent(inspect.getsource(o))
        if not docstring and getattr(o, "__doc__", None):
            m = re.search(r'\n(\s*)("""|\'\'\').*?\2\n', src, flags=re.S)
            if m:
                src = src[:m.start()] + "\n" + src[m.end():]
        if start is not None:
            i = src.find(start)
            if i < 0:
                raise ValueError(f"{start!r} is not in the source of {getattr(o, '__qualname__', o)!r}")
            src = textwrap.dedent(src[src.rfind("\n", 0, i) + 1:])
        sources.append(src.rstrip())
    code = "\n\n".join(sources)
    # Inline styles (noclasses) so the colours do not depend on the theme's stylesheet; pre-wrap keeps the
    # indentation and wraps a long line instead of scrolling.
    body = highlight(code, PythonLexer(), HtmlFormatter(noclasses=True, nowrap=True, style="friendly"))
    return HTML('<pre class="commlab-listing" style="white-space: pre-wrap; overflow-wrap: anywhere; '
                'font-size: 0.85em; line-height: 1.35; padding: 0.6em; background: #f8f8f8; '
                f'border-radius: 4px">{body}</pre>')


_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def rst_to_markdown(text: str) -> str:
    """Turn the reStructuredText of commlab's docstrings into Markdown: ````x```` and ``:func:`~a.b.c```
    become `x` and `c` (a role's target, last dotted part when written with ``~``)."""
    def role(m):
        target = m.group(1)
        shown = target.rsplit(".", 1)[-1] if m.group(0).split("`", 1)[1].startswith("~") else target
        return f"`{shown}`"

    text = _ROLE.sub(role, text)
    return _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)


def docstring_markdown(obj, paragraphs: slice | int | None = None,
                       signature: bool = False) -> "IPython.display.Markdown":  # noqa: F821
    """``obj``'s docstring (or the chosen paragraphs of it) as Markdown, for a notebook output.

    Args:
        obj: a documented function, class or module.
        paragraphs: which blank-line-separated paragraphs to show (an index or a slice; default all).
        signature: put ``name(signature)`` in bold code before the text.

    Raises:
        ValueError: ``obj`` has no docstring.
    """
    from IPython.display import Markdown

    doc = inspect.getdoc(obj)
    if not doc:
        raise ValueError(f"{obj!r} has no docstring to show")
    parts = doc.split("\n\n")
    if isinstance(paragraphs, int):
        parts = [parts[paragraphs]]
    elif paragraphs is not None:
        parts = parts[paragraphs]
    out = []
    for part in parts:
        # Google-style section headers ("Args:", "Returns:") become bold lines.
        part = re.sub(r"^(Args|Returns|Raises|Attributes):\s*$", r"**\1**", part, flags=re.M)
        # Continuation lines of a docstring are indented; Markdown would read them as code.
        out.append("\n".join(line.strip() for line in part.splitlines()))
    text = rst_to_markdown("\n\n".join(out))
    if signature:
        text = f"`{obj.__name__}{inspect.signature(obj)}`\n\n" + text
    return Markdown(html.unescape(text))


class Table:
    """A table for a notebook output, shown as an HTML table (the book, JupyterLab) with a Markdown
    version beside it (``_repr_markdown_``), so that its columns wrap within the text column instead of
    scrolling sideways like printed text. Built by :func:`markdown_table`."""

    def __init__(self, header: Sequence[str], rows: Sequence[Sequence], align: str):
        self.header, self.rows, self.align = [str(h) for h in header], [[str(v) for v in r] for r in rows], align

    def _repr_markdown_(self) -> str:
        rule = {"l": ":---", "r": "---:", "c": ":---:"}

        def cell(v):
            return v.replace("|", "\\|").replace("\n", " ")

        lines = ["| " + " | ".join(cell(h) for h in self.header) + " |",
                 "|" + "|".join(rule[a] for a in self.align) + "|"]
        return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows])

    def _repr_html_(self) -> str:
        side = {"l": "left", "r": "right", "c": "center"}

        def cells(values, tag):
            return "".join(f'<{tag} style="text-align: {side[a]}">{html.escape(v)}</{tag}>'
                           for v, a in zip(values, self.align))

        body = "".join(f"<tr>{cells(r, 'td')}</tr>" for r in self.rows)
        return (f'<table class="table commlab-table"><thead><tr>{cells(self.header, "th")}</tr></thead>'
                f"<tbody>{body}</tbody></table>")

    def __repr__(self) -> str:
        # The plain-text output nbval compares: the Markdown, never an object address.
        return self._repr_markdown_()

    @property
    def data(self) -> str:
        """The Markdown text (as ``IPython.display.Markdown(...).data``)."""
        return self._repr_markdown_()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> Table:
    """A table for a notebook output: a :class:`Table`, displayed as HTML with a Markdown version.

    Args:
        header: column titles.
        rows: one sequence of cells per row (each turned into text with ``str``; ``|`` is escaped in the
            Markdown, everything in the HTML).
        align: one letter per column, ``l``, ``r`` or ``c`` (default: left for text, right for numbers,
            judged from the first row).

    Raises:
        ValueError: a row or ``align`` whose length is not the header's.
    """
    width = len(header)
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"row {i} has {len(row)} cells, the header {width}: {list(row)}")
    if align is None:
        first = rows[0] if rows else [""] * width
        align = "".join("r" if checks.is_number(v) else "l" for v in first)
    if len(align) != width or set(align) - set("lrc"):
        raise ValueError(f"align must give one of l, r, c for each of the {width} columns, got {align!r}")
    return Table(header, rows, align)


def wrap(text: str, width: int = COLUMN_CHARS) -> str:
    """``text`` with every line longer than ``width`` wrapped at spaces, continuation lines indented by 2
    more than their line; for printing prose-like results (error messages, lists) that fit the column."""
    out = []
    for line in str(text).splitlines() or [""]:
        indent = len(line) - len(line.lstrip())
        out += textwrap.wrap(line, width=width, subsequent_indent=" " * (indent + 2), break_long_words=False,
                             break_on_hyphens=False) or [line]
    return "\n".join(out)
