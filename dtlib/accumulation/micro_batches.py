"""Gradient accumulation that equals the large batch: token-normalised, DDP-aware.

Accumulating ``accum_steps`` micro-batches before one optimizer step must give the
gradient of the *large-batch* loss, the mean over every real (non-padding) token of the
accumulated batch. With ``T`` the total token count of the group, summed over all ranks,
and ``L_i`` the summed per-token loss of micro-batch ``i``::

    grad( sum_i L_i / T ) = sum_i grad( L_i / T )

so each micro-batch backpropagates ``L_i / T``: a *sum* loss divided by the group's
total, not its own mean divided by ``accum_steps`` (the mean of means is wrong when
micro-batches hold different numbers of tokens, ERRATA 29; dividing a remainder group
of ``r < accum_steps`` micro-batches by ``accum_steps`` makes its gradient
``r/accum_steps`` of the right one, ERRATA 28). Under data parallelism DDP *averages*
the ranks' gradients, ``(1/N) sum_r g_r``, so each rank backpropagates
``N * L_i / T_global`` and the average is ``sum_{r,i} grad L_{r,i} / T_global``: the
large batch's gradient. ``T_global`` needs one all-reduce of a single integer per
group (ranks hold different numbers of tokens).
All micro-batches but the last run inside ``model.no_sync()``: one gradient
synchronisation per optimizer step, not one per micro-batch (ERRATA 31).

Taught in: Chapter 8, "Gradient accumulation".
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.runtime import dist as ddist

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it are padding
MicroBatch = Sequence[torch.Tensor]  # (idx, targets), both (batch, seq)
LossFn = Callable[[nn.Module, MicroBatch], torch.Tensor]


def count_tokens(micro_batch: MicroBatch, ignore_index: int = IGNORE_INDEX) -> int:
    """Real (non-padding) target tokens of a micro-batch ``(idx, targets)``.

    Args:
        micro_batch: ``(idx, targets)``; padding targets equal ``ignore_index``.
        ignore_index: the padding marker in ``targets``.
    Returns:
        The number of targets that count in the loss.

    Taught in: Chapter 8, "Normalise by tokens".
    """
    if len(micro_batch) != 2:
        raise ValueError(f"micro_batch has {len(micro_batch)} items; expected "
                         "(idx, targets)")
    return int((micro_batch[1] != ignore_index).sum())


def token_loss_sum(model: nn.Module, micro_batch: MicroBatch,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed (not averaged) cross-entropy over the real tokens of a micro-batch.

    Args:
        model: returns logits ``(batch, seq, vocab)`` from ``model(idx)``.
        micro_batch: ``(idx, targets)``.
        ignore_index: padding targets, left out of the sum.
    Returns:
        A scalar tensor: the sum of per-token losses (0 when all is padding).

    Taught in: Chapter 8, "Normalise by tokens".
    """
    idx, targets = micro_batch
    logits = model(idx)  # (batch, seq, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")


def micro_batch_groups(loader: Iterable[Any], accum_steps: int
                       ) -> Iterator[list[Any]]:
    """Consecutive groups of ``accum_steps`` micro-batches; the last may be shorter.

    An empty loader yields nothing (no loop variable outlives a loop that did not run,
    ERRATA 30). The caller's iterable is read as is (no rebuilt DataLoader, ERRATA 32).

    Args:
        loader: any iterable of micro-batches (a DataLoader, a list).
        accum_steps: micro-batches per optimizer step (>= 1).
    Returns:
        An iterator of lists of micro-batches.

    Taught in: Chapter 8, "The remainder group".
    """
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) \
            or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r} must be a positive integer")
    group: list[Any] = []
    for micro_batch in loader:
        group.append(micro_batch)
        if len(group) == accum_steps:
            yield group
            group = []
    if group:  # the remainder: fewer than accum_steps micro-batches
        yield group


def _dp_group(model: nn.Module) -> tuple[bool, Any]:
    """(is data-parallel, its process group): torch DDP and dtlib's DataParallel."""
    if not hasattr(model, "no_sync"):
        return False, None
    group = getattr(model, "process_group", None)  # torch DDP
    if group is None:
        group = getattr(model, "group", None)  # dtlib.data_parallel.DataParallel
    return True, group


def global_token_count(local_tokens: int, group: Any = None) -> int:
    """Sum of ``local_tokens`` over the ranks of ``group``: one all-reduce of one int.

    Args:
        local_tokens: this rank's real tokens in the accumulation group.
        group: process group (default: the world); no communication on one rank.
    Returns:
        The total over ranks.

    Taught in: Chapter 8, "Accumulation under DDP".
    """
    if not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size(group) == 1:
        return int(local_tokens)
    t = torch.tensor([int(local_tokens)], dtype=torch.int64,
                     device=ddist.world().device)
    dist.all_reduce(t, group=group)
    return int(t.item())


@dataclass(frozen=True)
class GroupStats:
    """What one accumulation group did.

    loss_sum: this rank's summed per-token loss (detached float).
    tokens: this rank's real tokens.
    global_tokens: tokens of the whole accumulated batch (all ranks): the normaliser.
    micro_batches: micro-batches in the group.
    """

    loss_sum: float
    tokens: int
    global_tokens: int
    micro_batches: int


