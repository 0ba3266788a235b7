"""Exercises: checkers that give feedback a learner can act on, and the learner notebooks.

Each chapter's checkers live in a module named for the chapter's topic
(``dtlib.exercises.hello``, ``dtlib.exercises.memory``, ...). A checker returns quietly
printing a confirmation when the answer is right, and raises :class:`WrongAnswer` with a
message that says what was expected and a hint when it is not. Every checker has a test
that shows it rejects a wrong answer.

Solutions in the book's notebooks sit between ``### BEGIN SOLUTION`` and
``### END SOLUTION``; ``python -m dtlib.exercises strip notebooks -o exercises`` writes the
learner's copies with each solution replaced by ``raise NotImplementedError``.
"""

from __future__ import annotations

import math
from typing import Any


class WrongAnswer(AssertionError):
    """The learner's answer is wrong; the message says how and what to try."""


def passed(what: str) -> None:
    """Tell the learner an exercise is solved."""
    print(f"Correct: {what}")


def check_close(name: str, got: Any, expected: float, *, rel: float = 1e-6,
                hint: str = "") -> None:
    """Raise :class:`WrongAnswer` unless ``got`` is a number within ``rel`` of ``expected``."""
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise WrongAnswer(f"{name}: expected a number, got {type(got).__name__} {got!r}")
    if not math.isclose(got, expected, rel_tol=rel, abs_tol=0.0 if expected else 1e-12):
        msg = f"{name}: got {got!r}, expected {expected!r}"
        raise WrongAnswer(msg + (f". Hint: {hint}" if hint else ""))
