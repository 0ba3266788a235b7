"""Show the code a page runs, read from the source at run time (never pasted).

``show(fn)`` in a cell displays the source of ``fn`` with its file and line numbers:
highlighted HTML in the built book and in JupyterLab, plain text when printed.
Because it reads the installed source, the page and the code can never drift apart.

Used by: every chapter, next to the proof that runs the code.
"""

from __future__ import annotations

import inspect
import os
import textwrap
from typing import Any, Callable

__all__ = ["Source", "Listing", "show", "source_of"]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


class Source:
    """The source of one function, class or module, with where it lives."""

    def __init__(self, obj: Any, lines: tuple[int, int] | None = None,
                 start: str | None = None, stop: str | None = None) -> None:
        first_text, last_text = start, stop
        if inspect.ismethod(obj):
            obj = obj.__func__
        obj = inspect.unwrap(obj) if callable(obj) else obj
        try:
            src, start = inspect.getsourcelines(obj)
            path = inspect.getsourcefile(obj) or "?"
        except (OSError, TypeError) as exc:
            raise ValueError(f"obj={obj!r} has no source to show ({exc})") from None
        if first_text is not None or last_text is not None:
            if lines is not None:
                raise ValueError("give lines= or start=/stop=, not both")
            lines = _marked_range(src, first_text, last_text,
                                  getattr(obj, "__qualname__", obj))
        if lines is not None:
            lo, hi = lines
            if not 1 <= lo <= hi <= len(src):
                raise ValueError(f"lines={lines} must lie within 1..{len(src)} of "
                                 f"{getattr(obj, '__qualname__', obj)}")
            src, start = src[lo - 1:hi], start + lo - 1
        self.name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
        self.module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
        self.path = os.path.relpath(path, _PACKAGE_ROOT) if path.startswith(
            _PACKAGE_ROOT) else path
        self.first = start
        self.code = textwrap.dedent("".join(src)).rstrip("\n")

    @property
    def last(self) -> int:
        return self.first + self.code.count("\n")

    @property
    def where(self) -> str:
        return f"{self.path}, lines {self.first}-{self.last}"

    def _repr_html_(self) -> str:
        import html

        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer

            body = highlight(self.code, PythonLexer(),
                             HtmlFormatter(noclasses=True, nobackground=True))
        except ImportError:  # pygments comes with Sphinx and Jupyter; plain text else
            body = f"<pre>{html.escape(self.code)}</pre>"
        return (f'<div class="dtlib-source" data-qualname="{html.escape(self.name)}">'
                f'<p class="dtlib-source-where"><code>{html.escape(self.module)}.'
                f"{html.escape(self.name)}</code> &mdash; {html.escape(self.where)}</p>"
                f"{body}</div>")

    def __repr__(self) -> str:
        return f"# {self.module}.{self.name} ({self.where})\n{self.code}"


def _marked_range(src: list[str], start: str | None, stop: str | None,
                  name: Any) -> tuple[int, int]:
    """Lines (1-based) from the first containing ``start`` to the next containing
    ``stop``: a listing keyed on the code's own text fails loudly when that text
    changes, where fixed line numbers would silently show the wrong lines."""
    lo = 1
    if start is not None:
        hits = [i for i, line in enumerate(src, 1) if start in line]
        if not hits:
            raise ValueError(f"start={start!r} is not in the source of {name}")
        lo = hits[0]
    hi = len(src)
    if stop is not None:
        hits = [i for i, line in enumerate(src, 1) if stop in line and i >= lo]
        if not hits:
            raise ValueError(f"stop={stop!r} is not in the source of {name} after "
                             f"line {lo}")
        hi = hits[0]
    return lo, hi


def source_of(obj: Any, lines: tuple[int, int] | None = None) -> Source:
    """The :class:`Source` of ``obj``; ``lines=(a, b)`` keeps lines a..b (1-based)."""
    return Source(obj, lines)


class Listing:
    """Several sources shown one after the other."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources

    def _repr_html_(self) -> str:
        return "".join(s._repr_html_() for s in self.sources)

    def __repr__(self) -> str:
        return "\n\n".join(repr(s) for s in self.sources)


def show(*objs: Callable[..., Any] | type, lines: tuple[int, int] | None = None,
         start: str | None = None, stop: str | None = None) -> Listing:
    """The source of each object, for display as a cell's result.

    Args:
        objs: functions, classes or modules whose code the page runs or teaches.
        lines: with a single object, show only its lines ``a..b`` (1-based, inclusive).
        start, stop: with a single object, show from the first line containing
            ``start`` to the next line containing ``stop`` (preferred over ``lines``:
            it cannot drift when the function is edited).
    Returns:
        A :class:`Listing`: highlighted HTML in a notebook or the book, text in print.
    """
    if not objs:
        raise ValueError("show() needs at least one function, class or module")
    if (lines is not None or start is not None or stop is not None) and len(objs) != 1:
        raise ValueError("lines=, start= and stop= apply to a single object")
    return Listing([Source(o, lines, start, stop) for o in objs])
