"""``python -m dtlib.exercises mutants [--chapter N]``: the checkers, mutation-tested.

A checker is a proof too: it must reject every answer that computes something else.
This module proves it the way test suites are proven. It takes each exercise's own
solution from the book's notebooks (the lines between ``### BEGIN SOLUTION`` and
``### END SOLUTION``), makes *mutants* of it (one small change each: an operator, a
constant, a slice bound, a ``ReduceOp``, one collective for another, a keyword dropped,
a dtype, a statement deleted), and runs the exercise's cell with each mutant in place
of the solution. A mutant is

- **killed** when the checker does not say "Correct" (it says "Not yet", the answer
  raises, or it hangs until the checker's timeout);
- **equivalent** when it survives and :data:`EQUIVALENTS_FILE` lists it with a
  one-line reason (a change that computes the same thing, such as ``<`` for ``<=``
  where the two are never equal);
- a **survivor** otherwise: a wrong answer the checker accepts, which is a defect of
  the checker.

Mutation tools for Python files (mutmut, cosmic-ray) cannot reach code that lives in a
notebook cell, so the mutants are AST transforms of the cell. Each mutant runs in a
worker process that imports what the notebook imported before the cell, as a learner's
kernel would have; a worker that hangs past ``timeout`` is stopped (with the ranks it
started) and a fresh one takes the next mutant.

``make test`` runs a fixed sample of mutants (``tests/test_mutants.py``); the full run
is a benchmark: ``python -m dtlib.exercises mutants`` prints, per exercise, how many
mutants there are, how many were killed, how many are equivalent, and every survivor.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dtlib.exercises.grade import EXERCISE_LABEL
from dtlib.exercises.strip import BEGIN, END

__all__ = ["EQUIVALENTS_FILE", "Exercise", "Mutant", "Outcome", "equivalents",
           "exercises", "main", "mutants_of", "run_mutants"]

#: Surviving mutants that compute the same thing as the solution, one per line:
#: ``label | key | reason``.
EQUIVALENTS_FILE = Path(__file__).with_name("equivalent_mutants.txt")

_CHAPTER = re.compile(r"^(\d+)_")


@dataclass(frozen=True)
class Exercise:
    """One checked exercise: the cell that holds its solution, and what ran before."""

    notebook: str
    chapter: int
    label: str
    cell: int
    setup: str          # the imports of the notebook's earlier code cells
    source: str         # the cell, solution included
    fences: tuple[tuple[int, int], ...]  # (BEGIN line, END line), 1-based


@dataclass(frozen=True)
class Mutant:
    """One change to one exercise's solution."""

    exercise: Exercise
    operator: str
    key: str            # where and what: "L3 `a + b` -> `a - b`" (line in the fence)
    source: str         # the cell with the change made


@dataclass
class Outcome:
    """What the checker said of one cell."""

    verdict: str        # "correct", "wrong", "error", "timeout", "not attempted"
    detail: str = ""
    seconds: float = 0.0


# --------------------------------------------------------------------- the exercises


def _imports(source: str) -> list[str]:
    """The top-level import statements of a code cell (magics and shell lines
    dropped), as source text."""
    text = "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return [ast.unparse(node) for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))]


def _fences(source: str) -> tuple[tuple[int, int], ...]:
    lines = source.splitlines()
    begins = [i + 1 for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i + 1 for i, line in enumerate(lines) if line.strip() == END]
    return tuple(zip(begins, ends))


def exercises(notebooks: str | Path = "notebooks",
              chapter: int | None = None) -> list[Exercise]:
    """Every exercise with a solution in the book's notebooks, in page order.

    Args:
        notebooks: the folder of the book's notebooks.
        chapter: only this chapter's exercises (None: all).
    """
    folder = Path(notebooks)
    if not folder.is_dir():
        raise ValueError(f"notebooks={str(folder)!r} is not a folder")
    out: list[Exercise] = []
    for path in sorted(folder.glob("*.ipynb")):
        number = _CHAPTER.match(path.name)
        if number is None or (chapter is not None and int(number.group(1)) != chapter):
            continue
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        label, setup = "", []
        for i, cell in enumerate(cells):
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                found = EXERCISE_LABEL.search(source)
                label = found.group(1) if found else label
                continue
            if cell["cell_type"] != "code":
                continue
            if BEGIN in source:
                out.append(Exercise(path.name, int(number.group(1)), label or
                                    f"{path.stem}-cell{i}", i, "\n".join(setup),
                                    source, _fences(source)))
            setup.extend(s for s in _imports(source) if s not in setup)
    return out