def accumulate_gradients(model: nn.Module, group: Sequence[MicroBatch],
                         loss_fn: LossFn = token_loss_sum, *,
                         use_no_sync: bool = True, scaler: Any = None,
                         autocast_dtype: torch.dtype | None = None,
                         ignore_index: int = IGNORE_INDEX) -> GroupStats:
    """Forward and backward every micro-batch of ``group``; ``.grad`` gains the gradient
    of the large-batch mean loss (all ranks' tokens together under DDP).

    Args:
        model: a module, or one wrapped in torch DDP / dtlib ``DataParallel`` (anything
            with ``no_sync()`` is treated as data-parallel and averaged by world size).
        group: the micro-batches ``(idx, targets)`` of one optimizer step (non-empty;
            every rank must pass the same number).
        loss_fn: ``loss_fn(model, micro_batch)`` -> summed per-token loss.
        use_no_sync: run all micro-batches but the last inside ``model.no_sync()``.
        scaler: a ``torch.amp.GradScaler`` (fp16) or None.
        autocast_dtype: run forward under ``torch.autocast`` with this dtype, or None.
        ignore_index: padding marker in the targets.
    Returns:
        :class:`GroupStats`.

    Taught in: Chapter 8, "The fix, in one function".
    """
    if len(group) == 0:
        raise ValueError("group is empty; pass at least one micro-batch")
    is_dp, pg = _dp_group(model)
    local = sum(count_tokens(mb, ignore_index) for mb in group)
    total = global_token_count(local, pg) if is_dp else local
    if total == 0:
        raise ValueError("the accumulated batch has no real tokens (all padding)")
    world_size = dist.get_world_size(pg) if is_dp else 1
    scale = world_size / total  # DDP divides by world_size: multiply it back
    device = next(model.parameters()).device
    loss_sum = 0.0
    for i, micro_batch in enumerate(group):
        last = i == len(group) - 1
        quiet = is_dp and use_no_sync and not last
        autocast = (torch.autocast(device.type, dtype=autocast_dtype)
                    if autocast_dtype is not None else contextlib.nullcontext())
        with model.no_sync() if quiet else contextlib.nullcontext():
            with autocast:
                loss = loss_fn(model, micro_batch)
            scaled = loss.float() * scale
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += float(loss.detach())
    return GroupStats(loss_sum, local, total, len(group))


def make_grad_scaler(dtype: torch.dtype | None, device: torch.device | None = None
                     ) -> Any:
    """A ``torch.amp.GradScaler`` for float16, None for anything else.

    float16's smallest normal number is ~6e-5: small gradients underflow to zero unless
    the loss is scaled up first. bfloat16 keeps float32's exponent range, so a scaler
    buys nothing there (ERRATA 32).

    Args:
        dtype: the autocast dtype (None, torch.float32, torch.bfloat16, torch.float16).
        device: where the model lives (default: ``dtlib.runtime.dist.world().device``).
    Returns:
        A GradScaler or None.

    Taught in: Chapter 8, "A scaler only for float16".
    """
    allowed = (None, torch.float32, torch.bfloat16, torch.float16)
    if dtype not in allowed:
        raise ValueError(f"dtype={dtype!r} is not allowed; allowed: {allowed}")
    if dtype is not torch.float16:
        return None
    device = device or ddist.world().device
    return torch.amp.GradScaler(device.type)


@dataclass(frozen=True)
class EpochStats:
    """One epoch of :func:`train_epoch`.

    optimizer_steps: groups stepped (0 for an empty loader).
    micro_batches: micro-batches seen.
    tokens: this rank's real tokens.
    loss: this rank's mean per-token loss over the epoch (nan when nothing ran).
    """

    optimizer_steps: int
    micro_batches: int
    tokens: int
    loss: float


def _to(micro_batch: MicroBatch, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in micro_batch)


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer,
                loader: Iterable[MicroBatch], accum_steps: int, *,
                loss_fn: LossFn = token_loss_sum, dtype: torch.dtype | None = None,
                use_no_sync: bool = True, max_grad_norm: float | None = None,
                ignore_index: int = IGNORE_INDEX) -> EpochStats:
    """One epoch of accumulated training over the caller's loader, as it is.

    Each group of ``accum_steps`` micro-batches (the last may be shorter) is one
    optimizer step equal to a large-batch step on the group's tokens. Batches are moved
    to ``dtlib.runtime.dist.world().device``. A GradScaler is made for float16 only.

    Args:
        model: the (possibly DDP-wrapped) model.
        optimizer: its optimizer.
        loader: the caller's iterable of ``(idx, targets)`` (never rebuilt).
        accum_steps: micro-batches per optimizer step.
        loss_fn: summed per-token loss, see :func:`token_loss_sum`.
        dtype: autocast dtype or None (float32).
        use_no_sync: skip gradient synchronisation on all but the last micro-batch.
        max_grad_norm: clip the accumulated gradient to this norm, or None.
        ignore_index: padding marker in the targets.
    Returns:
        :class:`EpochStats`.

    Taught in: Chapter 8, "A small trainer".
    """
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0 or None")
    device = ddist.world().device
    scaler = make_grad_scaler(dtype, device)
    autocast_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None
    steps = micro = tokens = 0
    loss_sum = 0.0
    for group in micro_batch_groups(loader, accum_steps):
        stats = accumulate_gradients(
            model, [_to(mb, device) for mb in group], loss_fn, use_no_sync=use_no_sync,
            scaler=scaler, autocast_dtype=autocast_dtype, ignore_index=ignore_index)
        if max_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        micro += stats.micro_batches
        tokens += stats.tokens
        loss_sum += stats.loss_sum
    return EpochStats(steps, micro, tokens, loss_sum / tokens if tokens else math.nan)
