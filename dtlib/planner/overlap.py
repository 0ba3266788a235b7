"""Two streams, compute and communication: what hides and what is exposed.

A step is a list of compute chunks that run one after another (forward, the backward
of each bucket or unit, the optimizer) and a list of collectives that run one after
another on a second stream (NCCL's own stream and SMs on a GPU; gloo's thread on a
CPU). Two kinds of edge join them:

- a collective is *ready* when a compute chunk ends (a bucket's last gradient is
  accumulated; FSDP issues unit i+1's all-gather as unit i starts);
- a compute chunk *needs* a collective (a unit's forward needs its gathered
  parameters; the optimizer needs every averaged gradient).

:func:`two_streams` plays the two queues forward and returns when the step ends; the
exposed communication is that end minus the compute alone. With no second stream (on
one core, compute and gloo share it) the collectives simply add.

Taught in: Chapter 13, "An overlap rule per strategy".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Comm", "Timeline", "two_streams", "serial"]


@dataclass(frozen=True)
class Comm:
    """One collective on the communication stream.

    seconds: how long it takes once started (Chapter 2's alpha-beta time).
    ready_after: index of the compute chunk whose end releases it (-1: at time 0).
    needed_by: index of the compute chunk that waits for it (None: only the step's
        end waits).
    name: a label for tables and figures ("bucket 3", "all-gather unit 1").
    """

    seconds: float
    ready_after: int = -1
    needed_by: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ValueError(f"seconds={self.seconds!r} must be >= 0")
        if self.needed_by is not None and self.needed_by <= self.ready_after:
            raise ValueError(f"needed_by={self.needed_by} must come after "
                             f"ready_after={self.ready_after}: a chunk cannot wait "
                             "for a collective its own end releases")


@dataclass(frozen=True)
class Timeline:
    """When everything ran: ``(start, end)`` per compute chunk and per collective.

    end_s: the step's end (the last compute or collective to finish).
    compute_s: the compute chunks' seconds alone (no waiting).
    exposed_s: ``end_s - compute_s``, the communication nothing hid.
    """

    compute: list[tuple[float, float]]
    comms: list[tuple[float, float]]
    end_s: float
    compute_s: float

    @property
    def exposed_s(self) -> float:
        """Seconds of the step during which only communication ran."""
        return self.end_s - self.compute_s


def two_streams(compute: Sequence[float], comms: Sequence[Comm]) -> Timeline:
    """Play a compute stream and a communication stream, each in order.

    Args:
        compute: seconds of each compute chunk, in the order they run.
        comms: the collectives in the order the communication stream runs them;
            each must be ready no later than the chunk that needs it starts
            (``ready_after < needed_by``) and the list must respect readiness order
            where a chunk waits (a later-ready collective never blocks an earlier
            chunk's collective).
    Returns:
        The :class:`Timeline`.

    Taught in: Chapter 13, "An overlap rule per strategy".
    """
    if any(not c >= 0 for c in compute):
        raise ValueError(f"compute={list(compute)!r}: every chunk must be >= 0 s")
    for c in comms:
        if c.ready_after >= len(compute) or (c.needed_by is not None
                                              and c.needed_by >= len(compute)):
            raise ValueError(f"{c!r} refers to a chunk beyond the {len(compute)} "
                             "compute chunks")
    spans: list[tuple[float, float]] = []
    comm_spans: list[tuple[float, float]] = []
    comm_free = 0.0  # when the communication stream is next idle

    def run_comms_until(index: int) -> None:
        # run, in order, the collectives up to ``index`` (their inputs are known)
        nonlocal comm_free
        while len(comm_spans) <= index:
            c = comms[len(comm_spans)]
            ready = spans[c.ready_after][1] if c.ready_after >= 0 else 0.0
            start = max(ready, comm_free)
            comm_free = start + c.seconds
            comm_spans.append((start, comm_free))

    clock = 0.0
    for j, seconds in enumerate(compute):
        waits = [i for i, c in enumerate(comms) if c.needed_by == j]
        if waits:
            last = max(waits)
            if any(c.ready_after >= j for c in comms[:last + 1]):
                raise ValueError(f"chunk {j} waits for a collective queued behind one "
                                 "that its own end (or a later chunk) releases")
            run_comms_until(last)
            clock = max(clock, max(comm_spans[i][1] for i in waits))
        spans.append((clock, clock + seconds))
        clock += seconds
    run_comms_until(len(comms) - 1)
    end = max([clock] + [e for _, e in comm_spans])
    return Timeline(spans, comm_spans, end, float(sum(compute)))


def serial(compute: Sequence[float], comms: Sequence[Comm]) -> Timeline:
    """The same chunks with no second stream: each collective runs on the compute
    stream right after the chunk that releases it, so nothing hides.

    Taught in: Chapter 13, "When ranks outnumber cores".
    """
    order = sorted(range(len(comms)), key=lambda i: comms[i].ready_after)
    spans: list[tuple[float, float]] = []
    comm_spans: list[tuple[float, float] | None] = [None] * len(comms)
    clock, k = 0.0, 0
    while k < len(order) and comms[order[k]].ready_after < 0:
        i = order[k]
        comm_spans[i] = (clock, clock + comms[i].seconds)
        clock += comms[i].seconds
        k += 1
    for j, seconds in enumerate(compute):
        spans.append((clock, clock + seconds))
        clock += seconds
        while k < len(order) and comms[order[k]].ready_after == j:
            i = order[k]
            comm_spans[i] = (clock, clock + comms[i].seconds)
            clock += comms[i].seconds
            k += 1
    return Timeline(spans, [s for s in comm_spans if s is not None], clock,
                    float(sum(compute)))