# ------------------------------------------------------------------------ the mutants

_BINOP_SWAPS = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div, ast.Add],
                ast.Div: [ast.Mult, ast.FloorDiv], ast.FloorDiv: [ast.Div, ast.Mult],
                ast.Mod: [ast.FloorDiv], ast.Pow: [ast.Mult], ast.BitXor: [ast.BitOr],
                ast.BitAnd: [ast.BitOr], ast.BitOr: [ast.BitAnd],
                ast.MatMult: [ast.Mult]}
_CMP_SWAPS = {ast.Lt: [ast.LtE, ast.Gt], ast.LtE: [ast.Lt, ast.GtE],
              ast.Gt: [ast.GtE, ast.Lt], ast.GtE: [ast.Gt, ast.LtE],
              ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.In: [ast.NotIn],
              ast.NotIn: [ast.In], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is]}
#: Names swapped for one another where they appear as a call or an attribute.
_NAME_SWAPS = {
    # ReduceOp members
    "SUM": ["MAX", "AVG"], "AVG": ["SUM"], "MAX": ["SUM", "MIN"], "MIN": ["MAX"],
    "PRODUCT": ["SUM"],
    # one collective for another with the same arguments
    "isend": ["irecv"], "irecv": ["isend"], "send": ["recv"], "recv": ["send"],
    "reduce_scatter_tensor": ["all_gather_into_tensor"],
    "reduce_scatter_single": ["all_gather_single"],
    "all_gather_into_tensor": ["reduce_scatter_tensor"],
    # reductions and their neighbours
    "sum": ["mean"], "mean": ["sum"], "max": ["min"], "min": ["max"],
    "any": ["all"], "all": ["any"], "logsumexp": ["amax"], "logaddexp": ["maximum"],
    "exp": ["exp2"], "sqrt": ["rsqrt"], "ceil": ["floor"], "floor": ["ceil"],
    "stack": ["cat"], "startswith": ["endswith"],
    # dtypes
    "float32": ["float64", "bfloat16"], "float64": ["float32"],
    "bfloat16": ["float16", "float32"], "float16": ["bfloat16", "float32"],
    "int64": ["int32"], "int32": ["int64"], "float": ["double"], "double": ["float"],
}


def _in_fence(node: ast.AST, fences: tuple[tuple[int, int], ...]) -> bool:
    lineno = getattr(node, "lineno", None)
    end = getattr(node, "end_lineno", lineno)
    return lineno is not None and any(b < lineno and end < e for b, e in fences)


def _docstring(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)) or (
        isinstance(node, ast.Constant) and isinstance(parent, ast.Expr))


def _changes(node: ast.AST, parents: dict[ast.AST, ast.AST]
             ) -> Iterator[tuple[str, ast.AST | None]]:
    """(operator, replacement) for every mutant of ``node`` itself: the replacement
    is a new node (None: delete the statement)."""
    if isinstance(node, ast.BinOp):
        for new in _BINOP_SWAPS.get(type(node.op), []):
            yield "binop", ast.BinOp(node.left, new(), node.right)
        if isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv)):
            yield "operand", copy.deepcopy(node.left)   # an operation dropped
    elif isinstance(node, ast.AugAssign):
        for new in _BINOP_SWAPS.get(type(node.op), []):
            yield "binop", ast.AugAssign(node.target, new(), node.value)
    elif isinstance(node, ast.IfExp):
        yield "ifexp", ast.IfExp(node.test, node.orelse, node.body)
    elif isinstance(node, ast.Compare) and len(node.ops) == 1:
        for new in _CMP_SWAPS.get(type(node.ops[0]), []):
            yield "compare", ast.Compare(node.left, [new()], node.comparators)
    elif isinstance(node, ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "boolop", ast.BoolOp(other, node.values)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub,
                                                                 ast.Invert)):
        yield "unary", copy.deepcopy(node.operand)
    elif isinstance(node, ast.Constant) and not _docstring(node, parents):
        value = node.value
        if isinstance(value, bool):
            yield "constant", ast.Constant(not value)
        elif isinstance(value, int):
            yield "constant", ast.Constant(value + 1)
            yield "constant", ast.Constant(value - 1)
        elif isinstance(value, float):
            yield "constant", ast.Constant(value * 2 if value else 1.0)
            yield "constant", ast.Constant(value / 2 if value else -1.0)
        elif isinstance(value, str) and value:
            yield "constant", ast.Constant(value[:-1])
    elif isinstance(node, ast.Slice):
        for part in ("lower", "upper"):
            bound = getattr(node, part)
            if bound is not None:
                for delta in (ast.Add(), ast.Sub()):
                    new = copy.deepcopy(node)
                    setattr(new, part, ast.BinOp(copy.deepcopy(bound), delta,
                                                 ast.Constant(1)))
                    yield "slice", new
    elif isinstance(node, ast.Attribute) and node.attr in _NAME_SWAPS:
        for name in _NAME_SWAPS[node.attr]:
            yield "name", ast.Attribute(node.value, name, node.ctx)
    elif isinstance(node, ast.Name) and node.id in ("max", "min", "sum", "any", "all",
                                                    "float", "int"):
        swaps = {"max": "min", "min": "max", "sum": "max", "any": "all", "all": "any",
                 "float": "int", "int": "float"}
        yield "name", ast.Name(swaps[node.id], node.ctx)
    elif isinstance(node, ast.Call):
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name == "all_reduce" and node.args:  # one rank's value for everyone's sum
            func = copy.deepcopy(node.func)
            setattr(func, "attr" if isinstance(func, ast.Attribute) else "id",
                    "broadcast")
            yield "collective", ast.Call(func, [node.args[0], ast.Constant(0)],
                                         [k for k in node.keywords if k.arg != "op"])
        # every keyword dropped in turn (stable=True, op=, group=, ...)
        for i in range(len(node.keywords)):
            if node.keywords[i].arg is not None:
                yield "keyword", ast.Call(node.func, node.args,
                                          node.keywords[:i] + node.keywords[i + 1:])
        if len(node.args) > 1:
            yield "argument", ast.Call(node.func, node.args[:-1], node.keywords)
    if isinstance(node, ast.stmt) and not isinstance(
            node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)) \
            and not _docstring(node, parents):
        yield "delete", None


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree)
            for child in ast.iter_child_nodes(node)}


