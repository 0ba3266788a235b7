"""The course grader: ``python -m dtlib.exercises grade`` executes notebooks headless
and gives one row per exercise. On the book's notebook every exercise is correct, on
a fresh learner copy every one is not attempted, and on a copy with one wrong answer
exactly that one is wrong (one grading run for the three, in one folder).

The graded copies keep Chapter 0's prose, its first code cell (the imports) and its
exercise cells, and leave out its demonstrations (launches, a hang rehearsal): the
grader judges exercises, nbval runs the whole notebook already, and the three runs
would otherwise take most of a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from dtlib.exercises.strip import strip_tree

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "00_hello_distributed.ipynb"
RIGHT = "return world_size * (world_size + 1) / 2"
WRONG = "return world_size * (rank + 1)  # a plausible wrong answer"


def _grade(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtlib.exercises", "grade", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _exercises_only(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``nb`` with its prose, its first code cell and the cells that call a
    checker."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    nb.cells = [c for c in nb.cells if c.cell_type != "code" or c is code[0]
                or "check_" in c.source]
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    course = tmp_path_factory.mktemp("course")
    book = _exercises_only(nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4))
    nbformat.write(book, course / "book.ipynb")
    wrong = _exercises_only(nbformat.read(ROOT / "notebooks" / NOTEBOOK,
                                          as_version=4))
    cells = [c for c in wrong.cells if RIGHT in c.source]
    assert len(cells) == 1, "the solution this test edits moved"
    cells[0].source = cells[0].source.replace(RIGHT, WRONG)
    nbformat.write(wrong, course / "one_wrong.ipynb")
    fresh = tmp_path_factory.mktemp("fresh")
    strip_tree(str(ROOT / "notebooks"), str(fresh))
    nbformat.write(_exercises_only(nbformat.read(fresh / NOTEBOOK, as_version=4)),
                   course / "fresh.ipynb")
    return _grade(str(course), "--json"), course


def test_rows_per_notebook_say_what_a_teacher_needs(graded) -> None:
    result, course = graded
    rows = json.loads(result.stdout)
    by = {(Path(r["notebook"]).stem, r["exercise"]): r for r in rows}
    labels = ("ch0-ex-allreduce", "ch0-ex-count")
    assert sorted(by) == sorted((nb, lab) for nb in ("book", "fresh", "one_wrong")
                                for lab in labels)
    assert [by["book", lab]["status"] for lab in labels] == ["correct", "correct"]
    assert [by["fresh", lab]["status"] for lab in labels] == ["not attempted"] * 2
    assert by["one_wrong", "ch0-ex-allreduce"]["status"] == "wrong"
    assert "predict" in by["one_wrong", "ch0-ex-allreduce"]["feedback"]
    assert by["one_wrong", "ch0-ex-count"]["status"] == "correct"
    assert result.returncode == 1  # not every exercise is correct


def test_a_path_that_is_not_a_notebook_is_refused(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not a notebook")
    result = _grade(str(tmp_path / "notes.txt"))
    assert result.returncode == 2
    assert "PATH=" in result.stderr and "neither a notebook nor a folder" in \
        result.stderr
    assert "holds no notebook" in _grade(str(tmp_path)).stderr
