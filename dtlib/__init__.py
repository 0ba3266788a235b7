"""dtlib: the companion package of the book *Distributed Training, Proven*.

Submodules are imported on first use (``dtlib.dist``, ``dtlib.launch``, ...), so that
``import dtlib`` stays cheap for every rank a launch starts.

In a notebook, ``%load_ext dtlib`` registers the ``%%torchrun`` cell magic.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = {
    "dist",
    "launch",
    "exercises",
    "bench",
    "memory",
    "models",
    "collectives",
    "data_parallel",
    "zero",
    "plots",
    "widgets",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"dtlib.{name}")
    raise AttributeError(f"module 'dtlib' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%%torchrun`` cell magic (``%load_ext dtlib``)."""
    from dtlib.magic import TorchrunMagics

    ipython.register_magics(TorchrunMagics)
