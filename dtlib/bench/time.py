"""Step time: measured / predicted per strategy, on 2 and 4 gloo ranks, in one run.

``python -m dtlib.bench time [--world-sizes 2 4] [--rounds 3] [--steps 2] [--json P]``
measures the machine's inputs (matmul FLOP/s alone and with every rank busy, AdamW
seconds per parameter, a copy's seconds per byte, Chapter 2's alpha-beta fits, or a
collective's measured sizes where no line fits), then times every strategy of
``dtlib.planner.step_time.MODELLED`` on the same GPT, in one launch per world size.
The compute rate drifts on a shared or virtual machine, so the launch probes it after
every step (the GPT's own forward and backward, rank 0 alone and every rank at once,
AdamW's step, a copy, each collective on one message: the median of three calls), and
the pure step-time model prices each timed step with the probes just before and after
it, counting the small collectives the book's loop and ZeRO issue and what each
data-parallel strategy's machinery costs on a one-rank world, where no byte moves. The
launch goes through the strategies ``--rounds`` times; a row is one strategy and world
size: the median ratio measured / predicted over the rounds, its lowest and highest (the
spread), and the largest drift of the probes around its steps. Goal: every ratio within
0.75-1.33 on an idle machine.

Taught in: Chapter 13, "Predicted against measured".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from dtlib.planner.drift import summarize
from dtlib.planner.measure import machine_from, measure_machine
from dtlib.planner.timing import (BAND, TIME_GPT, compare, measure_overheads,
                                  time_strategies)
from dtlib.planner.step_time import MODELLED
from dtlib.planner.strategies import STRATEGIES
from dtlib.runtime import launch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench time``."""
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(MODELLED),
                        choices=MODELLED)
    parser.add_argument("--steps", type=int, default=2,
                        help="timed steps per strategy and round (median)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times through the strategies (median ratio, spread)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds")


def measure_and_time(strategies: tuple[str, ...], steps: int, rounds: int = 1,
                     probe: bool = False) -> dict[str, Any]:
    """On every rank: the machine's inputs, then every strategy's step (``rounds``
    times, with the compute rate probed around each where ``probe``)."""
    return {"machine": measure_machine(cfg=TIME_GPT),
            "steps": time_strategies(strategies, steps=steps, probe=probe,
                                     rounds=rounds)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per (strategy, world size): the median ratio over the rounds and
    its spread, in_band; prints the in-band count and the spread first."""
    if args.steps < 1 or args.rounds < 1 or any(n < 2 for n in args.world_sizes):
        raise ValueError(f"--steps={args.steps} and --rounds={args.rounds} must be "
                         f">= 1 and --world-sizes {args.world_sizes} each >= 2")
    skipped = {(name, n): why for n in args.world_sizes for name in args.strategies
               if (why := STRATEGIES[name].fits(TIME_GPT.n_layers, n)) is not None}
    if len(skipped) == len(args.world_sizes) * len(args.strategies):
        raise ValueError(
            f"--strategies {' '.join(args.strategies)} on --world-sizes "
            f"{' '.join(map(str, args.world_sizes))}: none can run: " + "; ".join(
                f"{name} on {n} ranks: {why}" for (name, n), why in skipped.items()))
    # what each data-parallel strategy's machinery costs where no byte moves
    overheads = launch.spawn(measure_overheads, 1, tuple(args.strategies),
                             rounds=args.rounds, timeout=args.timeout,
                             stream=False)[0]
    for (name, n), why in skipped.items():
        print(f"{name} on {n} ranks: not timed, {why}")
    runs = [launch.spawn(measure_and_time, n, tuple(args.strategies), args.steps,
                         args.rounds, True, timeout=args.timeout, stream=False)[0]
            for n in args.world_sizes]
    machine = dataclasses.replace(
        machine_from([r["machine"] for r in runs], cores=os.cpu_count()),
        overhead_s=overheads)
    print("machinery per step on one rank (ms): " + ", ".join(
        f"{k} {v * 1e3:.1f}" for k, v in overheads.items()))
    rows = compare([s for r in runs for s in r["steps"]], machine)
    records = summarize(rows, BAND)
    for r in records:
        r["per_round"] = " ".join(f"{x['ratio']:.2f}" for x in rows
                                  if (x["strategy"], x["world_size"]) ==
                                  (r["strategy"], r["world_size"]))
    inside = sum(r["in_band"] for r in records)
    worst = max(records, key=lambda r: r["spread"])
    print(f"{inside} of {len(records)} median ratios in {BAND[0]}-{BAND[1]} over "
          f"{args.rounds} rounds; widest spread {worst['spread']:.2f} "
          f"({worst['strategy']}, {worst['world_size']} ranks)")
    return records
