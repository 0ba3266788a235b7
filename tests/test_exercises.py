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


def _strip_cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "dtlib.exercises", "strip", *args],
                          capture_output=True, text=True, check=True).stdout


def test_strip_twice_keeps_the_learners_edit_and_force_overrides(tmp_path) -> None:
    src, dst = tmp_path / "nb", tmp_path / "ex"
    src.mkdir()
    nb = {"cells": [{"cell_type": "code", "source": SOLVED, "metadata": {},
                     "outputs": [], "execution_count": None}], "metadata": {},
          "nbformat": 4, "nbformat_minor": 5}
    (src / "a.ipynb").write_text(json.dumps(nb))
    (src / "b.ipynb").write_text(json.dumps(nb))
    _strip_cli(str(src), "-o", str(dst))
    mine = json.loads((dst / "a.ipynb").read_text())
    mine["cells"][0]["source"] = "def f(x):\n    return 2 * x  # my answer\n"
    (dst / "a.ipynb").write_text(json.dumps(mine))
    # The book changes; the learner's copy is kept, the untouched one is refreshed.
    nb["cells"][0]["source"] = SOLVED + "# new line from the book\n"
    (src / "a.ipynb").write_text(json.dumps(nb))
    (src / "b.ipynb").write_text(json.dumps(nb))
    out = _strip_cli(str(src), "-o", str(dst))
    assert "my answer" in (dst / "a.ipynb").read_text()
    assert "new line from the book" in (dst / "b.ipynb").read_text()
    assert "kept 1 notebook(s) you edited" in out and "a.ipynb" in out
    assert "--force" in out
    # A file the tool never wrote (no record) is not overwritten either.
    (dst / ".written.json").unlink()
    _strip_cli(str(src), "-o", str(dst))
    assert "my answer" in (dst / "a.ipynb").read_text()
    out = _strip_cli(str(src), "-o", str(dst), "--force")
    assert "my answer" not in (dst / "a.ipynb").read_text()
    assert "kept" not in out


def test_make_clean_leaves_exercises_alone() -> None:
    from pathlib import Path

    recipe = Path("Makefile").read_text().split("\nclean:")[1].split("\n\n")[0]
    assert "rm -rf _build" in recipe and "exercises" not in recipe


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
