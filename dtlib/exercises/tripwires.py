"""Tripwires: while a learner's function runs under a checker, what the exercise asks
them to build (the book's own version, torch's, the checker's truth) raises instead of
answering.

A tripwire replaces the *code* of the forbidden function, not a module attribute, so
it is reached from every alias: ``from m import f as g``, a reference captured before
the check, a bound method, a ``functools.partial``, a class's method looked up on an
instance. The code is put back when the learner's call returns, so the checker's own
truth (computed outside that call) still runs the real function. Built-in (C)
functions have no code to replace: for those the module attribute is patched, which an
alias captured earlier escapes; the exercises forbid none of those.

Inside a rank, a tripwire raises :class:`ShortcutTaken`; the launcher's report carries
its line to the checker, which shows that line alone (:func:`shortcut_in`).

Taught in: every chapter's exercises (the text of each says what it switches off).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
import types
from typing import Any, Callable, Iterator, Mapping

from dtlib.exercises.feedback import WrongAnswer
from dtlib.runtime.i18n import _, language

#: How a tripwire's message starts in a rank's traceback.
MARKER = "ShortcutTaken: "
_SENTINEL = 0x5D7A11  # the constant a tripwire's code raises, replaced by its class


class ShortcutTaken(WrongAnswer):
    """The learner's code called what the exercise asks them to build."""

    text = ""

    def __init__(self, message: str = "", hint: str = "") -> None:
        super().__init__(message or self.text,
                         hint or _("the exercise's text says what you may use; build "
                                   "the rest yourself"))


ShortcutTaken.__module__ = "dtlib.exercises"


def resolve(target: str) -> Callable[..., Any] | None:
    """The function ``"module:Qual.name"`` names, or None where this torch lacks it.

    A class names its ``__init__``; a static or class method, its function; an
    ``lru_cache``'d function, the function it wraps.
    """
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = (inspect.getattr_static(obj, part, None) if isinstance(obj, type)
               else getattr(obj, part, None))
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if obj is None:
            return None
    if isinstance(obj, type):
        obj = obj.__dict__.get("__init__")
    if not isinstance(obj, types.FunctionType) and isinstance(
            getattr(obj, "__wrapped__", None), types.FunctionType):
        if hasattr(obj, "cache_clear"):  # a cached answer would skip the tripwire
            obj.cache_clear()
        obj = obj.__wrapped__
    return obj if isinstance(obj, types.FunctionType) else None


def _raiser(fn: types.FunctionType, error: type[ShortcutTaken]) -> types.CodeType:
    """Code that raises ``error`` on any call, with ``fn``'s free variables (a
    function's code can only be swapped for code with as many)."""
    free = fn.__code__.co_freevars
    lines = ["def _outer():", *(f"    {name} = None" for name in free),
             "    def _tripwire(*args, **kwargs):"]
    if free:
        lines.append("        (" + ", ".join(free) + ",)")
    lines += [f"        raise {_SENTINEL}", "    return _tripwire"]
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)  # noqa: S102 - our own template
    code = namespace["_outer"]().__code__
    consts = tuple(error if type(c) is int and c == _SENTINEL else c
                   for c in code.co_consts)
    return code.replace(co_consts=consts, co_name=fn.__code__.co_name)


_LOCK = threading.RLock()
_ARMED: dict[int, list[Any]] = {}  # id(fn) -> [fn, its code, how many armed it]


@functools.lru_cache(maxsize=None)
def _error_for(target: str, why: str, lang: str) -> type[ShortcutTaken]:
    # lang: one class per language the message was made in (the cache's key)
    shown = target.replace(":", ".")
    return type("ShortcutTaken", (ShortcutTaken,), {
        "text": _("your code called `{shown}` ({why}): this exercise asks you to "
                  "write it yourself").format(shown=shown, why=_(why)),
        "__module__": "dtlib.exercises"})


@contextlib.contextmanager
def tripwires(forbidden: Mapping[str, str]) -> Iterator[None]:
    """While the block runs, each function ``forbidden`` names (``"module:qualname"``
    -> why it is forbidden) raises :class:`ShortcutTaken`, from wherever it is
    called. Nests: an inner block re-arms nothing and disarms nothing."""
    armed: list[types.FunctionType] = []
    with _LOCK:
        for target, why in forbidden.items():
            fn = resolve(target)
            if fn is None:
                continue
            entry = _ARMED.get(id(fn))
            if entry is None:
                _ARMED[id(fn)] = [fn, fn.__code__, 1]
                fn.__code__ = _raiser(fn, _error_for(target, why, language()))
            else:
                entry[2] += 1
            armed.append(fn)
    try:
        yield
    finally:
        with _LOCK:
            for fn in armed:
                entry = _ARMED[id(fn)]
                entry[2] -= 1
                if entry[2] == 0:
                    fn.__code__ = entry[1]
                    del _ARMED[id(fn)]


def guarded(fn: Callable[..., Any], forbidden: Mapping[str, str]) -> Callable[..., Any]:
    """``fn`` with :func:`tripwires` armed during each of its calls (and nowhere
    else). It travels to ranks by value, so the tripwires are armed there too."""
    forbidden = dict(forbidden)

    @functools.wraps(fn)
    def with_tripwires(*args: Any, **kwargs: Any) -> Any:
        with tripwires(forbidden):
            return fn(*args, **kwargs)

    return with_tripwires


def shortcut_in(text: str) -> str | None:
    """The tripwire's message in a rank's report (``text``), if one fired there."""
    at = text.rfind(MARKER)
    if at < 0:
        return None
    return text[at + len("ShortcutTaken: "):].splitlines()[0].strip()


def _shown(target: str) -> str | None:
    """How an exercise's text names a forbidden function (None: private to torch)."""
    module, _, qualname = target.partition(":")
    parts = qualname.split(".")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[-1].startswith("_") and not parts[-1].startswith("__"):
        return None
    if module.startswith("dtlib."):
        parts.insert(0, module.rsplit(".", 1)[-1])
    return ".".join(parts)


def allowed_sentence(forbidden: Mapping[str, str]) -> str:
    """The sentence an exercise's text carries about ``forbidden`` (a test holds each
    text to it): what the checker switches off while the learner's function runs."""
    names = list(dict.fromkeys(n for t in forbidden
                               if not t.startswith("dtlib.exercises")
                               and (n := _shown(t))))
    own = any(t.startswith("dtlib.exercises") for t in forbidden)
    items = [f"`{n}`" for n in names] + (["the checker's own truth"] if own else [])
    listed = (items[0] if len(items) == 1
              else ", ".join(items[:-1]) + " and " + items[-1])
    return ("Switched off while your function runs (they raise instead of answering): "
            f"{listed}.")
