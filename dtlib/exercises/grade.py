"""``python -m dtlib.exercises grade PATH...``: grade learners' notebooks headless.

For a course: each notebook is executed from its first cell to its last in a fresh
kernel (nbclient, as JupyterLab would run it with "Run All"; multi-rank cells launch
their ranks exactly as they do there), and every exercise gets one row:

- ``correct``: its checker printed "Correct: ...";
- ``wrong``: its checker said "Not yet"; the row gives the first line of the feedback;
- ``not attempted``: the exercise still holds its stub;
- ``error``: the cell raised something else (or never ran), with the error's first line.

An exercise is a ``{exercise}`` block of the page (its ``:label:`` names the row); its
checker cells are the code cells after it that call a ``check_*`` function. A
notebook's cells run even after one fails (a wrong answer must not hide the next
exercise). PATH may be a notebook or a folder (every notebook below it, one folder per
student, say); ``--json`` prints the rows as JSON for a course's records. The exit
status is 0 when every exercise is correct, 1 otherwise.

nbgrader and otter-grader keep their own notebook formats; the JSON rows (``notebook``,
``exercise``, ``status``, ``feedback``) are what a gradebook import needs (one row per
student and exercise; ``correct`` is full marks).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from dtlib.runtime.i18n import LANGUAGES, _, speaking

# The checkers' verdict lines (dtlib.exercises.passed, not_attempted), in every
# language a learner copy may speak: the grader reads either.
_CORRECT = "Correct: {what}"
_NOT_ATTEMPTED = ("Not attempted yet: {name} still holds the stub. Write your answer "
                  "in place of `...` / `raise NotImplementedError`, then run the cell "
                  "again.")


def _prefixes(message: str, field: str) -> list[str]:
    """What ``message`` reads as before ``field`` in each language."""
    out = []
    for lang in LANGUAGES:
        with speaking(lang):
            out.append(_(message).split(field)[0])
    return out


def verdict_prefixes() -> tuple[list[str], list[str]]:
    """How a "Correct" line and a "Not attempted" line start, in every language the
    checkers speak (what a grader or the mutation harness looks for)."""
    return _prefixes(_CORRECT, "{what}"), _prefixes(_NOT_ATTEMPTED, "{name}")


__all__ = ["EXERCISE_LABEL", "Row", "STATUSES", "grade_notebook", "grade_paths", "main",
           "verdict_prefixes"]

STATUSES = ("correct", "wrong", "not attempted", "error")
#: An exercise block of a page and its label (group 1).
EXERCISE_LABEL = re.compile(r"```\{exercise\}[^\n]*\n(?::[^\n]*\n)*?:label:\s*(\S+)")
_CHECK_CALL = re.compile(r"^\s*(?:\w+\s*=\s*)?(?:[\w.]+\.)?check_\w+\(", re.M)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Row:
    """One exercise of one notebook: its status and the first line of feedback."""

    notebook: str
    exercise: str
    status: str
    feedback: str


def _first_line(text: str) -> str:
    text = _ANSI.sub("", text).strip()
    return text.splitlines()[0] if text else ""


def _verdict(cell: dict[str, Any]) -> tuple[str, str]:
    """The status a checker cell's outputs show, and the line that says so."""
    outputs = cell.get("outputs", [])
    for out in outputs:
        if out.get("output_type") == "error":
            if out.get("ename") == "WrongAnswer":
                what = str(out.get("evalue", "")).split(" Hint: ")[0]
                return "wrong", _first_line(what)
            return "error", _first_line(f"{out.get('ename')}: {out.get('evalue')}")
    text = "".join(
        "".join(out.get("text", "")) for out in outputs
        if out.get("output_type") == "stream" and out.get("name") == "stdout")
    for prefix in _prefixes(_NOT_ATTEMPTED, "{name}"):
        if prefix in text:
            line = next(x for x in text.splitlines() if prefix in x)
            rest = _first_line(line).split(prefix, 1)[1]
            return "not attempted", re.split(r"\. |。", rest)[0]
    for prefix in _prefixes(_CORRECT, "{what}"):
        if prefix in text:
            line = next(x for x in text.splitlines() if prefix in x)
            return "correct", _first_line(line)
    if cell.get("execution_count") is None:
        return "error", "the cell did not run"
    return "error", "the checker printed no verdict"


def _worst(verdicts: list[tuple[str, str]]) -> tuple[str, str]:
    order = {"error": 0, "wrong": 1, "not attempted": 2, "correct": 3}
    return min(verdicts, key=lambda v: order[v[0]])


def grade_notebook(path: str | Path, cell_timeout: float = 600.0,
                   kernel_name: str = "python3") -> list[Row]:
    """Execute one notebook in a fresh kernel and grade each of its exercises.

    Args:
        path: the notebook (a learner's copy or the book's).
        cell_timeout: seconds one cell may run before it counts as an error.
        kernel_name: the Jupyter kernel to start.
    Returns:
        One :class:`Row` per exercise that has a checker, in page order.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path={str(path)!r} is not a notebook file")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name=kernel_name,
                            allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except Exception as exc:  # the kernel died or a cell hung: grade what ran
        failure = _first_line(f"{type(exc).__name__}: {exc}")
    else:
        failure = ""
    verdicts: dict[str, list[tuple[str, str]]] = {}
    current = None
    for cell in nb.cells:
        source = cell.get("source", "")
        if cell.get("cell_type") == "markdown":
            found = EXERCISE_LABEL.search(source)
            if found:
                current = found.group(1)
            continue
        if cell.get("cell_type") == "code" and current and _CHECK_CALL.search(source):
            verdict = _verdict(cell)
            if failure and verdict == ("error", "the cell did not run"):
                verdict = ("error", failure)
            verdicts.setdefault(current, []).append(verdict)
    return [Row(str(path), label, *_worst(v)) for label, v in verdicts.items()]


def _notebooks(paths: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*.ipynb")
                              if ".ipynb_checkpoints" not in q.parts))
        elif p.suffix == ".ipynb" and p.is_file():
            out.append(p)
        else:
            raise ValueError(f"PATH={str(p)!r} is neither a notebook nor a folder")
    if not out:
        raise ValueError(f"PATH={list(paths)!r} holds no notebook")
    return out


def grade_paths(paths: Iterable[str], cell_timeout: float = 600.0) -> list[Row]:
    """Grade every notebook named or found below the folders named, in order."""
    return [row for nb in _notebooks(list(paths))
            for row in grade_notebook(nb, cell_timeout)]


def main(paths: list[str], as_json: bool = False, cell_timeout: float = 600.0) -> int:
    """Print one row per exercise; return the exit status (0: every one correct)."""
    rows = grade_paths(paths, cell_timeout)
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=1, ensure_ascii=False))
    else:
        width = max((len(r.exercise) for r in rows), default=8)
        for nb in dict.fromkeys(r.notebook for r in rows):
            print(nb)
            for r in (r for r in rows if r.notebook == nb):
                detail = f"  {r.feedback}" if r.status != "correct" else ""
                print(f"  {r.exercise:<{width}}  {r.status:<13}{detail}".rstrip())
        counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
        print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0 if rows and all(r.status == "correct" for r in rows) else 1
