"""Deprecated API called by dtlib's own code becomes an error (the test suite's rule).

torch attributes its deprecation warnings to its own wrappers (for example
``torch.distributed.c10d_logger`` for ``all_gather_into_tensor``), not to the caller,
so a ``warnings`` filter on the module ``dtlib`` never sees them. :func:`install`
wraps :func:`warnings.warn` instead: a ``FutureWarning`` or ``DeprecationWarning``
whose nearest caller outside torch and the standard library is a ``dtlib.*`` module is
raised as an exception, at that caller. Any other warning goes on as before.

``dtlib/__init__.py`` installs it in every process that imports dtlib when
``DTLIB_STRICT_WARNINGS=1`` (the root ``conftest.py`` sets it for the suite, so the
notebook kernels and every launched rank inherit it).

Taught in: nowhere; it guards the book's code (``tests/test_deprecations.py``).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

CATEGORIES = (FutureWarning, DeprecationWarning)
# Frames that only pass a warning on: torch's wrappers, the deprecation decorators,
# functools, contextlib, this module, and Chapter 2's communication log, which wraps
# every torch.distributed function and forwards each call as its caller made it.
_PASS_THROUGH = ("torch", "typing_extensions", "functools", "contextlib", "warnings",
                 __name__, "dtlib.collectives.accounting")
_original_warn = warnings.warn


def _caller_module(frame: Any) -> str:
    """The module of the nearest frame from ``frame`` outward that is not a wrapper."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("importlib") or frame.f_code.co_filename.startswith(
                "<frozen importlib"):
            return ""  # raised while a module was imported: the imported module's own
        if not any(name == p or name.startswith(p + ".") for p in _PASS_THROUGH):
            return name
        frame = frame.f_back
    return ""


def _strict_warn(message: Any, category: Any = None, stacklevel: int = 1,
                 *args: Any, **kwargs: Any) -> None:
    cat = category if category is not None else (
        type(message) if isinstance(message, Warning) else UserWarning)
    if isinstance(cat, type) and issubclass(cat, CATEGORIES):
        module = _caller_module(sys._getframe(1))
        if module == "dtlib" or module.startswith("dtlib."):
            raise (message if isinstance(message, Warning) else cat(
                f"{message} (called from {module}; deprecated API is an error in "
                "dtlib's own code)"))
    _original_warn(message, category, stacklevel + 1, *args, **kwargs)


def install() -> None:
    """Make deprecated API called from dtlib's own code an error in this process."""
    warnings.warn = _strict_warn
