"""Checkers for Chapter 6, "Pipeline parallel"."""

from __future__ import annotations

from typing import Callable

from dtlib.exercises import WrongAnswer, check_close, passed
from dtlib.pipeline_parallel.schedules import bubble_fraction, in_flight_peak, schedule_order

GRID = [(p, m) for p in (1, 2, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


def check_bubble_fraction(predict: Callable[[int, int], float]) -> None:
    """Check ``predict(n_stages, n_microbatches)``: the idle fraction of a GPipe step
    with equal stages (forward and backward times need not be equal)."""
    for p, m in GRID:
        check_close(f"bubble for p={p}, m={m}", predict(p, m), bubble_fraction(p, m),
                    rel=1e-9, hint="a stage is busy for m forward+backward slots out "
                    "of m + p - 1; the idle part is the rest")
    passed("your formula matches (p - 1) / (m + p - 1) on p in {1, 2, 4, 8}, "
           "m in {1, ..., 16}")


def check_1f1b_order(order: Callable[[int, int, int], list]) -> None:
    """Check ``order(stage, n_stages, n_microbatches)``: the list of ``("F", i)`` and
    ``("B", i)`` actions stage ``stage`` runs under 1F1B (PipeDream-Flush)."""
    for p, m in GRID:
        for s in range(p):
            want = schedule_order("1f1b", s, p, m)
            got = [tuple(a) for a in order(s, p, m)]
            if got != want:
                raise WrongAnswer(
                    f"stage {s} of p={p} with m={m}: expected {want}, got {got}. Hint: "
                    "stage s first runs min(p - s - 1, m) forwards (warm-up), then "
                    "alternates F of the next micro-batch and B of the oldest, then "
                    "runs the remaining backwards.")
    passed("your 1F1B order matches on every stage of p in {1, 2, 4, 8}")


def check_peak_in_flight(predict: Callable[[str, int, int, int], int]) -> None:
    """Check ``predict(schedule, stage, n_stages, n_microbatches)``: the most
    micro-batches whose activations stage ``stage`` holds at once."""
    for schedule in ("gpipe", "1f1b"):
        for p, m in GRID:
            for s in range(p):
                want = in_flight_peak(schedule_order(schedule, s, p, m))
                got = predict(schedule, s, p, m)
                if got != want:
                    raise WrongAnswer(
                        f"{schedule}, stage {s}, p={p}, m={m}: expected {want}, got "
                        f"{got!r}. Hint: GPipe runs every forward before any backward; "
                        "1F1B frees one micro-batch for each new one after its "
                        "warm-up.")
    passed("your peak in-flight counts match GPipe and 1F1B on every stage")
