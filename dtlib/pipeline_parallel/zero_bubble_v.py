"""The V-shaped zero-bubble schedule (ZB-V, Qi et al., 2024, §6) as action lists, and
torch's V schedules' lists read beside ours.

Each of the ``p`` ranks holds two model chunks, placed in a V: chunk 0 of rank ``r``
is virtual stage ``r`` (down the V), chunk 1 is virtual stage ``2p - 1 - r`` (back up),
so the first and the last stage both sit on rank 0 and a micro-batch's loss is computed
where it entered. Every backward is split into B (the input gradient, which the
previous stage waits for) and W (the weight gradients, which nobody waits for).

:func:`zbv_order` writes one rank's action list in the paper's pattern; torch's
``ScheduleZBVZeroBubble`` builds the same pattern, and :func:`torch_orders` reads
torch's list into our form, so the two compare action by action and :func:`play_v`
times both on the ideal clock.

Taught in: Chapter 6, "The V: two chunks per rank".
"""

from __future__ import annotations

from typing import Any, Iterable

from dtlib.pipeline_parallel.interleaved import ChunkEvent, play_chunks
from dtlib.pipeline_parallel.schedules import in_flight_peak

__all__ = ["VAction", "v_stage", "zbv_order", "zbv_orders", "play_v",
           "v_in_flight_peak", "torch_orders", "step_time"]

VAction = tuple[str, int, int]  # ("F", "B" or "W", micro-batch, chunk 0 or 1)


