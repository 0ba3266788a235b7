"""What Chapter 13's page runs on ranks: everything it measures, in one launch.

The measuring itself is in the package: the machine's inputs
(:mod:`dtlib.planner.measure`), each strategy's step and a profiled step
(:mod:`dtlib.planner.timing`), the inputs that drift (:mod:`dtlib.planner.probe`).

Taught in: Chapter 13, "Where the time goes".
"""

from __future__ import annotations

from typing import Any

from dtlib.chapters.ch03_data_parallel.runs import record_timeline
from dtlib.planner.measure import machine_from, measure_machine
from dtlib.planner.timing import (BAND, BUCKET_CAP_MB, DATA_PARALLEL, TIME_GPT,
                                  compare, measure_overheads, profile_step,
                                  time_strategies, workload_of)

__all__ = ["TIME_GPT", "BUCKET_CAP_MB", "BAND", "DATA_PARALLEL",
           "measure_machine", "measure_overheads", "time_strategies", "profile_step",
           "machine_from", "workload_of", "compare", "chapter_run"]


def chapter_run(strategies: tuple[str, ...], traced: tuple[str, ...],
                trace_dir: str | None, steps: int = 1, rounds: int = 2
                ) -> dict[str, Any]:
    """On every rank: everything the page measures, in one launch.

    Returns:
        ``machine`` (:func:`measure_machine`; the GPT's own rate is the probes'),
        ``steps`` (:func:`time_strategies`,
        ``rounds`` times, the compute rate probed around each strategy's steps),
        ``traces`` (``{strategy: profile_step(...)}``) and ``timeline`` (Chapter 3's
        hand-made timeline of the overlapped DDP, same GPT and buckets).

    Taught in: Chapter 13 (the page's one launch).
    """
    # the GPT's own rate is what the probes beside the steps time (rank 0 alone)
    return {"machine": measure_machine(sizes=(2**12, 2**16, 2**20, 2**22),
                                       repeats=3),
            "steps": time_strategies(strategies, steps=steps, probe=True,
                                     rounds=rounds),
            "traces": {s: profile_step(s, trace_dir=trace_dir) for s in traced},
            "timeline": record_timeline(TIME_GPT, 4, BUCKET_CAP_MB, steps=2)}
