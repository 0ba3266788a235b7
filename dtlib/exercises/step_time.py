"""Checkers for Chapter 13, "Where the time goes".

The truth is the chapter's overlap rule, played on two streams by
:func:`dtlib.planner.overlap.two_streams`, on cases beyond the page's: a prediction
that adds every bucket (no overlap) or takes the larger of compute and communication
(perfect overlap) fails on them, and says which rule it broke.
"""

from __future__ import annotations

from typing import Callable, Sequence

from dtlib.exercises import WrongAnswer, check_close, checker, passed
from dtlib.planner.overlap import Comm, two_streams


def _truth(forward_s: float, backward_s: float, buckets_s: Sequence[float]) -> float:
    k = len(buckets_s)
    chunks = [forward_s] + [backward_s / k] * k
    return two_streams(chunks, [Comm(c, ready_after=i + 1)
                                for i, c in enumerate(buckets_s)]).end_s


@checker
def check_overlapped_ddp(step_time: Callable[[float, float, Sequence[float]], float],
                         cases: tuple[tuple[float, float, tuple[float, ...]], ...] = (
                             (1.0, 2.0, (0.5, 0.5)), (1.0, 3.0, (2.0, 0.1, 0.1)),
                             (2.0, 4.0, (0.3, 0.3, 0.3, 0.3)), (0.5, 1.0, (3.0,)),
                             (1.0, 2.0, (0.2, 1.5)))) -> None:
    """Check ``step_time(forward_s, backward_s, buckets_s)``: the seconds from the
    forward's start until the last bucket's all-reduce ends, for the overlapped DDP on
    a GPU (communication beside compute): backward splits evenly into one chunk per
    bucket, bucket k may start when chunk k ends and the buckets travel one at a time,
    in order.

    Args:
        step_time: the learner's function.
        cases: ``(forward_s, backward_s, buckets_s)`` to try.
    Returns:
        None (prints "Correct" or raises :class:`WrongAnswer`).

    Taught in: Chapter 13, "An overlap rule per strategy".
    """
    for fwd, bwd, buckets in cases:
        got = step_time(fwd, bwd, list(buckets))
        where = f"forward {fwd} s, backward {bwd} s, buckets {list(buckets)}"
        want = _truth(fwd, bwd, buckets)
        if isinstance(got, (int, float)) and not isinstance(got, bool):
            if abs(got - (fwd + bwd + sum(buckets))) < 1e-9 * want < abs(
                    want - (fwd + bwd + sum(buckets))):
                raise WrongAnswer(f"{where}: you added every bucket after the "
                                  "backward; the overlapped DDP starts a bucket as "
                                  "soon as its gradients are ready")
            if abs(got - max(fwd + bwd, sum(buckets))) < 1e-9 * want < abs(
                    want - max(fwd + bwd, sum(buckets))):
                raise WrongAnswer(f"{where}: perfect overlap is too optimistic: a "
                                  "bucket cannot start before its gradients exist, "
                                  "and the last one starts when backward ends")
        check_close(where, got, want, rel=1e-9, hint=(
            "play the two queues: chunk k of the backward ends at forward + "
            "k * backward / K; bucket k starts at the later of that and the end of "
            "bucket k - 1"))
    passed(f"your timeline matches the overlap rule on {len(cases)} steps: only what "
           "the last buckets cannot hide is exposed")
