"""Showing the package's own code, docstrings and tables in the book, readable at the text column.

The chapters quote ``commlab``'s functions at build time, so the book cannot drift from the code. Printed
raw, a listing scrolls sideways (the package's lines run to 120 characters) and a docstring shows its
reStructuredText markup (````nbytes````, ``:func:`...```). These helpers return IPython display objects
instead: a highlighted listing that wraps its long lines, a docstring as Markdown, and a table as an HTML
table whose columns wrap (with a Markdown version: the book renders Markdown outputs as CommonMark, which has
no tables).
"""

from __future__ import annotations

from typing import Sequence

import html
import inspect
import re

__all__ = ["source_listing", "docstring_markdown", "rst_to_markdown", "markdown_table", "Table"]


def source_listing(*objects) -> "IPython.display.HTML":  # noqa: F821
    """The source of each function or class, highlighted, as one HTML block whose long lines wrap.

    Each object's source comes from :func:`inspect.getsource`; objects whose name starts with ``_`` are
    refused, since the book shows what a reader may call.

    Raises:
        ValueError: a private object. TypeError: an object without source (a builtin).
    """
    from IPython.display import HTML
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    private = [o.__name__ for o in objects if getattr(o, "__name__", "").startswith("_")]
    if private:
        raise ValueError(f"source_listing shows public functions only, got {private}: "
                         "describe private helpers in prose instead")
    code = "\n\n".join(inspect.getsource(o).rstrip() for o in objects)
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


def docstring_markdown(obj, paragraphs: slice | int | None = None, signature: bool = False) -> "IPython.display.Markdown":  # noqa: F821
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
        align = "".join("r" if isinstance(v, (int, float)) and not isinstance(v, bool) else "l" for v in first)
    if len(align) != width or set(align) - set("lrc"):
        raise ValueError(f"align must give one of l, r, c for each of the {width} columns, got {align!r}")
    return Table(header, rows, align)
