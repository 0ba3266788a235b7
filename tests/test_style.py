"""House style that the book's readers see: the code pages print from dtlib's source.

1. Every line of ``dtlib/**/*.py`` is at most 88 characters (a listing wider than the
   text column scrolls sideways, and the house formatter's width is 88).
2. No import line carries a ``#:`` comment: ``#:`` documents the assignment that
   follows it (Sphinx autodoc reads it so), and on an import it documents nothing.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "dtlib"
MAX_LINE = 88


def long_lines(root: Path = ROOT, limit: int = MAX_LINE) -> list[str]:
    """``path:line (length)`` of every line longer than ``limit`` characters."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if len(line) > limit:
                found.append(f"{path.relative_to(root.parent)}:{no} ({len(line)})")
    return found


def doc_comments_on_imports(root: Path = ROOT) -> list[str]:
    """``path:line`` of every ``#:`` comment on an import statement's lines, or on
    the line right above one (where it would document the import)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        comments = {tok.start[0] for tok in tokenize.generate_tokens(
            io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT and tok.string.startswith("#:")}
        if not comments:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                lines = set(range(node.lineno - 1, (node.end_lineno or node.lineno) + 1))
                for no in sorted(comments & lines):
                    found.append(f"{path.relative_to(root.parent)}:{no}")
    return found


def test_dtlib_lines_fit_the_page() -> None:
    found = long_lines()
    assert not found, (f"{len(found)} lines over {MAX_LINE} characters:\n"
                       + "\n".join(found))


def test_no_doc_comment_on_an_import() -> None:
    found = doc_comments_on_imports()
    assert not found, ("'#:' comments on import lines (move them to what they "
                       "describe, or make them plain comments):\n" + "\n".join(found))


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    """A planted long line and a planted ``#:`` on an import are both reported."""
    pkg = tmp_path / "dtlib"
    pkg.mkdir()
    (pkg / "ok.py").write_text("#: the answer\nANSWER = 42\nimport os  # why: paths\n")
    (pkg / "bad.py").write_text("#: the os module\nimport os\n"
                                "from sys import (argv,  #: arguments\n    path)\n"
                                "X = '" + "x" * MAX_LINE + "'\n")
    assert long_lines(pkg) == [f"dtlib/bad.py:5 ({MAX_LINE + 6})"]
    assert doc_comments_on_imports(pkg) == ["dtlib/bad.py:1", "dtlib/bad.py:3"]
