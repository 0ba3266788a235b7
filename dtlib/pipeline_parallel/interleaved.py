"""The interleaved 1F1B schedule (Narayanan et al. 2021, §2.2), simulated.

Each of the ``p`` ranks holds ``v`` model chunks instead of one stage: the model is cut
into ``p * v`` virtual stages and rank ``r`` runs virtual stages ``r, r + p, ...,
r + (v - 1) p``. A micro-batch visits every rank ``v`` times, each visit ``1/v`` of
the work, so the pipeline fills and drains ``v`` times faster: the bubble shrinks from
``(p - 1)/m`` to ``(p - 1)/(v m)`` of the ideal step time (more point-to-point
messages, ``v`` times as many, are the price).

:func:`interleaved_order` writes one rank's actions as Megatron-LM orders them;
:func:`simulate_interleaved` plays them on the ideal clock of Chapter 6's
:func:`~dtlib.pipeline_parallel.schedules.simulate`. torch ships the schedule as
``torch.distributed.pipelining.ScheduleInterleaved1F1B``.

Taught in: Chapter 12, "Interleaved pipeline schedules".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dtlib.pipeline_parallel.schedules import Event

__all__ = ["ChunkEvent", "interleaved_order", "interleaved_bubble",
           "simulate_interleaved", "play_chunks"]

ChunkAction = tuple[str, int, int]  # ("F", "B" or "W", micro-batch, model chunk)


@dataclass(frozen=True)
class ChunkEvent(Event):
    """An :class:`~dtlib.pipeline_parallel.schedules.Event` on rank ``stage`` that
    ran model chunk ``chunk`` (virtual stage ``chunk * p + stage``)."""

    chunk: int = 0


def _check(rank: int, n_stages: int, n_chunks: int, n_microbatches: int) -> None:
    for name, value in (("n_stages", n_stages), ("n_chunks", n_chunks),
                        ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if not 0 <= rank < n_stages:
        raise ValueError(f"rank={rank!r} must be in 0..{n_stages - 1}")
    if n_microbatches % n_stages:
        raise ValueError(f"n_microbatches={n_microbatches} must be divisible by "
                         f"n_stages={n_stages} (micro-batches enter in groups of p)")


def interleaved_order(rank: int, n_stages: int, n_chunks: int,
                      n_microbatches: int) -> list[ChunkAction]:
    """The actions rank ``rank`` runs under interleaved 1F1B, in order.

    Forwards go in groups of ``p`` micro-batches through chunk 0, then the same group
    through chunk 1, ...; backwards walk the chunks in reverse. Warm-up:
    ``2 (p - rank - 1) + (v - 1) p`` forwards, then one forward / one backward, then
    the remaining backwards (Megatron-LM ``forward_backward_pipelining_with_
    interleaving``).

    Args:
        rank: this rank, ``0 <= rank < p``.
        n_stages: ranks in the pipeline, ``p``.
        n_chunks: model chunks per rank, ``v`` (``v = 1`` is plain 1F1B).
        n_microbatches: ``m``, divisible by ``p``.
    Returns:
        ``[("F" or "B", micro_batch, chunk), ...]``, each pair once.

    Taught in: Chapter 12, "Interleaved pipeline schedules".
    """
    _check(rank, n_stages, n_chunks, n_microbatches)
    p, v, m = n_stages, n_chunks, n_microbatches
    total = m * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [("F", mb(k), chunk(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        k = warmup + i
        order += [("F", mb(k), chunk(k, True)), ("B", mb(i), chunk(i, False))]
    order += [("B", mb(i), chunk(i, False)) for i in range(total - warmup, total)]
    return order


def interleaved_bubble(n_stages: int, n_chunks: int, n_microbatches: int) -> float:
    """Bubble time over ideal compute time: ``(1/v) (p - 1)/m``.

    Narayanan et al. 2021, §2.2.2 (with ``v = 1`` it is 1F1B's ``(p - 1)/m``;
    Chapter 6's ``bubble_fraction`` is the same idle time over the *whole* step).

    Taught in: Chapter 12, "Interleaved pipeline schedules".
    """
    _check(0, n_stages, n_chunks, n_microbatches)
    return (n_stages - 1) / (n_chunks * n_microbatches)


def simulate_interleaved(n_stages: int, n_chunks: int, n_microbatches: int,
                         t_fwd: float = 1.0, t_bwd: float = 2.0) -> list[ChunkEvent]:
    """Play interleaved 1F1B on an ideal clock: a chunk's forward takes ``t_fwd / v``,
    its backward ``t_bwd / v`` (a chunk is ``1/v`` of a rank's layers), messages are
    free, and an action starts as soon as its rank is free and its input exists
    (the previous virtual stage's forward, the next one's backward).

    Returns:
        Every rank's events (``stage`` is the rank). A deadlocking order raises
        ``RuntimeError``.

    Taught in: Chapter 12, "Interleaved pipeline schedules".
    """
    p, v = n_stages, n_chunks
    orders = [interleaved_order(r, p, v, n_microbatches) for r in range(p)]
    return play_chunks(orders, lambda r, c: c * p + r, p * v,
                       {"F": t_fwd / v, "B": t_bwd / v})


def play_chunks(orders: list[list[ChunkAction]], stage_of: Callable[[int, int], int],
                n_virtual: int, length: dict[str, float]) -> list[ChunkEvent]:
    """Play one list of ``(kind, micro_batch, chunk)`` per rank on the ideal clock:
    an action takes ``length[kind]`` and starts once its rank is free and its input
    exists: an F the previous virtual stage's F, a B the next one's B (the last
    stage: its own F), a W its own B. ``stage_of(rank, chunk)`` places the chunks.

    Returns:
        Every rank's events. Raises ``RuntimeError`` when the lists deadlock.

    Taught in: Chapter 12, "Interleaved pipeline schedules"; Chapter 6, "The V".
    """
    p, last = len(orders), n_virtual - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> end
    free, pos = [0.0] * p, [0] * p
    events: list[ChunkEvent] = []
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, i, c = orders[r][pos[r]]
                vs = stage_of(r, c)
                if kind == "F":
                    dep = ("F", vs - 1, i) if vs > 0 else None
                elif kind == "W":
                    dep = ("B", vs, i)
                else:
                    dep = ("B", vs + 1, i) if vs < last else ("F", vs, i)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep else 0.0)
                done[kind, vs, i] = free[r] = start + length[kind]
                events.append(ChunkEvent(r, kind, i, start, free[r], c))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the orders deadlock at positions {pos}")
    return events