def _check(n_ranks: int, n_microbatches: int, times: Iterable[tuple[str, float]]
           ) -> None:
    for name, v in (("n_ranks", n_ranks), ("n_microbatches", n_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    for name, t in times:
        if not t > 0:
            raise ValueError(f"{name}={t!r} must be positive")


def v_stage(rank: int, chunk: int, n_ranks: int) -> int:
    """The virtual stage of ``chunk`` (0 or 1) on ``rank`` in the V placement:
    ``rank`` going down, ``2p - 1 - rank`` coming back up.

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    if chunk not in (0, 1):
        raise ValueError(f"chunk={chunk!r} must be 0 or 1 (a V holds two chunks)")
    if not 0 <= rank < n_ranks:
        raise ValueError(f"rank={rank!r} must be in 0..{n_ranks - 1}")
    return rank if chunk == 0 else 2 * n_ranks - 1 - rank


def zbv_order(rank: int, n_ranks: int, n_microbatches: int) -> list[VAction]:
    """Rank ``rank``'s ZB-V action list, in the paper's pattern (Qi et al., 2024, §6,
    Figure 8), for equal F, B and W times.

    Phases, with ``p = n_ranks`` and ``r = rank``:

    1. warm-up: ``2(p - r) - 1`` forwards down the V (chunk 0); then ``r`` pairs of a
       forward coming back up (chunk 1) and one more going down; then ``p - r``
       chunk-1 micro-batches each run F, B, W at once (they are at the V's turn);
    2. steady: ``F0 B0 W0 F1 B1 W1`` until every micro-batch has entered and every
       chunk-0 forward has its chunk-1 forward (so each rank holds ``p`` whole-stage
       micro-batches at most, 1F1B's first stage's peak, on every rank);
    3. cool-down: the remaining B's first, ``r`` pairs of them (B0, B1), then ``p - r``
       with their chunk-0 W right after; the held W's (chunk 1, then chunk 0) fill
       the drain, as ZB-H1's do.

    The pattern is built for ``max(m, 2p - 1)`` micro-batches (a full V) and the
    actions of micro-batches past ``m`` are dropped.

    Args:
        rank: this rank, ``0 <= rank < p``.
        n_ranks: ranks in the pipeline, ``p`` (``2p`` virtual stages).
        n_microbatches: ``m``.
    Returns:
        ``[(kind, micro_batch, chunk), ...]``: F, B, W once per micro-batch and chunk.

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    _check(n_ranks, n_microbatches, ())
    if not 0 <= rank < n_ranks:
        raise ValueError(f"rank={rank!r} must be in 0..{n_ranks - 1}")
    p, r = n_ranks, rank
    n = max(n_microbatches, 2 * p - 1)
    f, b, w = [0, 0], [0, 0], [0, 0]  # next F, B, W micro-batch of each chunk
    order: list[VAction] = []

    def run(kind: str, chunk: int) -> None:
        count = {"F": f, "B": b, "W": w}[kind]
        order.append((kind, count[chunk], chunk))
        count[chunk] += 1

    for _ in range(2 * (p - r) - 1):
        run("F", 0)
    for _ in range(r):
        run("F", 1)
        run("F", 0)
    for _ in range(p - r):
        run("F", 1), run("B", 1), run("W", 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            run("F", 0)
        run("B", 0), run("W", 0)
        run("F", 1), run("B", 1), run("W", 1)
    for _ in range(r):
        run("B", 0), run("B", 1)
    for _ in range(p - r):
        run("B", 0), run("W", 0)
    while w[1] < b[1]:
        run("W", 1)
    while w[0] < b[0]:
        run("W", 0)
    return [a for a in order if a[1] < n_microbatches]


def zbv_orders(n_ranks: int, n_microbatches: int) -> list[list[VAction]]:
    """Every rank's :func:`zbv_order`. Taught in: Chapter 6, "The V"."""
    return [zbv_order(r, n_ranks, n_microbatches) for r in range(n_ranks)]


def play_v(orders: list[list[VAction]], t_fwd: float = 1.0, t_bwd: float = 1.0,
           t_w: float = 1.0) -> list[ChunkEvent]:
    """Play one V-placed action list per rank on the ideal clock: a chunk's F, B, W
    take half of ``t_fwd``, ``t_bwd``, ``t_w``; an action starts once its rank is free
    and its input exists (the previous virtual stage's F, the next one's B, its own F
    on the last stage, its own B for a W).

    Returns:
        Every rank's events (``stage`` is the rank, ``chunk`` the chunk). Raises
        ``RuntimeError`` when the lists deadlock.

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    p = len(orders)
    _check(max(p, 1), 1, (("t_fwd", t_fwd), ("t_bwd", t_bwd), ("t_w", t_w)))
    return play_chunks(orders, lambda r, c: v_stage(r, c, p), 2 * p,
                       {"F": t_fwd / 2, "B": t_bwd / 2, "W": t_w / 2})


def step_time(events: list[ChunkEvent]) -> float:
    """First start to last end over every rank. Taught in: Chapter 6, "The V"."""
    return max(e.end for e in events) - min(e.start for e in events)


def v_in_flight_peak(order: list[VAction]) -> float:
    """Most activations a rank holds along its V ``order``, in whole-stage
    micro-batches (a chunk's activations are half a stage's): an F adds a half, its W
    removes it.

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    return in_flight_peak([(kind, mb) for kind, mb, _ in order]) / 2


def torch_orders(pipeline_order: dict[int, list[Any]], n_ranks: int
                 ) -> list[list[VAction]]:
    """torch's ``pipeline_order`` (rank -> ``_Action``'s and ``None`` for an idle
    slot) as our V action lists: ``I`` (backward to the input) is our B, a full
    ``B`` (input and weights at once) becomes our B then W, DualPipeV's
    ``OVERLAP_F_B`` its F and B in turn, and the stage index becomes the chunk of
    :func:`v_stage`.

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    kinds = {"F": ["F"], "I": ["B"], "W": ["W"], "B": ["B", "W"]}
    out: list[list[VAction]] = []

    def compute(actions: list[Any]) -> Iterable[Any]:
        for action in actions:
            if action is None:
                continue
            name = getattr(action.computation_type, "value", action.computation_type)
            if name == "OVERLAP_F_B":  # DualPipeV: an F and a B run together
                yield from compute(list(action.sub_actions))
            else:
                yield name, action

    for r in range(n_ranks):
        mine: list[VAction] = []
        for name, action in compute(pipeline_order[r]):
            if name not in kinds:
                raise ValueError(f"rank {r}: action {action} is not a compute action "
                                 f"(one of {sorted(kinds)})")
            chunk = 0 if action.stage_index == r else 1
            if v_stage(r, chunk, n_ranks) != action.stage_index:
                raise ValueError(f"rank {r}: stage {action.stage_index} is not one of "
                                 f"its V stages {r}, {2 * n_ranks - 1 - r}")
            mine += [(k, action.microbatch_index, chunk) for k in kinds[name]]
        out.append(mine)
    return out
