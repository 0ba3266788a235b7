"""Checkers for Chapter 6, "Pipeline parallel"."""

from __future__ import annotations

from typing import Callable

from dtlib.exercises import WrongAnswer, check_close, checker, passed
from dtlib.pipeline_parallel.schedules import bubble_fraction, in_flight_peak, schedule_order

GRID = [(p, m) for p in (1, 2, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


@checker
def check_bubble_fraction(predict: Callable[[int, int], float]) -> None:
    """Check ``predict(n_stages, n_microbatches)``: the idle fraction of a GPipe step
    with equal stages (forward and backward times need not be equal)."""
    for p, m in GRID:
        check_close(f"bubble for p={p}, m={m}", predict(p, m), bubble_fraction(p, m),
                    rel=1e-9, hint="draw the GPipe timeline for p = 2 and m = 2 "
                    "and count the idle slots of one stage against its total "
                    "('The bubble')")
    passed("your formula matches the bubble on p in {1, 2, 4, 8}, m in {1, ..., 16}")


@checker
def check_1f1b_order(order: Callable[[int, int, int], list]) -> None:
    """Check ``order(stage, n_stages, n_microbatches)``: the list of ``("F", i)`` and
    ``("B", i)`` actions stage ``stage`` runs under 1F1B (PipeDream-Flush)."""
    for p, m in GRID:
        for s in range(p):
            want = schedule_order("1f1b", s, p, m)
            got = [tuple(a) for a in order(s, p, m)]
            if got != want:
                k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
                what = (f"action {k} is {got[k]}" if k < len(got) else
                        f"your list ends after {len(got)} actions")
                raise WrongAnswer(
                    f"stage {s} of p={p} with m={m}: {what}, and that is where it "
                    "leaves 1F1B" + ("" if len(got) == len(want) else
                                     f" ({len(got)} actions; 1F1B runs {len(want)})")
                    + ".", "how many forwards does stage s run before its first "
                    "backward can arrive from the last stage? After that warm-up, one "
                    "forward and one backward take turns ('Two schedules').")
    passed("your 1F1B order matches on every stage of p in {1, 2, 4, 8}")


@checker
def check_peak_in_flight(predict: Callable[[str, int, int, int], int]) -> None:
    """Check ``predict(schedule, stage, n_stages, n_microbatches)``: the most
    micro-batches whose activations stage ``stage`` holds at once."""
    for schedule in ("gpipe", "1f1b"):
        for p, m in GRID:
            for s in range(p):
                want = in_flight_peak(schedule_order(schedule, s, p, m))
                got = predict(schedule, s, p, m)
                if got != want:
                    side = "too many" if isinstance(got, (int, float)) and \
                        got > want else "not the right count"
                    raise WrongAnswer(
                        f"{schedule}, stage {s}, p={p}, m={m}: {got!r} is {side}.",
                        "GPipe runs every forward before any backward; 1F1B frees one "
                        "micro-batch for each new one after its warm-up "
                        "('Activation memory in flight').")
    passed("your peak in-flight counts match GPipe and 1F1B on every stage")
