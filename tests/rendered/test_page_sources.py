"""Every chapter page shows the code its ranks run, next to the proof that uses it.

For each notebook in `notebooks/`, its code cells are parsed for launches:
`launch.spawn(NAME, ...)` (also `spawn(NAME, ...)` imported from the launcher), with
NAME resolved through the notebook's imports (`from m import f`, `from pkg import mod`
then `mod.f`, `import m as x`) to the module that defines it and its qualname; and
`launch.torchrun("pkg.mod", ..., module=True)`, which runs a whole module. The
chapter's built page must hold a `dtlib-source` block, written by
`dtlib.chapters.show.show`, for each launched function (matched on module and
qualname), and at least one block from each module run under torchrun. Functions a
notebook defines itself need none: their code is on the page already.

The checking functions are unit-tested on a tiny synthetic notebook and page, so the
check is known to fail when a `show` cell is missing, with or without a built book.
Over the real book, the same skip convention as `test_rendered_book.py`: skipped when
there is no `_build/html` (run `make book`), a failure instead under
DTLIB_REQUIRE_BOOK=1 (`make check-book`); DTLIB_BOOK_HTML points at another build.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
HTML = Path(os.environ.get("DTLIB_BOOK_HTML", ROOT / "_build" / "html")).resolve()
REQUIRED = os.environ.get("DTLIB_REQUIRE_BOOK") == "1"
LAUNCHER = "dtlib.runtime.launch"
DEFINED_HERE = "<notebook>"


@dataclass(frozen=True)
class Target:
    """What a notebook launches: a function (``module``, ``qualname``) or, for
    ``torchrun(..., module=True)``, a whole module (``qualname`` empty)."""

    module: str
    qualname: str
    cell: int

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


def code_cells(nb: dict) -> list[tuple[int, str]]:
    """``(cell index, source)`` of each code cell, IPython syntax made parseable.

    A ``%%`` cell magic's body is a script for the magic (``%%torchrun``): its code is on
    the page as the cell's input, and it launches nothing by name, so it is dropped.
    Line magics and shell escapes become ``pass``.
    """
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        if src.lstrip().startswith("%%"):
            continue
        lines = ["pass" if line.lstrip().startswith(("%", "!")) else line
                 for line in src.splitlines()]
        out.append((i, "\n".join(lines)))
    return out


def _trees(nb: dict) -> list[tuple[int, ast.Module]]:
    trees = []
    for i, src in code_cells(nb):
        try:
            trees.append((i, ast.parse(src)))
        except SyntaxError:  # a cell that does not parse launches nothing either
            continue
    return trees


def _bindings(trees: list[tuple[int, ast.Module]]) -> dict[str, str]:
    """Name -> dotted path, from every import of the notebook; notebook-defined
    functions and classes map to :data:`DEFINED_HERE`."""
    names: dict[str, str] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        names[a.asname] = a.name
                    else:  # `import a.b` binds `a`
                        top = a.name.split(".")[0]
                        names[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.setdefault(node.name, DEFINED_HERE)
    return names


def _dotted(expr: ast.expr, names: dict[str, str]) -> str | None:
    """``a.b.c`` with ``a`` resolved through ``names``; None for anything else."""
    attrs = []
    while isinstance(expr, ast.Attribute):
        attrs.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in names:
        return None
    base = names[expr.id]
    if base == DEFINED_HERE:
        return DEFINED_HERE
    return ".".join([base, *reversed(attrs)])


def qualify(dotted: str) -> tuple[str, str]:
    """``(module that defines it, qualname)`` of the object at ``dotted``.

    Imports the longest importable module prefix and follows attributes, so that a
    re-exported name reports where it is defined (what ``show`` prints). Without an
    importable module, the last component is taken as the name.
    """
    parts = dotted.split(".")
    for k in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        try:
            for attr in parts[k:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        fn = getattr(obj, "__func__", obj)
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__",
                                                                      None)
        if module and qualname:
            return module, qualname
        break
    return ".".join(parts[:-1]), parts[-1]


def launch_targets(nb: dict) -> tuple[list[Target], list[str]]:
    """What the notebook launches, and the launches whose target could not be resolved
    (described as ``"cell N launches <source>"``)."""
    trees = _trees(nb)
    names = _bindings(trees)
    targets: list[Target] = []
    unresolved: list[str] = []
    for i, tree in trees:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            called = _dotted(node.func, names)
            if called == f"{LAUNCHER}.spawn":
                fn = _dotted(node.args[0], names)
                if fn == DEFINED_HERE:
                    continue
                if fn is None:
                    unresolved.append(f"cell {i} launches {ast.unparse(node.args[0])}")
                    continue
                targets.append(Target(*qualify(fn), i))
            elif called == f"{LAUNCHER}.torchrun":
                first = node.args[0]
                as_module = any(k.arg == "module" and isinstance(k.value, ast.Constant)
                                and k.value.value is True for k in node.keywords)
                if as_module and isinstance(first, ast.Constant) \
                        and isinstance(first.value, str):
                    targets.append(Target(first.value, "", i))
    return targets, unresolved


class _Blocks(HTMLParser):
    """Collects ``(module, qualname)`` of every ``dtlib-source`` block of a page: the
    qualname from ``data-qualname``, the module from the ``module.qualname`` that the
    block's first ``<code>`` shows."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[tuple[str, str]] = set()
        self._pending: str | None = None  # a block's qualname until its <code> is read
        self._in_code = False
        self._text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "div" and "dtlib-source" in (a.get("class") or "").split():
            self._pending = a.get("data-qualname") or ""
        elif tag == "code" and self._pending is not None:
            self._in_code, self._text = True, ""

    def handle_data(self, data: str) -> None:
        if self._in_code:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "code" and self._in_code:
            qualname, shown = self._pending or "", self._text.strip()
            module = shown[:-len(qualname) - 1] if shown.endswith("." + qualname) \
                else ""
            self.found.add((module, qualname))
            self._pending, self._in_code = None, False