def _replace(tree: ast.AST, target: ast.AST, new: ast.AST | None) -> None:
    """Put ``new`` where ``target`` is in ``tree`` (None deletes a statement: a
    body left empty gets ``pass``)."""
    for node in ast.walk(tree):
        for name, value in ast.iter_fields(node):
            if value is target:
                setattr(node, name, new)
                return
            if isinstance(value, list) and any(v is target for v in value):
                i = next(i for i, v in enumerate(value) if v is target)
                if new is None:
                    del value[i]
                    if not value and name in ("body", "finalbody"):
                        value.append(ast.Pass())
                else:
                    value[i] = new
                return
    raise LookupError("node not found")


def _short(node: ast.AST | None) -> str:
    if node is None:
        return "(deleted)"
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= 90 else text[:87] + "..."


def _what(node: ast.AST, new: ast.AST | None) -> str:
    """A change, for a learner to read: "`a + b` -> `a - b`", or for a dropped
    keyword "`f(...)` without `dtype=`"."""
    if isinstance(node, ast.Call) and isinstance(new, ast.Call) and \
            len(new.keywords) < len(node.keywords) and new.args == node.args:
        kept = {id(k) for k in new.keywords}
        gone = next(k.arg for k in node.keywords if id(k) not in kept)
        return f"`{_short(node.func)}(...)` without `{gone}=`"
    if isinstance(node, ast.Call) and isinstance(new, ast.Call) and \
            len(new.args) < len(node.args) and new.func is node.func:
        return (f"`{_short(node.func)}(...)` without its last argument "
                f"`{_short(node.args[-1])}`")
    return f"`{_short(node)}` -> `{_short(new)}`"


def _code_lines(source: str) -> str:
    """The cell without magics (blanked, so line numbers hold)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def mutants_of(exercise: Exercise) -> list[Mutant]:
    """Every mutant of one exercise's solution, in source order; each key is unique
    within the exercise."""
    text = _code_lines(exercise.source)
    tree = ast.parse(text)
    base = exercise.fences[0][0] if exercise.fences else 0
    targets = [n for n in ast.walk(tree) if _in_fence(n, exercise.fences)]
    parents = _parents(tree)
    out: list[Mutant] = []
    seen: dict[str, int] = {}
    for index, node in enumerate(targets):
        for operator, new in _changes(node, parents):
            clone = copy.deepcopy(tree)
            clone_targets = [n for n in ast.walk(clone)
                             if _in_fence(n, exercise.fences)]
            _replace(clone, clone_targets[index], new)
            ast.fix_missing_locations(clone)
            try:
                source = ast.unparse(clone)
                compile(source, "<mutant>", "exec")
            except (SyntaxError, ValueError, TypeError):
                continue
            key = f"L{node.lineno - base} " + _what(node, new)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                key = f"{key} #{seen[key]}"
            out.append(Mutant(exercise, operator, key, source))
    return out


def equivalents(path: Path = EQUIVALENTS_FILE) -> dict[tuple[str, str], str]:
    """The listed equivalent mutants: (label, key) -> reason."""
    out: dict[tuple[str, str], str] = {}
    if not path.is_file():
        return out
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) < 3 or not all(parts):
            raise ValueError(f"{path.name} line {n}: write `label | key | reason`, "
                             f"got {line!r}")
        out[(parts[0], " | ".join(parts[1:-1]))] = parts[-1]
    return out


# ------------------------------------------------------------------- running a cell

_WORKER = """
import contextlib, io, json, linecache, os, signal, sys, time, traceback
sys.path.insert(0, {root!r})
class Hang(BaseException):
    pass
