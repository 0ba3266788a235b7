"""Pipeline parallelism, part 2: the schedules, GPipe and 1F1B, from scratch.

A schedule is, for each stage, an ordered list of actions ``("F", i)`` (forward of
micro-batch ``i``) and ``("B", i)`` (its backward). :func:`schedule_order` writes the
lists; :func:`simulate` plays them on an ideal clock (so we can draw the textbook
diagram and check the bubble formula); :func:`pipeline_step` runs them for real on the
ranks of a process group, sending activations forward and their gradients back with
point-to-point messages.

- GPipe (Huang et al., 2019): every stage runs all ``m`` forwards, then all ``m``
  backwards (in reverse). Stage s holds the activations of all ``m`` micro-batches.
- 1F1B, PipeDream-Flush (Narayanan et al., 2021): stage s runs ``p - s - 1`` warm-up
  forwards, then alternates one forward and one backward, then drains the backwards.
  Same bubble, but stage s never holds more than ``p - s`` micro-batches.

Both have the bubble fraction ``(p - 1) / (m + p - 1)`` of the step
(:func:`bubble_fraction`).

- ZB-H1 (Qi et al., 2024): 1F1B with each backward split into ``("B", i)``, the input
  gradient the previous stage waits for, and ``("W", i)``, the weight gradients
  (:mod:`dtlib.pipeline_parallel.zero_bubble`). Stage s runs 1F1B's warm-up, then
  ``F, B`` pairs with its first ``s`` W's held back, so the B's travel up the
  pipeline without waiting for a W; the held-back W's fill the drain. Every stage then
  holds at most ``p`` micro-batches (1F1B's peak, reached on stage 0 only in 1F1B),
  and the bubble shrinks to ``(p - 1)(t_F + t_B - t_W)`` (:func:`zb_h1_bubble`).

Taught in: Chapter 6, "GPipe", "1F1B" and "Splitting the backward".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.pipeline_parallel.zero_bubble import (DeferredW, backward_input,
                                                 backward_weight, weight_sites)
from dtlib.runtime.dist import sync, world

__all__ = ["SCHEDULES", "SPLIT_SCHEDULES", "Event", "StepResult", "schedule_order",
           "bubble_fraction", "zb_h1_bubble", "simulate", "play", "idle_fractions",
           "in_flight_peak", "w_waiting_peak", "P2P", "p2p_plan", "pipeline_step"]

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
#: the schedules whose backward is split into B (input gradient) and W (weights)
SPLIT_SCHEDULES = ("zb-h1",)
Action = tuple[str, int]


def _check(n_stages: int, n_microbatches: int, stage: int | None = None) -> None:
    for name, v in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if stage is not None and not 0 <= stage < n_stages:
        raise ValueError(f"stage={stage!r} must be in 0..{n_stages - 1}")


def schedule_order(schedule: str, stage: int, n_stages: int,
                   n_microbatches: int) -> list[Action]:
    """The actions stage ``stage`` runs, in order, under ``schedule``.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"zb-h1"``.
        stage: this stage's index ``s`` (0 = first).
        n_stages: pipeline depth ``p``.
        n_microbatches: micro-batches per step ``m``.
    Returns:
        A list of ``("F", i)`` / ``("B", i)`` (and for ``"zb-h1"`` ``("W", i)``)
        with every micro-batch once each.

    Taught in: Chapter 6, "GPipe", "1F1B" and "Splitting the backward".
    """
    _check(n_stages, n_microbatches, stage)
    m = n_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    if schedule == "1f1b":
        warmup = min(n_stages - stage - 1, m)
        order: list[Action] = [("F", i) for i in range(warmup)]
        for k in range(m - warmup):  # steady state: one forward, one backward
            order += [("F", warmup + k), ("B", k)]
        order += [("B", i) for i in range(m - warmup, m)]  # cool-down
        return order
    if schedule == "zb-h1":
        warmup = min(n_stages - stage - 1, m)
        order = [("F", i) for i in range(warmup)]
        w = 0  # the next W to run
        for k in range(m - warmup):  # steady state: F, B, and a W held back s slots
            order += [("F", warmup + k), ("B", k)]
            if k >= stage:
                order.append(("W", w))
                w += 1
        for k in range(m - warmup, m):  # cool-down: each B followed by a held-back W
            order.append(("B", k))
            order.append(("W", w))
            w += 1
        return order + [("W", i) for i in range(w, m)]  # the rest fill the drain
    raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")


def bubble_fraction(n_stages: int, n_microbatches: int) -> float:
    """Idle fraction of a GPipe or 1F1B step: ``(p - 1) / (m + p - 1)``.

    Each stage is busy ``m (t_f + t_b)`` out of ``(m + p - 1)(t_f + t_b)``: it waits
    ``p - 1`` slots while the pipeline fills and drains (Huang et al., 2019;
    Narayanan et al., 2021).

    Taught in: Chapter 6, "The bubble".
    """
    _check(n_stages, n_microbatches)
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


def zb_h1_bubble(n_stages: int, n_microbatches: int, t_fwd: float = 1.0,
                 t_bwd: float = 1.0, t_w: float = 1.0) -> float:
    """Idle fraction of a ZB-H1 step (Qi et al., 2024):
    ``(p - 1)(t_F + t_B - t_W) / (m (t_F + t_B + t_W) + (p - 1)(t_F + t_B - t_W))``,
    with ``t_B`` the input-gradient half of a backward and ``t_W`` the weight half.

    Each stage is busy ``m (t_F + t_B + t_W)``; the held-back W's fill ``t_W`` of each
    of 1F1B's ``p - 1`` idle slots. The simulation (:func:`simulate`) gives exactly
    this when ``m >= p`` and ``t_W <= min(t_F, t_B)`` (the paper's setting); a longer
    W, or fewer micro-batches than stages, leaves more idle than the formula says.

    Taught in: Chapter 6, "Splitting the backward".
    """
    _check(n_stages, n_microbatches)
    for name, v in (("t_fwd", t_fwd), ("t_bwd", t_bwd), ("t_w", t_w)):
        if not v > 0:
            raise ValueError(f"{name}={v!r} must be positive")
    if t_w > t_fwd + t_bwd:
        raise ValueError(f"t_w={t_w!r} is longer than t_fwd + t_bwd = "
                         f"{t_fwd + t_bwd!r}: the formula holds for t_w <= min(t_fwd, "
                         "t_bwd); simulate() gives the step for any times")
    idle = (n_stages - 1) * (t_fwd + t_bwd - t_w)
    return idle / (n_microbatches * (t_fwd + t_bwd + t_w) + idle)


@dataclass(frozen=True)
class Event:
    """One action on one stage: ``kind`` "F", "B" or "W", micro-batch ``mb``, seconds
    ``start`` and ``end`` from the start of the step (ideal units in
    :func:`simulate`)."""

    stage: int
    kind: str
    mb: int
    start: float
    end: float


def simulate(schedule: str, n_stages: int, n_microbatches: int, t_fwd: float = 1.0,
             t_bwd: float = 2.0, t_w: float = 0.0) -> list[Event]:
    """Play ``schedule`` on an ideal clock: each forward takes ``t_fwd``, each backward
    ``t_bwd + t_w``, messages are free, a stage starts an action as soon as its input
    exists. In a split schedule (``"zb-h1"``) a B takes ``t_bwd`` (the input
    gradient) and its W ``t_w`` (the weight gradients), after the B.

    Returns:
        Every stage's events (a deadlocking order raises ``RuntimeError``).

    Taught in: Chapter 6, "The bubble".
    """
    _check(n_stages, n_microbatches)
    orders = [schedule_order(schedule, s, n_stages, n_microbatches)
              for s in range(n_stages)]
    if schedule in SPLIT_SCHEDULES:
        return play(orders, t_fwd, t_bwd, t_w)
    return play(orders, t_fwd, t_bwd + t_w)


def play(orders: list[list[Action]], t_fwd: float = 1.0, t_bwd: float = 2.0,
         t_w: float = 0.0) -> list[Event]:
    """Play one action list per stage (``orders[s]`` for stage ``s``) on the ideal
    clock of :func:`simulate`: an F takes ``t_fwd``, a B ``t_bwd``, a W ``t_w``; a
    stage starts its next action as soon as its input exists (the previous stage's F,
    the next stage's B, its own F on the last stage, its own B for a W).

    Returns:
        Every stage's events. Raises ``RuntimeError`` when the orders deadlock: some
        stage waits for an action that cannot happen.

    Taught in: Chapter 6, "Splitting the backward".
    """
    n_stages = len(orders)
    length = {"F": t_fwd, "B": t_bwd, "W": t_w}
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * n_stages
    pos = [0] * n_stages
    events: list[Event] = []
    while any(pos[s] < len(orders[s]) for s in range(n_stages)):
        progressed = False
        for s in range(n_stages):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    dep = (s - 1, "F", i) if s > 0 else None
                elif kind == "W":
                    dep = (s, "B", i)
                else:
                    dep = (s + 1, "B", i) if s < n_stages - 1 else (s, "F", i)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep else 0.0)
                end = start + length[kind]
                done[s, kind, i] = free[s] = end
                events.append(Event(s, kind, i, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the orders deadlock at positions {pos}")
    return events


def idle_fractions(events: list[Event], n_stages: int) -> list[float]:
    """Per stage: 1 - (time busy) / (step time), the step being first start to last end
    over all stages. Taught in: Chapter 6, "The bubble"."""
    t0 = min(e.start for e in events)
    total = max(e.end for e in events) - t0
    busy = [0.0] * n_stages
    for e in events:
        busy[e.stage] += e.end - e.start
    return [1.0 - b / total for b in busy]


def in_flight_peak(order: list[Action]) -> int:
    """Most micro-batches whose forward has run and backward has not, along ``order``:
    the number of micro-batches' activations the stage must keep at once. In a split
    schedule a micro-batch is held until its W (W needs the saved activations).

    Taught in: Chapter 6, "Activation memory" and "Splitting the backward"."""
    split = any(kind == "W" for kind, _ in order)
    live = peak = 0
    for kind, _ in order:
        if kind == "F":
            live += 1
        elif kind == "W" or not split:
            live -= 1
        peak = max(peak, live)
    return peak


def w_waiting_peak(order: list[Action]) -> int:
    """Most micro-batches whose B has run and W has not, along a split ``order``: how
    many deferred W's (their output gradients) the stage holds at once.

    Taught in: Chapter 6, "Splitting the backward"."""
    waiting = peak = 0
    for kind, _ in order:
        waiting += (kind == "B") - (kind == "W")
        peak = max(peak, waiting)
    return peak


@dataclass(frozen=True)
class P2P:
    """One point-to-point message of a step, seen from the stage that issues it.

    op: ``"send"`` or ``"recv"``; what: ``"act"`` (forward activation) or ``"grad"``
    (its gradient, going back); mb: the micro-batch; peer: the other stage's index.
    """

    op: str
    what: str
    mb: int
    peer: int


def p2p_plan(schedule: str, stage: int, n_stages: int,
             n_microbatches: int) -> list[tuple[tuple[P2P, ...], Action | None]]:
    """The messages stage ``stage`` exchanges, batched as NCCL needs them.

    A blocking send may wait until the peer has posted the matching receive, on gloo
    as on NCCL (gloo's TCP pair transmits once the receiver has posted its buffer, and
    ``dist.send`` is ``isend`` + ``wait``). If two stages both block in a send to each
    other (1F1B, p = 2: stage 0 sends activation 1 while stage 1 sends gradient 0)
    neither ever receives: a deadlock, on either backend.
    So, as torch's ``Schedule1F1B`` does, each action's outgoing message is not sent
    alone: it is issued in one ``batch_isend_irecv`` with the receive the *next*
    action needs (forward-send with backward-receive, backward-send with the next
    forward-receive). Its receive is waited for before ``action`` runs, its send only
    after: the send is in flight while ``action`` computes, and done before the next
    batch is issued, as ``Schedule1F1B`` waits its warm-up and cool-down sends (its
    fused batches it waits for whole).

    Args:
        schedule, stage, n_stages, n_microbatches: as :func:`schedule_order`.
    Returns:
        ``[(batch, action), ...]``: issue ``batch`` (possibly empty), wait for its
        receive, run ``action``, then wait for its send; the last entry has action
        ``None`` (the final sends, waited at the end of the step).

    Taught in: Chapter 6, "Sends that cannot deadlock".
    """
    first, last = stage == 0, stage == n_stages - 1
    plan: list[tuple[tuple[P2P, ...], Action | None]] = []
    pending: tuple[P2P, ...] = ()  # the previous action's outgoing message
    for kind, i in schedule_order(schedule, stage, n_stages, n_microbatches):
        if kind == "W":  # weight gradients: no message; a pending send flies over it
            plan.append((pending, (kind, i)))
            pending = ()
        elif kind == "F":
            recv = () if first else (P2P("recv", "act", i, stage - 1),)
            plan.append((pending + recv, (kind, i)))
            pending = () if last else (P2P("send", "act", i, stage + 1),)
        else:
            recv = () if last else (P2P("recv", "grad", i, stage + 1),)
            plan.append((pending + recv, (kind, i)))
            pending = () if first else (P2P("send", "grad", i, stage - 1),)
    plan.append((pending, None))
    return plan


def _split_works(batch: tuple[P2P, ...],
                 works: list[dist.Work]) -> tuple[list[dist.Work], list[dist.Work]]:
    """The works of one ``batch_isend_irecv``, split into (wait before the next
    compute, wait after it). Gloo returns one work per operation: the receives' go
    before, the sends' after. NCCL coalesces the batch into one work: waited before
    the compute, send and all, when the batch has a receive, else after."""
    if len(works) == len(batch):
        return ([w for msg, w in zip(batch, works) if msg.op == "recv"],
                [w for msg, w in zip(batch, works) if msg.op == "send"])
    if any(msg.op == "recv" for msg in batch):
        return list(works), []
    return [], list(works)


@dataclass
class StepResult:
    """What :func:`pipeline_step` returns on each stage.

    loss: the step's loss (mean over micro-batches), the same on every stage.
    events: this stage's measured forward/backward intervals (seconds from a barrier).
    peak_in_flight: most micro-batches held at once (forward done, backward not; in a
    split schedule, W not).
    w_bytes_peak: in a split schedule, the most bytes of output gradients held at once
    for deferred W's (:attr:`~dtlib.pipeline_parallel.zero_bubble.DeferredW.nbytes`).
    """

    loss: float
    events: list[Event] = field(default_factory=list)
    peak_in_flight: int = 0
    w_bytes_peak: int = 0


def pipeline_step(stage_module: nn.Module, inputs: torch.Tensor | None,
                  targets: torch.Tensor | None, *, n_microbatches: int,
                  act_shape: tuple[int, ...], loss_fn: Callable[..., torch.Tensor],
                  schedule: str = "1f1b", group: dist.ProcessGroup | None = None,
                  act_dtype: torch.dtype = torch.float32) -> StepResult:
    """Run forward and backward of one batch through the pipeline; gradients accumulate
    in ``stage_module``'s parameters (the caller zeroes them and steps the optimizer).

    Each micro-batch's loss is divided by ``n_microbatches``, so the gradients are
    those of the mean of the micro-batch losses: with equal micro-batches, the
    full-batch mean loss. Messages follow :func:`p2p_plan`: each action's outgoing
    message goes in one ``batch_isend_irecv`` with the next action's receive, so no
    two stages ever block sending to each other (a deadlock on any backend). The
    receive is waited for before the next action computes, the send after it (on
    NCCL, which returns one work for the batch, a batch with a receive is waited for
    whole before the compute). On a GPU the ``sync(device)`` around each action,
    there for the measured events, also waits for the send's kernel.

    Args:
        stage_module: this rank's stage (stage index = rank in ``group``).
        inputs: the whole batch's inputs on the first stage (else ignored).
        targets: the whole batch's targets on the last stage (else ignored).
        n_microbatches: ``m``; must divide the batch.
        act_shape: shape of one micro-batch's activation between stages, e.g.
            ``(micro_batch, seq, hidden)``: receivers allocate it in advance.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"zb-h1"`` (the backward split into
            B and W, :mod:`~dtlib.pipeline_parallel.zero_bubble`).
        group: the pipeline's process group (default: the whole world, or a lone
            process when none is initialised).
        act_dtype: dtype of the activations sent between stages.
    Returns:
        A :class:`StepResult`.

    Taught in: Chapter 6, "GPipe", "1F1B" and "Splitting the backward".
    """
    if dist.is_available() and dist.is_initialized():
        rank, p = dist.get_rank(group), dist.get_world_size(group)
    else:
        rank, p = 0, 1
    order = schedule_order(schedule, rank, p, n_microbatches)
    m = n_microbatches
    first, last = rank == 0, rank == p - 1
    if act_shape[0] < 1:
        raise ValueError(f"act_shape={act_shape!r}: micro-batch size must be >= 1")
    batch = m * act_shape[0]
    for name, t, needed in (("inputs", inputs, first), ("targets", targets, last)):
        if needed and (t is None or t.shape[0] != batch):
            got = None if t is None else t.shape[0]
            raise ValueError(
                f"{name} has batch {got}; n_microbatches={m} times micro-batch "
                f"{act_shape[0]} needs {batch} (n_microbatches must divide the batch)")
    x_mbs = inputs.chunk(m) if first else None
    y_mbs = targets.chunk(m) if last else None

    def peer(s: int) -> int:
        return dist.get_global_rank(group, s) if group is not None else s

    device = world().device
    split = schedule in SPLIT_SCHEDULES
    held: dict[int, tuple[torch.Tensor, torch.Tensor, list]] = {}
    deferred: dict[int, DeferredW] = {}
    w_bytes = w_peak = 0
    outgoing: dict[tuple[str, int], torch.Tensor] = {}  # sent by the next batch
    events: list[Event] = []
    live = peak = 0
    total_loss = torch.zeros((), device=device)
    if p > 1:
        dist.barrier(group=group)
    sync(device)
    t0 = time.perf_counter()
    for batch, action in p2p_plan(schedule, rank, p, m):
        # Receive buffers (micro_batch, seq, hidden) on the rank's device: NCCL
        # rejects CPU tensors.
        incoming = {(msg.what, msg.mb): torch.empty(act_shape, dtype=act_dtype,
                                                    device=device)
                    for msg in batch if msg.op == "recv"}
        c10d = dist.distributed_c10d  # looked up now: a patched isend is seen
        ops = [dist.P2POp(c10d.isend if msg.op == "send" else c10d.irecv,
                          outgoing.pop((msg.what, msg.mb)) if msg.op == "send"
                          else incoming[msg.what, msg.mb], peer(msg.peer), group)
               for msg in batch]
        # one batch: sends and receives posted together; only the receives are
        # waited before the compute that reads them
        works = dist.batch_isend_irecv(ops) if ops else []
        receiving, sending = _split_works(batch, works)
        for work in receiving:
            work.wait()
        if action is None:
            break
        kind, i = action
        if kind == "F":
            if first:
                x = x_mbs[i]
            else:
                x = incoming["act", i].requires_grad_(True)
            sync(device)
            start = time.perf_counter() - t0
            if split:
                with weight_sites(stage_module) as sites:
                    out = stage_module(x)
            else:
                sites, out = [], stage_module(x)
            if last:
                out = loss_fn(out, y_mbs[i]) / m
                total_loss += out.detach()
            sync(device)
            events.append(Event(rank, "F", i, start, time.perf_counter() - t0))
            if not last:
                outgoing["act", i] = out.detach()
            held[i] = (x, out, sites)
            live += 1
            peak = max(peak, live)
        elif kind == "W":  # the weight gradients B left for later
            sync(device)
            start = time.perf_counter() - t0
            w_bytes -= deferred[i].nbytes
            backward_weight(deferred.pop(i))
            sync(device)
            events.append(Event(rank, "W", i, start, time.perf_counter() - t0))
            live -= 1
        else:
            x, out, sites = held.pop(i)
            grad = None if last else incoming["grad", i]
            sync(device)
            start = time.perf_counter() - t0
            x_grad = None
            if split:  # B: the input's gradient now, the weights' at W
                x_grad, deferred[i] = backward_input(out, grad, None if first else x,
                                                     sites)
                w_bytes += deferred[i].nbytes
                w_peak = max(w_peak, w_bytes)
            elif out.requires_grad:  # a frozen first stage's output needs none
                out.backward(grad)
                x_grad = None if first else x.grad
            sync(device)
            events.append(Event(rank, "B", i, start, time.perf_counter() - t0))
            if not first:
                # no gradient reached x (nothing after it trains): send zeros
                outgoing["grad", i] = x_grad if x_grad is not None \
                    else torch.zeros_like(x)
            if not split:
                live -= 1
        for work in sending:  # in flight while this action computed
            work.wait()
    for work in sending:
        work.wait()  # the last batch's sends, at the end of the step
    if p > 1:  # every stage reports the loss the last one computed
        dist.broadcast(total_loss, src=peer(p - 1), group=group)
    return StepResult(total_loss.item(), events, peak, w_peak)
