"""Checker for Chapter 13's trace exercise: find the exposed communication in a
profiler trace the checker records on real ranks.

The truth is :func:`dtlib.planner.trace.exposed_comm`: the merged spans of
the communication events (gloo's threads) not covered by the merged spans of the
compute (``aten::`` events on threads that run no communication). Hand-made traces
first, built so that each wrong reading lands far from the truth (the whole
communication time, its events summed, the compute time, the step's idle time), then
the recorded one.
"""

from __future__ import annotations

from typing import Callable, Sequence

from dtlib.exercises import WrongAnswer, as_number, checker, passed
from dtlib.planner.trace import exposed_comm, intervals, is_comm
from dtlib.runtime.i18n import N_, _

#: The strategy whose step the checker traces, and on how many gloo ranks.
TRACE_STRATEGY, TRACE_WORLD = "ddp/overlapped", 2

Event = tuple  # (name, thread, start_us, end_us), as profile_step returns them

#: Hand-made traces, in microseconds: compute on thread 1, gloo's work on 2 and 3.
HAND_TRACES: tuple[tuple[Event, ...], ...] = (
    # two gloo events that overlap each other, compute beside them, an idle gap
    (("aten::linear", 1, 0.0, 6_000.0), ("aten::mm", 1, 1_000.0, 5_000.0),
     ("c10d::allreduce_", 1, 1_500.0, 2_000.0),
     ("gloo:all_reduce", 2, 2_000.0, 8_000.0),
     ("c10d::allreduce_", 1, 3_000.0, 4_000.0),
     ("gloo:all_reduce", 3, 4_000.0, 12_000.0), ("aten::add_", 1, 9_000.0, 10_000.0),
     ("aten::mm", 1, 16_000.0, 20_000.0)),
    # one all-reduce that outlasts the compute
    (("aten::mm", 1, 0.0, 10_000.0), ("c10d::allreduce_", 1, 4_000.0, 5_000.0),
     ("gloo:all_reduce", 2, 5_000.0, 15_000.0), ("aten::add_", 1, 11_000.0, 12_000.0)),
    # nested compute and overlapping gloo events after a first, separate pair: a
    # merge that compares a span with the first merged span instead of the last
    # keeps overlapping spans apart and counts their time twice
    (("aten::add_", 1, 0.0, 1_000.0), ("gloo:all_reduce", 2, 500.0, 1_500.0),
     ("aten::linear", 1, 2_000.0, 6_000.0), ("aten::mm", 1, 3_000.0, 5_000.0),
     ("gloo:all_reduce", 2, 2_500.0, 7_000.0),
     ("gloo:all_reduce", 3, 4_000.0, 8_000.0)),
)


def band_us(events: Sequence[Event]) -> float:
    """How far a right answer may sit from the truth, in microseconds.

    The exposed time's ends are ends of merged communication or compute spans; a
    reader who rounds every event to the whole microsecond a trace viewer shows
    moves each end by at most half a microsecond, so the answer by at most one
    microsecond per merged span of either kind.
    """
    return float(len(intervals(events, True)) + len(intervals(events, False)))


def _wrong_readings(events: Sequence[Event]) -> list[tuple[float, str]]:
    comm = [e for e in events if is_comm(e[0])]
    compute = sum(t - s for s, t in intervals(events, False))
    span = exposed_comm(events)["span_us"]
    return [
        (exposed_comm(events)["comm_us"], _("that is all the communication: the "
                                            "part that ran under compute is hidden, "
                                            "not exposed")),
        (sum(e[3] - e[2] for e in comm), _("that sums the communication events: "
                                           "overlapping events count twice, and the "
                                           "part under compute is hidden")),
        (compute, _("that is the compute time, the other row of the trace")),
        (span - compute, _("that is all the time without compute, idle gaps with no "
                           "communication included"))]


def judge_exposed_comm(exposed_us: Callable[[list[Event]], float],
                       events: Sequence[Event], where: str) -> float:
    """The judging half of :func:`check_exposed_comm` on one trace; returns the
    truth, in microseconds.

    Taught in: Chapter 13, exercise ch13-ex-trace.
    """
    want, tol = exposed_comm(events)["exposed_us"], band_us(events)
    got = exposed_us(list(events))
    if as_number(got) is None:
        raise WrongAnswer(_("{where}: expected a number of microseconds, got {type} "
                            "{got!r}").format(
                              where=where, type=type(got).__name__, got=got))
    got = as_number(got)
    if abs(got - want) <= tol:
        return want
    for wrong, why in _wrong_readings(events):
        if abs(got - wrong) <= tol < abs(wrong - want) - tol:
            raise WrongAnswer(f"{where}: {why}")
    side = _("too large") if got > want else _(
            "too small")
    raise WrongAnswer(_("{where}: got {got!r} us, {side}").format(
                          where=where, got=got, side=side), hint=(
        _("merge the communication events' spans, merge the compute events' spans "
          "(aten:: on threads that run no communication), and measure what of the "
          "first the second does not cover")))


#: What ``check_exposed_comm`` switches off while the learner's function runs.
_EXPOSED_COMM_FORBIDS = {
    'dtlib.planner.trace:exposed_comm': N_("the checker's truth"),
    'dtlib.planner.trace:intervals': N_("the book's own trace reader"),
    'dtlib.planner.trace:union_length': N_("the book's own trace reader"),
    'dtlib.planner.trace:comm_calls': N_("the book's own trace reader"),
    'dtlib.planner.trace:share_named': N_("the book's own trace reader"),
}


@checker(forbids=_EXPOSED_COMM_FORBIDS)
def check_exposed_comm(exposed_us: Callable[[list[Event]], float]) -> None:
    """Check ``exposed_us(events) -> microseconds``: the communication no compute
    hid, in a trace's events ``(name, thread, start_us, end_us)``. Communication:
    the events of gloo's threads (names starting ``gloo:``, or ``nccl`` on a GPU);
    compute: the ``aten::`` events of threads that run no communication.

    It tries the hand-made traces of :data:`HAND_TRACES`, then records one step of
    the overlapped DDP on 2 gloo ranks with ``torch.profiler`` and judges the
    answer on rank 0's trace within :func:`band_us`.

    Taught in: Chapter 13, exercise ch13-ex-trace.
    """
    # loads torch on first use: this module imports without it
    from dtlib.runtime import launch

    for i, events in enumerate(HAND_TRACES):
        judge_exposed_comm(exposed_us, events, _("hand-made trace {n}").format(n=i + 1))
    events = launch.spawn(record_on_rank, TRACE_WORLD, timeout=300,
                          stream=False)[0]
    judge_exposed_comm(exposed_us, events, _("the recorded {strategy} step").format(
        strategy=TRACE_STRATEGY))
    got = exposed_comm(events)
    passed(_("in the recorded step {value:.1f} ms of {value2:.1f} ms of communication "
             "ran with no compute beside it, {got_exposed_fraction:.0%} of the traced "
             "{value3:.1f} ms").format(
               value=got['exposed_us'] / 1000.0, value2=got['comm_us'] / 1000.0,
               got_exposed_fraction=got['exposed_fraction'],
               value3=got['span_us'] / 1000.0))


def record_on_rank() -> list[Event]:
    """On every rank: one profiled step of :data:`TRACE_STRATEGY`, its events."""
    # loads torch on first use: this module imports without it
    from dtlib.planner.timing import profile_step

    return profile_step(TRACE_STRATEGY)["events"]