def hang(signum, frame):
    raise Hang()
signal.signal(signal.SIGALRM, hang)
ns_setup = {{"__name__": "__main__"}}
exec(compile({setup!r}, "<setup>", "exec"), ns_setup)
import torch
umask = os.umask(0); os.umask(umask)
here = os.getcwd()
out = sys.stdout
for n, line in enumerate(sys.stdin):
    job = json.loads(line)
    name = "<mutant-%d>" % n
    linecache.cache[name] = (len(job["source"]), None,
                             job["source"].splitlines(True), name)
    ns = dict(ns_setup)
    buf = io.StringIO()
    start = time.monotonic()
    signal.alarm(max(1, int(job["timeout"])))
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(job["source"], name, "exec"), ns)
    except Hang:
        verdict = ("timeout", "no verdict in %d s" % job["timeout"])
    except BaseException as exc:
        kind = "wrong" if type(exc).__name__ == "WrongAnswer" else "error"
        detail = (str(exc) or type(exc).__name__).splitlines()[0][:200]
        if kind == "error":
            detail = type(exc).__name__ + ": " + detail
        verdict = (kind, detail)
    else:
        text = buf.getvalue()
        if any(p in text for p in {correct!r}):
            verdict = ("correct", "")
        elif any(p in text for p in {not_attempted!r}):
            verdict = ("not attempted", "")
        else:
            verdict = ("error", "no verdict printed")
    signal.alarm(0)
    os.umask(umask); os.chdir(here)
    torch.set_default_dtype(torch.float32); torch.set_grad_enabled(True)
    out.write(json.dumps([verdict[0], verdict[1], time.monotonic() - start]) + "\\n")
    out.flush()
"""


class _Worker:
    """A process that runs cells of one exercise, one at a time, in a fresh copy of
    the namespace the notebook's imports made."""

    def __init__(self, exercise: Exercise, cwd: str) -> None:
        root = str(Path(__file__).resolve().parents[2])
        from dtlib.exercises.grade import verdict_prefixes

        # the verdict lines in every language the checkers speak (DTLIB_LANG)
        correct, not_attempted = verdict_prefixes()
        code = _WORKER.format(root=root, setup=exercise.setup, correct=correct,
                              not_attempted=not_attempted)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, cwd=cwd, env=env,
            start_new_session=True)

    def run(self, source: str, timeout: float) -> Outcome:
        assert self.proc.stdin and self.proc.stdout
        start = time.monotonic()
        try:
            self.proc.stdin.write(json.dumps({"source": source, "timeout": timeout})
                                  + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return Outcome("error", "the worker died", 0.0)
        # the worker stops a hang itself (an alarm); this is for one it cannot stop
        line = _readline(self.proc, timeout + 60)
        if line is None:
            self.stop()
            return Outcome("timeout", f"no verdict in {timeout:g} s",
                           time.monotonic() - start)
        if not line:
            self.stop()
            return Outcome("error", "the worker died (a rank or the kernel crashed)",
                           time.monotonic() - start)
        verdict, detail, seconds = json.loads(line)
        return Outcome(verdict, detail, seconds)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Stop the worker and every rank it started (its whole session)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _readline(proc: subprocess.Popen, timeout: float) -> str | None:
    """One line from the worker, or None after ``timeout`` seconds."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    return proc.stdout.readline()


@dataclass
class Result:
    """One mutant's fate."""

    mutant: Mutant
    outcome: Outcome
    equivalent: str = ""   # the reason, when it survives and is listed

    @property
    def status(self) -> str:
        if self.outcome.verdict != "correct":
            return "killed"
        return "equivalent" if self.equivalent else "survived"


@dataclass
class Report:
    """The mutants of one exercise and their fates."""

    exercise: Exercise
    baseline: Outcome
    results: list[Result] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)


