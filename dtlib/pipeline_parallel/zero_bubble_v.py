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

:func:`pipeline_step_v` runs the lists on the ranks of a process group, each rank
holding its two chunks; :func:`v_p2p_plan` orders its messages so that every pair of
ranks posts them in the same order (NCCL matches a pair's messages in order).

Taught in: Chapter 6, "The V: two chunks per rank".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.pipeline_parallel.interleaved import ChunkEvent, play_chunks
from dtlib.pipeline_parallel.schedules import StepResult, in_flight_peak
from dtlib.pipeline_parallel.zero_bubble import (DeferredW, backward_input,
                                                 backward_weight, weight_sites)
from dtlib.runtime.dist import sync, world

__all__ = ["VAction", "VMessage", "v_stage", "zbv_order", "zbv_orders", "play_v",
           "v_in_flight_peak", "torch_orders", "step_time",
           "v_messages", "v_p2p_plan", "pipeline_step_v"]

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


# ---- on ranks -----------------------------------------------------------------------

@dataclass(frozen=True)
class VMessage:
    """One point-to-point message of the V: ``what`` ("act" or "grad") of micro-batch
    ``mb`` for ``chunk`` of the receiving rank, between this rank and ``peer``;
    ``op`` is this rank's side ("send" or "recv")."""

    op: str
    what: str
    chunk: int
    mb: int
    peer: int

    @property
    def key(self) -> tuple[str, int, int]:
        return self.what, self.chunk, self.mb


def v_messages(rank: int, n_ranks: int, action: VAction
               ) -> tuple[VMessage | None, VMessage | None]:
    """``(what action receives, what it sends)`` on ``rank``: None where its input
    or output stays on the rank (the V's turn on rank ``p - 1``, the loss on rank 0,
    the inputs on rank 0) or where the action has none (a W).

    Down the V (chunk 0) activations go to ``rank + 1`` and gradients come back from
    it; up the V (chunk 1) activations go to ``rank - 1`` and gradients come from it.

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    kind, i, c = action
    p, r = n_ranks, rank
    if kind == "W":
        return None, None
    if kind == "F":
        src = (r - 1 if r > 0 else None) if c == 0 else (r + 1 if r < p - 1 else None)
        dst = (r + 1 if r < p - 1 else None) if c == 0 else (r - 1 if r > 0 else None)
        what = "act"
    else:  # B: gradients travel the other way
        src = (r + 1 if r < p - 1 else None) if c == 0 else (r - 1 if r > 0 else None)
        dst = (r - 1 if r > 0 else None) if c == 0 else (r + 1 if r < p - 1 else None)
        what = "grad"
    recv = None if src is None else VMessage("recv", what, c, i, src)
    send = None if dst is None else VMessage("send", what, c, i, dst)
    return recv, send


def _local_needs(rank: int, n_ranks: int, action: VAction) -> list[VAction]:
    """The actions of the same rank that ``action`` reads: its own F (a B), its own B
    (a W), and at the V's turn (rank ``p - 1``) chunk 0's F for chunk 1's F and chunk
    1's B for chunk 0's B."""
    kind, i, c = action
    turn = rank == n_ranks - 1
    if kind == "W":
        return [("B", i, c)]
    if kind == "F":
        return [("F", i, 0)] if c == 1 and turn else []
    return [("F", i, c)] + ([("B", i, 1)] if c == 0 and turn else [])


Item = tuple[str, Any]  # ("recv", VMessage), ("run", VAction) or ("send", VMessage)


def v_p2p_plan(orders: Sequence[Sequence[VAction]]) -> list[list[Item]]:
    """Every rank's program: its actions in order, each send posted right after the
    action that computed it, each receive posted when its sender posts the send.

    The programs are made by playing the lists in rounds: in a round each rank runs
    its next action if what it receives was sent in an earlier round (and what it
    reads locally has run); a send appends the matching receive to the receiver's
    program at that moment. So on every pair of ranks the receives are posted in the
    order of the sends (NCCL matches a pair's messages in order; gloo by order too,
    for one tag), and a rank's receive or send never waits behind an operation whose
    message depends on it: an operation posted in round ``t`` is matched by one posted
    in round ``t`` too (torch's ``_add_send_recv`` orders its V schedules' messages
    by the same rule).

    Args:
        orders: one V action list per rank (:func:`zbv_orders`, or torch's read by
            :func:`torch_orders`).
    Returns:
        ``[[("recv", VMessage) | ("run", VAction) | ("send", VMessage), ...], ...]``.
    Raises:
        RuntimeError: the lists deadlock (a round where no rank can run).

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    p = len(orders)
    sent: set[tuple[int, tuple[str, int, int]]] = set()  # (receiver, key)
    ran: list[set[VAction]] = [set() for _ in range(p)]
    pos = [0] * p
    programs: list[list[Item]] = [[] for _ in range(p)]
    while any(pos[r] < len(orders[r]) for r in range(p)):
        new: list[tuple[int, tuple[str, int, int]]] = []
        progressed = False
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            action = tuple(orders[r][pos[r]])
            recv, send = v_messages(r, p, action)
            if recv is not None and (r, recv.key) not in sent:
                continue  # sent in this round at the earliest: next round
            if any(a not in ran[r] for a in _local_needs(r, p, action)):
                continue
            programs[r].append(("run", action))
            ran[r].add(action)
            pos[r] += 1
            progressed = True
            if send is not None:
                programs[r].append(("send", send))
                programs[send.peer].append(
                    ("recv", VMessage("recv", send.what, send.chunk, send.mb, r)))
                new.append((send.peer, send.key))
        if not progressed:
            raise RuntimeError(f"the V lists deadlock at positions {pos}")
        sent.update(new)
    return programs


def pipeline_step_v(chunks: Sequence[nn.Module], inputs: torch.Tensor | None,
                    targets: torch.Tensor | None, *, n_microbatches: int,
                    act_shape: tuple[int, ...], loss_fn: Callable[..., torch.Tensor],
                    group: dist.ProcessGroup | None = None,
                    act_dtype: torch.dtype = torch.float32,
                    orders: Sequence[Sequence[VAction]] | None = None) -> StepResult:
    """Forward and backward of one batch through a V of ``2p`` chunks, ZB-V's lists
    by default; gradients accumulate in the chunks' parameters (the caller zeroes them
    and steps the optimizer).

    Rank ``r`` of ``group`` holds ``chunks = [chunk 0, chunk 1]``, virtual stages
    ``r`` and ``2p - 1 - r``; rank 0 feeds the inputs and computes the loss, each
    micro-batch's divided by ``n_microbatches``. Every backward is split into B (the
    input gradient now) and W (the weight gradients at the W of the list), as in
    :func:`~dtlib.pipeline_parallel.schedules.pipeline_step` for ZB-H1. Messages
    follow :func:`v_p2p_plan`: a receive is posted (``irecv``) where the plan puts
    it and waited for just before the action that reads it; a send is posted right
    after the action that computed it and waited for at the end of the step.

    Args:
        chunks: this rank's two chunks, down the V and back up.
        inputs, targets: the whole batch (rank 0 uses both; others ignore them).
        n_microbatches: ``m``; must divide the batch.
        act_shape: one micro-batch's activation, ``(micro_batch, seq, hidden)``.
        loss_fn: ``loss_fn(output, target) -> scalar`` on rank 0's chunk 1.
        group: the pipeline's process group (default: the world, or one process).
        act_dtype: dtype of the activations and gradients sent.
        orders: every rank's V list (default: :func:`zbv_orders`).
    Returns:
        A :class:`~dtlib.pipeline_parallel.schedules.StepResult` whose events are
        :class:`~dtlib.pipeline_parallel.interleaved.ChunkEvent`'s and whose
        ``peak_in_flight`` counts chunk activations (two make one whole-stage
        micro-batch, :func:`v_in_flight_peak`).

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    if dist.is_available() and dist.is_initialized():
        rank, p = dist.get_rank(group), dist.get_world_size(group)
    else:
        rank, p = 0, 1
    m = n_microbatches
    if len(chunks) != 2:
        raise ValueError(f"chunks has {len(chunks)} module(s); a V rank holds 2 "
                         "(down the V, back up)")
    orders = zbv_orders(p, m) if orders is None else orders
    if len(orders) != p:
        raise ValueError(f"orders has {len(orders)} list(s) for {p} ranks")
    if act_shape[0] < 1:
        raise ValueError(f"act_shape={act_shape!r}: micro-batch size must be >= 1")
    batch = m * act_shape[0]
    if rank == 0:
        for name, t in (("inputs", inputs), ("targets", targets)):
            if t is None or t.shape[0] != batch:
                got = None if t is None else t.shape[0]
                raise ValueError(
                    f"{name} has batch {got}; n_microbatches={m} times micro-batch "
                    f"{act_shape[0]} needs {batch} (n_microbatches must divide the "
                    "batch)")
    program = v_p2p_plan(orders)[rank]
    x_mbs = inputs.chunk(m) if rank == 0 else None
    y_mbs = targets.chunk(m) if rank == 0 else None

    def peer(s: int) -> int:
        return dist.get_global_rank(group, s) if group is not None else s

    device = world().device
    c10d = dist.distributed_c10d  # looked up now: a patched isend is seen
    posted: dict[tuple[str, int, int], tuple[torch.Tensor, list[dist.Work]]] = {}
    outgoing: dict[tuple[str, int, int], torch.Tensor] = {}
    local: dict[tuple[str, int, int], torch.Tensor] = {}  # the turn, on the rank
    sending: list[dist.Work] = []
    held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor, list]] = {}
    deferred: dict[tuple[int, int], DeferredW] = {}
    events: list[ChunkEvent] = []
    live = peak = w_bytes = w_peak = 0
    total_loss = torch.zeros((), device=device)
    if p > 1:
        dist.barrier(group=group)
    sync(device)
    t0 = time.perf_counter()

    def received(msg: VMessage) -> torch.Tensor:
        buf, works = posted.pop(msg.key)
        for work in works:
            work.wait()
        return buf

    for item, what in program:
        if item == "recv":
            buf = torch.empty(act_shape, dtype=act_dtype, device=device)
            works = dist.batch_isend_irecv(
                [dist.P2POp(c10d.irecv, buf, peer(what.peer), group)])
            posted[what.key] = (buf, works)
            continue
        if item == "send":
            sending += dist.batch_isend_irecv(
                [dist.P2POp(c10d.isend, outgoing.pop(what.key), peer(what.peer),
                            group)])
            continue
        kind, i, c = what
        recv, send = v_messages(rank, p, what)
        module = chunks[c]
        if kind == "F":
            if recv is not None:
                x = received(recv).requires_grad_(True)
            elif c == 0:  # rank 0, the V's top: the inputs
                x = x_mbs[i]
            else:  # the turn: chunk 0's output on this rank
                x = local.pop(("act", 1, i)).requires_grad_(True)
            sync(device)
            start = time.perf_counter() - t0
            with weight_sites(module) as sites:
                out = module(x)
            if rank == 0 and c == 1:  # the last virtual stage: the loss
                out = loss_fn(out, y_mbs[i]) / m
                total_loss += out.detach()
            sync(device)
            events.append(ChunkEvent(rank, "F", i, start, time.perf_counter() - t0, c))
            if send is not None:
                outgoing[send.key] = out.detach()
            elif not (rank == 0 and c == 1):
                local["act", 1, i] = out.detach()
            held[i, c] = (None if rank == 0 and c == 0 else x, out, sites)
            live += 1
            peak = max(peak, live)
        elif kind == "B":
            x, out, sites = held.pop((i, c))
            if recv is not None:
                grad = received(recv)
            elif rank == 0 and c == 1:
                grad = None  # out is the loss
            else:  # the turn: chunk 1's input gradient on this rank
                grad = local.pop(("grad", 0, i))
            sync(device)
            start = time.perf_counter() - t0
            x_grad, deferred[i, c] = backward_input(out, grad, x, sites)
            w_bytes += deferred[i, c].nbytes
            w_peak = max(w_peak, w_bytes)
            sync(device)
            events.append(ChunkEvent(rank, "B", i, start, time.perf_counter() - t0, c))
            if x is not None:
                # no gradient reached x (nothing after it trains): send zeros
                g = x_grad if x_grad is not None else torch.zeros_like(x)
                if send is not None:
                    outgoing[send.key] = g
                else:
                    local["grad", 0, i] = g
        else:  # W: the weight gradients B left for later
            sync(device)
            start = time.perf_counter() - t0
            w_bytes -= deferred[i, c].nbytes
            backward_weight(deferred.pop((i, c)))
            sync(device)
            events.append(ChunkEvent(rank, "W", i, start, time.perf_counter() - t0, c))
            live -= 1
    for work in sending:  # every send, at the end of the step
        work.wait()
    if p > 1:  # every rank reports the loss rank 0 computed
        dist.broadcast(total_loss, src=peer(0), group=group)
    return StepResult(total_loss.item(), events, peak, w_peak)
