"""The exercise machinery: stripping solutions, and the chapter-0 checker."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtlib.exercises import WrongAnswer, check_close
from dtlib.exercises.hello import check_all_reduce_prediction
from dtlib.exercises.strip import strip_notebook, strip_source

SOLVED = """def f(x):
    ### BEGIN SOLUTION
    y = x * 2
    return y
    ### END SOLUTION

check(f)
"""


def test_strip_replaces_the_solution_at_its_indentation() -> None:
    assert strip_source(SOLVED) == (
        "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError\n\ncheck(f)\n")


@pytest.mark.parametrize("bad, message", [
    ("### BEGIN SOLUTION\nx = 1\n", "without"),
    ("x = 1\n### END SOLUTION\n", "without"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "nested"),
])
def test_strip_rejects_unbalanced_markers(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        strip_source(bad)


def test_strip_command_writes_learner_notebooks(tmp_path) -> None:
    src = tmp_path / "nb"
    src.mkdir()
    nb = {"cells": [{"cell_type": "code", "source": SOLVED, "metadata": {},
                     "outputs": [{"output_type": "stream", "text": "x"}],
                     "execution_count": 3}], "metadata": {}, "nbformat": 4,
          "nbformat_minor": 5}
    (src / "ch.ipynb").write_text(json.dumps(nb))
    out = subprocess.run([sys.executable, "-m", "dtlib.exercises", "strip", str(src), "-o",
                          str(tmp_path / "ex")], capture_output=True, text=True, check=True)
    assert "ch.ipynb: 1 solution(s) removed" in out.stdout
    cell = json.loads((tmp_path / "ex" / "ch.ipynb").read_text())["cells"][0]
    assert "raise NotImplementedError" in cell["source"] and "x * 2" not in cell["source"]
    assert cell["outputs"] == [] and cell["execution_count"] is None


def test_every_book_notebook_strips_and_keeps_its_checkers() -> None:
    from pathlib import Path

    for path in sorted(Path("notebooks").glob("*.ipynb")):
        nb, count = strip_notebook(json.loads(path.read_text()))
        text = json.dumps(nb)
        assert "### BEGIN SOLUTION" not in text, path.name
        if count:
            assert "raise NotImplementedError" in text


def test_check_close_rejects_wrong_and_non_numbers() -> None:
    check_close("x", 2.0, 2.0)
    with pytest.raises(WrongAnswer, match="got 3.0, expected 2.0. Hint: h"):
        check_close("x", 3.0, 2.0, hint="h")
    with pytest.raises(WrongAnswer, match="expected a number"):
        check_close("x", "2", 2.0)


def test_all_reduce_checker_accepts_the_sum_and_rejects_the_own_value(capsys) -> None:
    check_all_reduce_prediction(lambda n, rank: n * (n + 1) / 2)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="world_size=2, rank=0: you predicted 1"):
        check_all_reduce_prediction(lambda n, rank: rank + 1)