def run_mutants(exercise: Exercise, mutants: list[Mutant] | None = None, *,
                timeout: float = 60.0, known: dict[tuple[str, str], str] | None = None,
                progress: bool = False) -> Report:
    """Run the exercise's own solution, then each mutant, through its checker.

    Args:
        exercise: the exercise.
        mutants: which (default: all of :func:`mutants_of`).
        timeout: seconds one cell may run before it counts as a hang (killed).
        known: the listed equivalents (default: :func:`equivalents`).
        progress: print a dot per mutant to stderr.
    """
    mutants = mutants_of(exercise) if mutants is None else mutants
    known = equivalents() if known is None else known
    with tempfile.TemporaryDirectory(prefix="dtlib-mutants-") as cwd:
        worker = _Worker(exercise, cwd)
        try:
            report = Report(exercise, worker.run(exercise.source, timeout))
            for m in mutants:
                if not worker.alive():
                    worker = _Worker(exercise, cwd)
                outcome = worker.run(m.source, timeout)
                report.results.append(Result(m, outcome,
                                             known.get((exercise.label, m.key), "")))
                if progress:
                    print("." if outcome.verdict != "correct" else "S", end="",
                          file=sys.stderr, flush=True)
        finally:
            worker.stop()
    return report


def sample(mutants: list[Mutant], k: int, seed: int = 0) -> list[Mutant]:
    """A fixed sample of ``k`` mutants (all of them when there are fewer)."""
    if k >= len(mutants):
        return list(mutants)
    return sorted(random.Random(seed).sample(mutants, k),
                  key=lambda m: mutants.index(m))


def main(chapter: int | None = None, notebooks: str = "notebooks",
         label: str | None = None, limit: int | None = None, as_json: bool = False,
         timeout: float = 60.0) -> int:
    """Print the table; exit status 0 when no non-equivalent mutant survives and every
    exercise's own solution passes."""
    todo = [e for e in exercises(notebooks, chapter) if label in (None, e.label)]
    if chapter is not None and not todo:
        raise ValueError(f"--chapter={chapter}: no exercise there; chapters with "
                         "exercises: " + ", ".join(sorted(
                             {str(e.chapter) for e in exercises(notebooks)}, key=int)))
    if label is not None and not todo:
        raise ValueError(f"--exercise={label!r}: no such exercise; the labels are "
                         + ", ".join(e.label for e in exercises(notebooks, chapter)))
    known = equivalents()
    reports = []
    for ex in todo:
        ms = mutants_of(ex)
        if limit is not None:
            ms = sample(ms, limit)
        if not as_json:
            print(f"{ex.label} ({ex.notebook}, {len(ms)} mutants) ", end="",
                  file=sys.stderr, flush=True)
        report = run_mutants(ex, ms, timeout=timeout, known=known, progress=not as_json)
        if not as_json:
            print(file=sys.stderr)
        reports.append(report)
    bad = 0
    rows = []
    for r in reports:
        survivors = [x for x in r.results if x.status == "survived"]
        ok = r.baseline.verdict == "correct"
        bad += len(survivors) + (not ok)
        rows.append({"exercise": r.exercise.label, "notebook": r.exercise.notebook,
                     "solution": r.baseline.verdict, "mutants": len(r.results),
                     "killed": r.count("killed"), "equivalent": r.count("equivalent"),
                     "survived": [x.mutant.key for x in survivors],
                     "seconds": round(sum(x.outcome.seconds for x in r.results), 1)})
    if as_json:
        print(json.dumps(rows, indent=1))
        return 1 if bad else 0
    width = max([len(r["exercise"]) for r in rows] + [8])
    print(f"{'exercise':<{width}}  solution  mutants  killed  equivalent  survived")
    for row in rows:
        print(f"{row['exercise']:<{width}}  {row['solution']:<8}  {row['mutants']:>7}  "
              f"{row['killed']:>6}  {row['equivalent']:>10}  {len(row['survived']):>8}")
        for key in row["survived"]:
            print(f"{'':<{width}}    survived: {key}")
    total = {k: sum(r[k] for r in rows) for k in ("mutants", "killed", "equivalent")}
    print(f"{'total':<{width}}  {'':<8}  {total['mutants']:>7}  {total['killed']:>6}  "
          f"{total['equivalent']:>10}  {sum(len(r['survived']) for r in rows):>8}")
    return 1 if bad else 0