def page_sources(page_html: str) -> set[tuple[str, str]]:
    """``(module, qualname)`` of each source listing on a built page."""
    parser = _Blocks()
    parser.feed(page_html)
    return parser.found


def missing_sources(nb: dict, page_html: str) -> list[str]:
    """Launches of ``nb`` whose code the page does not show, with the cell that
    launches each; unresolvable launch targets are reported too."""
    targets, unresolved = launch_targets(nb)
    shown = page_sources(page_html)
    out = [f"{u}, which the notebook's imports do not resolve" for u in unresolved]
    for t in targets:
        if t.qualname:
            ok = (t.module, t.qualname) in shown
        else:
            ok = any(m == t.module or m.startswith(t.module + ".") for m, _ in shown)
        if not ok:
            out.append(f"cell {t.cell} launches {t.name}: no show() of it on the page")
    return sorted(set(out))


def hidden_shows(nb: dict) -> list[str]:
    """``show(...)`` calls whose listing never reaches the page: a ``show`` returns
    its listing, and a cell displays only its last expression's value, so a bare
    ``show(fn)`` statement before other code shows nothing (``display(show(fn))``,
    or ``show`` as the cell's last line, does). Found without a built book."""
    trees = _trees(nb)
    names = _bindings(trees)
    out = []
    for i, tree in trees:
        for k, stmt in enumerate(tree.body):
            if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
                continue
            called = _dotted(stmt.value.func, names)
            if called == "dtlib.chapters.show.show" and k != len(tree.body) - 1:
                out.append(f"cell {i}: `{ast.unparse(stmt.value)}` is not the cell's "
                           "last expression, so it displays nothing")
    return out


# ---- the checking functions, on a tiny synthetic notebook ---------------------------

def _notebook(*cells: str) -> dict:
    return {"cells": [{"cell_type": "code", "source": c.splitlines(keepends=True)}
                      for c in cells]}


SYNTHETIC = _notebook(
    "%load_ext dtlib\nfrom dtlib.runtime import launch\n"
    "from dtlib.runtime import dist as ddist\n"
    "from dtlib.chapters.ch02_collectives.runs import training_step_comms\n"
    "from dtlib.chapters.show import show",
    "%%torchrun -n 2\nlaunch.spawn(not_resolved, 2)",
    "def mine():\n    return 1\n\nlaunch.spawn(mine, 2)",
    "out = launch.spawn(training_step_comms, 4, stream=False)\n"
    "values = launch.spawn(ddist.world_info, 2)",
    'launch.torchrun("dtlib.train", "--steps", "2", module=True, nproc=2)',
    "!echo shell escapes and bad syntax are ignored\nif :",
)


