"""The checkers, mutation-tested: a fixed sample of mutants of every exercise's own
solution must be rejected (``python -m dtlib.exercises mutants`` runs them all; it is
a benchmark, not a test, for its time)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dtlib.exercises import mutants as M

EXERCISES = M.exercises()
KNOWN = M.equivalents()
#: Mutants run per exercise in make test (drawn with a fixed seed from the ones not
#: listed as equivalent); the full run is `python -m dtlib.exercises mutants`.
SAMPLE = 1


def test_every_exercise_with_a_checker_is_found() -> None:
    labels = [e.label for e in EXERCISES]
    assert len(labels) == len(set(labels)), "two exercises share a label"
    assert {e.chapter for e in EXERCISES} == set(range(16))
    for e in EXERCISES:
        assert e.fences and "check_" in e.source, e.label


def test_mutants_are_distinct_and_of_every_kind() -> None:
    kinds: set[str] = set()
    for e in EXERCISES:
        ms = M.mutants_of(e)
        assert ms, f"{e.label}: no mutant"
        keys = [m.key for m in ms]
        assert len(keys) == len(set(keys)), f"{e.label}: two mutants share a key"
        assert all(m.source != e.source for m in ms)
        kinds |= {m.operator for m in ms}
    assert kinds >= {"binop", "compare", "constant", "slice", "name", "keyword",
                     "delete", "collective", "operand", "unary", "boolop"}


def test_every_listed_equivalent_is_a_mutant_of_today_and_gives_a_reason() -> None:
    by_label = {e.label: {m.key for m in M.mutants_of(e)} for e in EXERCISES}
    for (label, key), reason in KNOWN.items():
        assert label in by_label, f"{M.EQUIVALENTS_FILE.name}: no exercise {label}"
        assert key in by_label[label], (
            f"{M.EQUIVALENTS_FILE.name}: {label} has no mutant {key!r} any more; "
            "remove the line")
        assert len(reason.split()) >= 3, (label, key)


def test_a_checker_that_accepts_anything_lets_its_mutants_survive() -> None:
    # The harness can fail: a checker that always says Correct kills nothing.
    source = ("from dtlib.exercises import passed\n\n\ndef f(x):\n"
              f"    {M.BEGIN}\n    return 2 * x + 1\n    {M.END}\n\n\n"
              "passed('anything goes')\n")
    ex = M.Exercise("00_fake.ipynb", 0, "fake", 0, "", source, M._fences(source))
    report = M.run_mutants(ex, known={})
    assert report.baseline.verdict == "correct"
    assert report.results and all(r.status == "survived" for r in report.results)


#: Every other exercise runs in Chinese (a learner copy made with LANG=zh_CN): each
#: chapter's checkers judge in both languages, and a Chinese verdict is Chinese.
LANGS = {e.label: ("zh_CN" if i % 2 else "en") for i, e in enumerate(EXERCISES)}
_CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.mark.parametrize("exercise", EXERCISES,
                         ids=[f"{e.label}-{LANGS[e.label]}" for e in EXERCISES])
def test_the_solution_passes_and_a_sample_of_its_mutants_is_killed(
        exercise, monkeypatch) -> None:
    lang = LANGS[exercise.label]
    monkeypatch.setenv("DTLIB_LANG", lang)  # the worker and its ranks inherit it
    candidates = [m for m in M.mutants_of(exercise)
                  if (exercise.label, m.key) not in KNOWN]
    report = M.run_mutants(exercise, M.sample(candidates, SAMPLE), timeout=120,
                           known=KNOWN)
    assert report.baseline.verdict == "correct", (
        f"the book's own solution: {report.baseline.verdict} {report.baseline.detail}")
    survivors = [r.mutant.key for r in report.results if r.status == "survived"]
    assert not survivors, f"{exercise.label}: the checker accepts {survivors}"
    if lang == "zh_CN":  # the feedback of a wrong answer is in the copy's language
        for r in report.results:
            if r.outcome.verdict == "wrong":
                assert _CJK.search(r.outcome.detail), (exercise.label, r.outcome.detail)


def test_mutants_command_refuses_what_is_not_there() -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dtlib.exercises", "mutants",
                               *args], capture_output=True, text=True)

    out = run("--chapter", "99")
    assert out.returncode == 2 and "--chapter=99" in out.stderr
    out = run("--exercise", "ch2-ex-nope")
    assert out.returncode == 2 and "ch2-ex-allgather" in out.stderr
    out = run("--limit", "0")
    assert out.returncode == 2 and "--limit=0" in out.stderr
