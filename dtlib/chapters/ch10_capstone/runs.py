"""Chapter 10's launches of the capstone that do not teach torchrun itself.

The chapter starts the script under ``torchrun`` where the launcher is the lesson;
where a cell only needs several runs of the script one after another (the Hugging Face
model crashed and resumed), one :func:`dtlib.runtime.launch.spawn` runs them all on
ranks that already exist, each as ``python -m dtlib.train ARGV`` would.

Taught in: Chapter 10, "A Hugging Face model".
"""

from __future__ import annotations

from typing import Sequence

from dtlib.train import loop

__all__ = ["run_script"]


def run_script(argvs: Sequence[Sequence[str]]) -> list[float]:
    """On every rank: the capstone's :func:`~dtlib.train.loop.main` for each argument
    list of ``argvs`` in turn, in the world the launcher started.

    Args:
        argvs: one list of command-line flags per run, as for ``python -m
            dtlib.train``.
    Returns:
        Each run's final global mean loss.

    Taught in: Chapter 10, "A Hugging Face model".
    """
    return [loop.main(list(argv)) for argv in argvs]
