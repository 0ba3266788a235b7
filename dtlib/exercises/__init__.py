"""Exercises: checkers that give feedback a learner can act on, and the learner
notebooks.

Each chapter's checkers live in a module named for the chapter's topic
(``dtlib.exercises.hello``, ``dtlib.exercises.memory``, ...) and are wrapped by
:func:`checker`, which gives every one the same manners:

- an untouched exercise (an answer still ``...``, or a function whose body still
  raises ``NotImplementedError``) is reported as "not attempted yet", and nothing is
  run;
- a right answer prints ``Correct: ...``;
- a wrong answer raises :class:`WrongAnswer`, which a notebook shows as a short message
  (no traceback, no checker source: IPython's ``_render_traceback_`` hook). Feedback
  escalates: the first wrong try says what is wrong, the next ones add a hint saying
  where to look. A closed-form answer's expected value is never shown.

Solutions in the book's notebooks sit between ``### BEGIN SOLUTION`` and
``### END SOLUTION``; ``python -m dtlib.exercises strip notebooks -o exercises`` writes
the learner's copies with each solution replaced by a stub.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import numbers
import os
import random
import textwrap
from typing import Any, Callable, Mapping, TypeVar

from dtlib.exercises.feedback import WrongAnswer
from dtlib.runtime.i18n import _

F = TypeVar("F", bound=Callable[..., Any])

#: Wrong tries per checker since its last success: the feedback escalates with them.
_ATTEMPTS: dict[str, int] = {}


class NotAttempted(Exception):
    """The exercise still holds its stub; raised inside a checker, caught by it."""


def passed(what: str) -> None:
    """Tell the learner an exercise is solved."""
    print(_("Correct: {what}").format(what=what))


def not_attempted(name: str) -> None:
    """Tell the learner an exercise is untouched; nothing was run."""
    print(_("Not attempted yet: {name} still holds the stub. Write your answer in "
            "place of `...` / `raise NotImplementedError`, then run the cell again."
            ).format(name=name))


def is_stub(fn: Callable[..., Any] | str) -> bool:
    """Whether ``fn`` (a function or its source) still has the exercise's stub body:
    its first statement after the docstring raises ``NotImplementedError``."""
    try:
        source = fn if isinstance(fn, str) else inspect.getsource(fn)
        tree = ast.parse(textwrap.dedent(source))
    except (OSError, TypeError, SyntaxError):
        return False
    defs = [n for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not defs:
        return False
    body = [s for s in defs[0].body
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _stub_in(args: tuple, kwargs: dict) -> str | None:
    for i, value in enumerate((*args, *kwargs.values())):
        if value is Ellipsis:
            return _("your answer")
        if (callable(value) and not isinstance(value, type)) or (
                isinstance(value, str) and value.lstrip().startswith("def ")):
            if is_stub(value):
                return (f"`{value.__name__}`" if callable(value) and
                        hasattr(value, "__name__") else _("your function"))
    return None


def checker(fn: F | None = None, *,
            forbids: Mapping[str, str] | None = None) -> Any:
    """Give a checker the common manners (see the module docstring).

    Used bare (``@checker``) or with what the exercise asks the learner to build
    (``@checker(forbids={"module:qualname": "why", ...})``).

    Args:
        fn: a ``check_*`` function that prints via :func:`passed` or raises
            :class:`WrongAnswer`.
        forbids: functions that raise :class:`~dtlib.exercises.tripwires.ShortcutTaken`
            while the learner's function runs (every alias, captured or not; on every
            rank it travels to): the book's own answer, torch's, the checker's truth.
    Returns:
        The wrapped checker: returns None when the exercise is untouched (after saying
        so), re-raises :class:`WrongAnswer` with the try count attached. A checker
        with a ``seed`` parameter draws its cases from it: the one given, else
        ``$DTLIB_EXERCISE_SEED``, else a fresh one, and a rejection names it.
    """
    if fn is None:
        return functools.partial(checker, forbids=forbids)
    signature = inspect.signature(fn)
    draws = "seed" in signature.parameters
    forbidden = dict(forbids or {})

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stub = _stub_in(args, kwargs)
        if stub is not None:
            return not_attempted(stub)
        seed = None
        if draws:
            bound = signature.bind_partial(*args, **kwargs)
            seed = bound.arguments.get("seed")
            seed = case_seed() if seed is None else seed
            bound.arguments["seed"] = seed
            args, kwargs = bound.args, bound.kwargs
        if forbidden:
            from dtlib.exercises.tripwires import guarded

            args = tuple(guarded(a, forbidden) if _learner_callable(a) else a
                         for a in args)
            kwargs = {k: guarded(v, forbidden) if _learner_callable(v) else v
                      for k, v in kwargs.items()}
        try:
            result = fn(*args, **kwargs)
        except NotAttempted as exc:
            return not_attempted(str(exc) or _("your answer"))
        except NotImplementedError:
            # The learner's function raised its stub while the checker called it.
            return not_attempted(_("your function"))
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is feedback
            from dtlib.exercises.tripwires import ShortcutTaken, shortcut_in

            shortcut = None if isinstance(exc, ShortcutTaken) else shortcut_in(str(exc))
            if shortcut is not None:
                exc = ShortcutTaken(shortcut)
            elif not isinstance(exc, WrongAnswer):
                raise
            if draws and not isinstance(exc, ShortcutTaken):
                exc = type(exc)(exc.what + _(
                    " (cases drawn with seed {seed}: {name}(..., seed={seed}) or "
                    "{variable}={seed} draws them again)").format(
                        seed=seed, name=fn.__name__, variable=SEED_VARIABLE), exc.hint)
            _ATTEMPTS[fn.__qualname__] = _ATTEMPTS.get(fn.__qualname__, 0) + 1
            exc.attempt = _ATTEMPTS[fn.__qualname__]
            # the checker's own name, code in every language (its words spelled
            # out read as English in a Chinese copy's feedback)
            exc.exercise = f"{fn.__name__}"
            raise exc.with_traceback(None) from None
        _ATTEMPTS.pop(fn.__qualname__, None)
        return result

    wrapper.forbids = forbidden  # type: ignore[attr-defined]
    return wrapper


def _learner_callable(value: Any) -> bool:
    """A function the learner wrote (not a class, not a string of source)."""
    return callable(value) and not isinstance(value, type)


#: Set to an integer to draw every checker's random cases from that seed (a learner
#: reproducing a rejection; the tests).
SEED_VARIABLE = "DTLIB_EXERCISE_SEED"


def case_seed() -> int:
    """The seed a checker draws its cases from when none is given: the integer in
    ``$DTLIB_EXERCISE_SEED``, else a fresh one.

    Taught in: every chapter's exercises (the checkers' one rule for drawn cases).
    """
    env = os.environ.get(SEED_VARIABLE, "").strip()
    try:
        return int(env) if env else random.SystemRandom().randrange(2 ** 32)
    except ValueError:
        raise ValueError(f"${SEED_VARIABLE}={env!r}: give an integer") from None


def run_on_ranks(on_rank: Callable[..., Any], learner_fn: Callable[..., Any],
                 world_size: int, *args: Any, timeout: float = 60.0,
                 what: str | None = None) -> list[Any]:
    """Run ``on_rank(learner_fn, *args)`` on ``world_size`` real ranks.

    ``learner_fn`` may be defined in a notebook cell: the closure that carries it is
    sent by value (:func:`dtlib.runtime.launch.spawn`). A rank that raises or a hang
    becomes a :class:`WrongAnswer` holding the launcher's report.

    Args:
        on_rank: an importable function that runs the learner's answer on one rank.
        learner_fn: the learner's function.
        world_size: ranks to start.
        timeout: seconds before a hang is reported.
        what: how to name the learner's code in messages (default "your code").
    Returns:
        Each rank's return value of ``on_rank``.
    """
    # loads torch on first use: this module imports without it
    from dtlib.runtime import launch

    what = _("your code") if what is None else what

    def rank_main() -> Any:
        return on_rank(learner_fn, *args)

    try:
        return launch.spawn(rank_main, world_size, timeout=timeout, stream=False)
    except launch.LaunchTimeout as exc:
        raise WrongAnswer(
            _("on {world_size} ranks {what} did not finish in {timeout:g} s. Where "
              "each rank was:").format(world_size=world_size, what=what,
                                       timeout=timeout)
            + "\n  " + "\n  ".join(exc.report),
            _("a rank waits for a message or a collective that its peer never sends or "
              "joins: compare the order of the calls on each rank")) from None
    except launch.LaunchError as exc:
        raise WrongAnswer(_("on {world_size} ranks {what} failed:").format(
            world_size=world_size, what=what) + f"\n{exc}") from None


def as_number(got: Any) -> float | None:
    """A learner's number as a float, however it is spelled, or None if it is none.

    Every ``numbers.Real`` counts (``int``, ``float``, an exact ``Fraction``, numpy's
    scalars such as ``np.int64`` and ``np.float32``), and a one-element tensor or
    array; a
    ``bool`` does not (``True`` is not an answer of 1).

    Taught in: every chapter's exercises (the checkers' one rule for numbers).
    """
    if isinstance(got, bool):  # numpy bools are not numbers.Real either
        return None
    if isinstance(got, numbers.Real):
        return float(got)
    if _is_scalar_tensor(got):
        return as_number(got.item())
    return None


def as_integer(got: Any) -> int | None:
    """A learner's integer as an int (any ``numbers.Integral``, numpy's included, a
    ``Fraction`` whose denominator is 1, a one-element integer tensor), else None.

    Taught in: every chapter's exercises (the checkers' one rule for counts).
    """
    if isinstance(got, bool):  # numpy bools are not numbers.Real either
        return None
    if isinstance(got, numbers.Integral):
        return int(got)
    if isinstance(got, numbers.Rational) and got.denominator == 1:
        return int(got.numerator)
    if _is_scalar_tensor(got):
        value = got.item()
        return as_integer(value) if not isinstance(value, float) else None
    return None


def _is_scalar_tensor(got: Any) -> bool:
    """A one-element torch tensor or numpy array (``.item()`` gives its number)."""
    import torch

    if isinstance(got, torch.Tensor):
        return got.numel() == 1
    return type(got).__name__ == "ndarray" and getattr(got, "size", 0) == 1


def check_close(name: str, got: Any, expected: float, *, rel: float = 1e-6,
                hint: str = "") -> None:
    """Raise :class:`WrongAnswer` unless ``got`` is a number within ``rel`` of
    ``expected``. The message says whether ``got`` is too large or too small, never
    the expected value: the learner derives it."""
    value = as_number(got)
    if value is None:
        raise WrongAnswer(_("{name}: expected a number, got {type} {got!r}").format(
            name=name, type=type(got).__name__, got=got))
    got = value
    if not math.isclose(got, expected, rel_tol=rel, abs_tol=0.0 if expected else 1e-12):
        if got > expected:
            raise WrongAnswer(_("{name}: got {got!r}, too large: expected a smaller "
                                "value.").format(name=name, got=got), hint)
        raise WrongAnswer(_("{name}: got {got!r}, too small: expected a larger "
                            "value.").format(name=name, got=got), hint)
