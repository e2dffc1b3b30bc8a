"""Showing the package's own code and docstrings in the book, readable at the text column.

The chapters quote ``commlab``'s functions at build time, so the book cannot drift from the code. Printed
raw, a listing scrolls sideways (the package's lines run to 120 characters) and a docstring shows its
reStructuredText markup (````nbytes````, ``:func:`...```). These helpers return IPython display objects
instead: a highlighted listing that wraps its long lines, and a docstring as Markdown.
"""

from __future__ import annotations

import html
import inspect
import re

__all__ = ["source_listing", "docstring_markdown", "rst_to_markdown"]


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