def _page(*objs: object) -> str:
    from dtlib.chapters.show import show

    body = show(*objs)._repr_html_() if objs else ""
    return f"<html><body><main><div class='output text_html'>{body}</div></main></html>"


def test_targets_are_resolved_through_imports() -> None:
    targets, unresolved = launch_targets(SYNTHETIC)
    assert unresolved == []
    assert {t.name for t in targets} == {
        "dtlib.chapters.ch02_collectives.runs.training_step_comms",
        "dtlib.runtime.dist.world_info", "dtlib.train"}


def test_check_fails_when_a_show_cell_is_missing() -> None:
    from dtlib.chapters.ch02_collectives.runs import training_step_comms
    from dtlib.runtime.dist import world_info
    from dtlib.train.config import parse_args

    complete = _page(training_step_comms, world_info, parse_args)
    assert missing_sources(SYNTHETIC, complete) == []
    without_comms = missing_sources(SYNTHETIC, _page(world_info, parse_args))
    assert without_comms == ["cell 3 launches dtlib.chapters.ch02_collectives.runs."
                          "training_step_comms: no show() of it on the page"]
    without_train = missing_sources(SYNTHETIC, _page(training_step_comms, world_info))
    assert without_train == ["cell 4 launches dtlib.train: no show() of it on the page"]
    assert len(missing_sources(SYNTHETIC, _page())) == 3


def test_same_name_in_another_module_does_not_count() -> None:
    from dtlib.chapters.ch02_collectives.runs import training_step_comms
    from dtlib.runtime.dist import world_info
    from dtlib.train.config import parse_args

    # the right qualname, shown from another module
    page = _page(world_info, parse_args).replace(
        "dtlib.runtime.dist.world_info", "dtlib.runtime.launch.world_info")
    page += _page(training_step_comms)
    assert missing_sources(SYNTHETIC, page) == [
        "cell 3 launches dtlib.runtime.dist.world_info: no show() of it on the page"]


def test_unresolvable_launch_is_reported() -> None:
    nb = _notebook("from dtlib.runtime import launch\nfn = pick()\nlaunch.spawn(fn, 2)")
    assert missing_sources(nb, _page()) == [
        "cell 0 launches fn, which the notebook's imports do not resolve"]


def test_page_sources_reads_the_module_and_qualname() -> None:
    from dtlib.tensor_parallel.mappings import CopyToParallelRegion

    assert page_sources(_page(CopyToParallelRegion.backward)) == {("dtlib.tensor_parallel.mappings",
                                   "CopyToParallelRegion.backward")}


def test_real_chapters_launch_what_the_check_expects() -> None:
    """The parser sees the launches of the real notebooks (else the book check below
    would pass vacuously)."""
    launched = {}
    for path in NOTEBOOKS:
        targets, unresolved = launch_targets(json.loads(path.read_text()))
        assert not unresolved, f"{path.name}: {unresolved}"
        launched[path.stem] = {t.name for t in targets}
    by_name = {name[:2]: names for name, names in launched.items()}
    assert "dtlib.chapters.ch02_collectives.runs.training_step_comms" in by_name["02"]
    assert "dtlib.runtime.dist.world_info" in by_name["00"]
    assert "dtlib.train" in by_name["10"]
    assert sum(len(v) for v in launched.values()) >= 15


def test_a_show_before_other_code_is_found() -> None:
    head = "from dtlib.chapters.show import show\nfrom dtlib.runtime import launch\n"
    nb = _notebook(head, "show(f)\nlaunch.spawn(f, 2)", "x = 1\nshow(f)",
                   "display(show(f))\nlaunch.spawn(f, 2)")
    assert hidden_shows(nb) == [
        "cell 1: `show(f)` is not the cell's last expression, so it displays nothing"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_show_reaches_the_page(path: Path) -> None:
    """Needs no built book: `make test` catches what the book check found in CI."""
    assert hidden_shows(json.loads(path.read_text())) == []


# ---- over the built book ------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_page_shows_what_its_ranks_run(path: Path) -> None:
    page = HTML / "notebooks" / f"{path.stem}.html"
    if not page.is_file():
        reason = (f"no built page {page}: run `make book` first "
                  "(`make check-book` requires it)")
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    missing = missing_sources(json.loads(path.read_text()),
                              page.read_text(encoding="utf-8"))
    assert not missing, f"{page.name}:\n  " + "\n  ".join(missing)
