"""Notebooks are sources: stored without outputs, the book and nbval execute them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "no notebook found in notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_no_outputs(path: Path) -> None:
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before commit"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_only_tagged_cells_may_fail_and_chapter_has_one_title(path: Path) -> None:
    nb = json.loads(path.read_text())
    first = "".join(nb["cells"][0]["source"])
    assert nb["cells"][0]["cell_type"] == "markdown" and first.startswith("# ")
    h1 = [c for c in nb["cells"] if c["cell_type"] == "markdown"
          and any(line.startswith("# ") for line in "".join(c["source"]).splitlines())]
    assert len(h1) == 1, f"{path.name}: one H1 title per chapter"


def _glue_only(source: str) -> bool:
    """Every statement of the cell is a ``glue(...)`` call: nothing a reader learns."""
    import ast

    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    return bool(body) and all(
        isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
        and getattr(s.value.func, "id", "") == "glue" for s in body)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_glue_only_cells_hide_their_input(path: Path) -> None:
    """A cell that only glues values already computed is hidden on the page
    (``remove-input``; myst-nb's glue still works), so the page shows the code that
    teaches."""
    nb = json.loads(path.read_text())
    shown = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and _glue_only("".join(c["source"]))
             and not {"remove-input", "remove-cell"} & set(
                 c.get("metadata", {}).get("tags", []))]
    assert not shown, f"{path.name}: glue-only cells {shown} are shown; tag them " \
                      "remove-input"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_a_unique_id(path: Path) -> None:
    """nbformat 4.5 cell ids: missing ones are a warning today and an error in a
    later nbformat; a translation catalog or a grader row needs them stable."""
    cells = json.loads(path.read_text())["cells"]
    missing = [i for i, c in enumerate(cells) if not c.get("id")]
    assert not missing, f"{path.name}: cells {missing} have no id"
    ids = [c["id"] for c in cells]
    assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"


def _trailing_glue(source: str) -> int:
    """How many ``glue(...)`` calls end the cell, one after another."""
    import ast

    try:
        body = ast.parse(source).body
    except SyntaxError:
        return 0
    n = 0
    for s in reversed(body):
        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                and getattr(s.value.func, "id", "") == "glue"):
            break
        n += 1
    return n


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_shown_cell_ends_in_a_run_of_glue(path: Path) -> None:
    """A cell that computes and then glues three values or more keeps its glue in a
    hidden cell of its own: a page shows the computation, not a list of glue calls."""
    nb = json.loads(path.read_text())
    shown = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and _trailing_glue("".join(c["source"])) >= 3
             and not {"remove-input", "remove-cell"} & set(
                 c.get("metadata", {}).get("tags", []))]
    assert not shown, f"{path.name}: cells {shown} end in three glue calls or more; " \
                      "move them to a remove-input cell after it"
