"""Reading a profiler trace: which events are communication, which compute, and how
much of the step only communication filled.

On gloo the work of a collective runs on gloo's own threads (events ``gloo:all_reduce``,
``gloo:all_gather``, ...); the rank's thread records the call (``c10d::allreduce_``,
``c10d::_allgather_base_``, ...) and its compute (``aten::...``). NCCL's kernels appear
as ``nccl...`` device events. Pure functions of the event tuples
:func:`dtlib.planner.timing.profile_step` returns.

Taught in: Chapter 13, "Reading a trace".
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["COMM_PREFIXES", "is_comm", "comm_calls", "intervals", "union_length",
           "exposed_comm", "share_named"]

Event = tuple  # (name, thread, start_us, end_us)
#: Names of the events that are a collective's work (gloo's threads, NCCL kernels).
COMM_PREFIXES = ("gloo:", "nccl", "ncclDevKernel")


def is_comm(name: str) -> bool:
    """Whether an event named ``name`` is a collective's work (:data:`COMM_PREFIXES`).

    Taught in: Chapter 13, "Reading a trace".
    """
    return name.startswith(COMM_PREFIXES)


def comm_calls(events: Sequence[Event]) -> list[str]:
    """The collectives the rank's own thread called, in order (``c10d::`` names
    without their prefix and trailing underscores: ``allreduce``, ...)."""
    return [e[0].removeprefix("c10d::").strip("_") for e in
            sorted(events, key=lambda e: e[2]) if e[0].startswith("c10d::")]


def intervals(events: Sequence[Event], comm: bool) -> list[tuple[float, float]]:
    """Merged ``(start, end)`` spans of the communication events (``comm``) or of the
    compute (``aten::`` events on threads that run no communication)."""
    comm_threads = {e[1] for e in events if is_comm(e[0])}
    return _merge([(e[2], e[3]) for e in events
                   if (is_comm(e[0]) if comm else
                       e[0].startswith("aten::") and e[1] not in comm_threads)])


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, t in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    return [(s, t) for s, t in merged]


def share_named(events: Sequence[Event], part: str) -> float:
    """The fraction of the traced span covered by events whose name contains
    ``part`` (case-insensitive), e.g. FSDP2's ``all_gather_copy`` events."""
    if not events:
        raise ValueError("events is empty: nothing was traced")
    spans = _merge([(e[2], e[3]) for e in events if part.lower() in e[0].lower()])
    span = max(e[3] for e in events) - min(e[2] for e in events)
    return union_length(spans) / span if span else 0.0


def union_length(spans: Sequence[tuple[float, float]]) -> float:
    """Total length of merged spans."""
    return sum(t - s for s, t in spans)


def _minus(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
           ) -> float:
    """Length of the merged spans ``a`` not covered by the merged spans ``b``."""
    total, j = 0.0, 0
    for s, t in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < t:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < t:
            total += t - cur
    return total


def exposed_comm(events: Sequence[Event]) -> dict[str, float]:
    """How much of the traced span only communication filled.

    Returns:
        ``span_us`` (first to last event), ``comm_us`` (communication's merged
        spans), ``exposed_us`` (communication while no compute ran) and
        ``exposed_fraction`` = exposed_us / span_us.

    Taught in: Chapter 13, "Reading a trace".
    """
    if not events:
        raise ValueError("events is empty: nothing was traced")
    comm, compute = intervals(events, True), intervals(events, False)
    span = max(e[3] for e in events) - min(e[2] for e in events)
    exposed = _minus(comm, compute)
    return {"span_us": span, "comm_us": union_length(comm), "exposed_us": exposed,
            "exposed_fraction": exposed / span if span else 0.0}
