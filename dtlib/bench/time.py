"""Step time: measured / predicted per strategy, on 2 and 4 gloo ranks, in one run.

``python -m dtlib.bench time [--world-sizes 2 4] [--steps 3] [--json PATH]`` measures
the machine's inputs (matmul FLOP/s alone and with every rank busy, AdamW seconds per
parameter, a copy's seconds per byte, Chapter 2's alpha-beta fits) and then the median
step of every strategy of ``dtlib.planner.step_time.STRATEGIES``, each on the same GPT,
in one launch per world size; each record is ``measured / predicted`` by the pure
step-time model with the machine's own inputs (the compute rate is the GPT's own forward
and backward on one rank alone, so the ratio prices what each strategy adds to one
process). Goal: every ratio within 0.75-1.33 on an idle machine.

Taught in: Chapter 13, "Predicted against measured".
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dtlib.chapters.ch13_time.runs import (BAND, TIME_GPT, compare, machine_from,
                                           measure_machine, time_strategies)
from dtlib.planner.step_time import STRATEGIES
from dtlib.runtime import launch

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench time``."""
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=STRATEGIES)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds")


def measure_and_time(strategies: tuple[str, ...], steps: int) -> dict[str, Any]:
    """On every rank: the machine's inputs, then every strategy's step."""
    return {"machine": measure_machine(cfg=TIME_GPT),
            "steps": time_strategies(strategies, steps=steps)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per (strategy, world size): measured, predicted, ratio, in_band."""
    if args.steps < 1 or any(n < 2 for n in args.world_sizes):
        raise ValueError(f"--steps={args.steps} must be >= 1 and --world-sizes "
                         f"{args.world_sizes} each >= 2")
    runs = [launch.spawn(measure_and_time, n, tuple(args.strategies), args.steps,
                         timeout=args.timeout, stream=False)[0]
            for n in args.world_sizes]
    machine = machine_from([r["machine"] for r in runs], cores=os.cpu_count())
    records = compare([s for r in runs for s in r["steps"]], machine)
    for r in records:
        r["in_band"] = BAND[0] <= r["ratio"] <= BAND[1]
    return records
