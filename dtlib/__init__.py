"""dtlib: the companion package of the book *Distributed Training, Proven*.

The packages follow the book (see the README's layout section for the import rule):
``runtime`` (the world, launching), ``models``, ``memory``, ``collectives``,
``data_parallel``, ``zero``, ``tensor_parallel``, ``pipeline_parallel``, ``precision``,
``accumulation``, ``checkpoint``, ``train``, ``parallel_nd`` and ``planner`` (several
dimensions at once, and choosing them); ``chapters`` holds what each page runs;
``exercises`` checks the learner; ``bench`` measures.

Nothing is imported here, so ``import dtlib`` stays cheap for every rank a launch
starts. In a notebook, ``%load_ext dtlib`` registers the ``%%torchrun`` and ``%%ranks``
cell magics.
"""

from __future__ import annotations

import os as _os
from typing import Any

__version__ = "0.1.0"

#: Set to 1 (the test suite does) and deprecated API that dtlib's own code calls is an
#: error in every process that imports dtlib: the test process, each notebook kernel,
#: every rank (see :mod:`dtlib.runtime.strict_warnings`).
STRICT_WARNINGS_ENV = "DTLIB_STRICT_WARNINGS"
if _os.environ.get(STRICT_WARNINGS_ENV) == "1":
    from dtlib.runtime import strict_warnings as _strict

    _strict.install()


def glued(name: str, fmt: str = "", where: str = "run the cells above") -> Any:
    """A prose number of a learner copy (:func:`dtlib.exercises.lab.glued`).

    Here so that the copies' ``{eval}`` roles reach it in one expression,
    ``__import__("dtlib").glued(...)``, which evaluates in any kernel.
    """
    from dtlib.exercises.lab import glued as lab_glued  # only when a copy asks

    return lab_glued(name, fmt, where)


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%%torchrun`` and ``%%ranks`` cell magics (``%load_ext dtlib``)."""
    from dtlib.runtime.magic import TorchrunMagics  # IPython: only in a notebook

    ipython.register_magics(TorchrunMagics)
