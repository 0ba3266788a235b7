"""Gradient accumulation that equals the large batch: token-normalised, on any
technique (its Parallelism says how to skip a synchronisation).

Accumulating ``accum_steps`` micro-batches before one optimizer step must give the
gradient of the *large-batch* loss, the mean over every real (non-padding) token of the
accumulated batch. With ``T`` the total token count of the group, summed over all ranks,
and ``L_i`` the summed per-token loss of micro-batch ``i``::

    grad( sum_i L_i / T ) = sum_i grad( L_i / T )

so each micro-batch backpropagates ``L_i / T``: a *sum* loss divided by the group's
total, not its own mean divided by ``accum_steps`` (the mean of means is wrong when
micro-batches hold different numbers of tokens, ERRATA 29; dividing a remainder group
of ``r < accum_steps`` micro-batches by ``accum_steps`` makes its gradient
``r/accum_steps`` of the right one, ERRATA 28). Under data parallelism backward
*averages* the ranks' gradients, ``(1/N) sum_r g_r``, so each rank backpropagates
``N * L_i / T_global`` and the average is ``sum_{r,i} grad L_{r,i} / T_global``: the
large batch's gradient. ``T_global`` needs one all-reduce of a single integer per
group (ranks hold different numbers of tokens).
All micro-batches but the last run inside ``par.grad_sync(model, on=False)`` (DDP's
``no_sync``, FSDP2's ``set_requires_gradient_sync``): one gradient synchronisation per
optimizer step, not one per micro-batch (ERRATA 31). Each micro-batch's forward and
backward is the technique's own ``par.forward_backward(..., scale=N / T)``, so what a
technique changes there (a 16-bit working copy, an engine's backward) happens under
accumulation too; a technique that splits batches itself (a pipeline) refuses in
``par.check_accumulation``. ``accumulation_step`` hands the same function to the one
loop, :func:`~dtlib.models.run.run_steps`.

Taught in: Chapter 8, "Gradient accumulation".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models.run import Parallelism, RunConfig, TrainState, run_steps
from dtlib.runtime import dist as ddist

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it are padding
MicroBatch = Sequence[torch.Tensor]  # (idx, targets), both (batch, seq)
LossFn = Callable[..., torch.Tensor]  # loss_fn(model, idx, targets), as everywhere


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


def token_loss_sum(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed (not averaged) cross-entropy over the real tokens of a micro-batch.

    Args:
        model: returns logits ``(batch, seq, vocab)`` from ``model(idx)``.
        idx, targets: the micro-batch, ``(batch, seq)`` each.
        ignore_index: padding targets, left out of the sum.
    Returns:
        A scalar fp32 tensor: the sum of per-token losses (0 when all is padding);
        the log-softmax runs in fp32 whatever the logits' dtype, as autocast runs it.

    Taught in: Chapter 8, "Normalise by tokens".
    """
    logits = model(idx)  # (batch, seq, vocab)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                           targets.reshape(-1), ignore_index=ignore_index,
                           reduction="sum")


def _check_accum_steps(accum_steps: Any) -> None:
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) \
            or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r} must be a positive integer")


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
    _check_accum_steps(accum_steps)
    group: list[Any] = []
    for micro_batch in loader:
        group.append(micro_batch)
        if len(group) == accum_steps:
            yield group
            group = []
    if group:  # the remainder: fewer than accum_steps micro-batches
        yield group


@dataclass(frozen=True)
class GroupStats:
    """What one accumulation group did.

    loss_sum: this rank's summed per-token loss (a detached tensor: reading it is a
        host synchronisation, left to the caller).
    tokens: this rank's real tokens.
    global_tokens: tokens of the whole accumulated batch (all data-parallel ranks):
        the normaliser.
    micro_batches: micro-batches in the group.
    """

    loss_sum: torch.Tensor
    tokens: int
    global_tokens: int
    micro_batches: int


def _token_counts(group: Sequence[MicroBatch], par: Parallelism,
                  ignore_index: int) -> tuple[int, int]:
    """(this rank's real tokens, all data-parallel ranks'): one all-reduce of one
    integer, one host read for both."""
    for mb in group:
        if len(mb) != 2:
            raise ValueError(f"micro_batch has {len(mb)} items; expected "
                             "(idx, targets)")
    local = sum((mb[1] != ignore_index).sum() for mb in group).reshape(1)
    total = par.sum_over_dp(local.clone())
    mine, everyone = torch.cat([local, total]).tolist()
    return int(mine), int(everyone)


def accumulate_gradients(par: Parallelism, model: nn.Module,
                         group: Sequence[MicroBatch],
                         loss_fn: LossFn = token_loss_sum, *, scaler: Any = None,
                         autocast_dtype: torch.dtype | None = None,
                         ignore_index: int = IGNORE_INDEX) -> GroupStats:
    """Forward and backward every micro-batch of ``group``; ``.grad`` gains the gradient
    of the large-batch mean loss (all data-parallel ranks' tokens together).

    Args:
        par: the technique; ``par.grad_sync(model, on)`` switches gradient
            synchronisation off for every micro-batch but the last, and
            ``par.dp_group``/``par.dp_size`` are the ranks backward averages over
            (``Parallelism()``: one process).
        model: ``par.apply(...)``'s result (DDP, FSDP2, ZeRO-3 or a plain module).
        group: the micro-batches ``(idx, targets)`` of one optimizer step (non-empty;
            every rank must pass the same number).
        loss_fn: ``loss_fn(model, idx, targets)`` -> summed per-token loss.
        scaler: a ``torch.amp.GradScaler`` (fp16) or None.
        autocast_dtype: run forward under ``torch.autocast`` with this dtype, or None.
        ignore_index: padding marker in the targets.
    Returns:
        :class:`GroupStats` (the token counts cost the step's one host read).
    Raises:
        ValueError: an empty group, no real token, or a technique that cannot
            accumulate (``par.check_accumulation``).

    Taught in: Chapter 8, "The fix, in one function".
    """
    if len(group) == 0:
        raise ValueError("group is empty; pass at least one micro-batch")
    par.check_accumulation(len(group))
    local, total = _token_counts(group, par, ignore_index)
    if total == 0:
        raise ValueError("the accumulated batch has no real tokens (all padding)")
    scale = par.dp_size / total  # backward averages over dp_size: multiply it back
    forward = _autocast(loss_fn, autocast_dtype)
    sums = []
    for i, micro_batch in enumerate(group):
        with par.grad_sync(model, on=i == len(group) - 1):  # one sync per step
            loss = par.forward_backward(model, micro_batch, forward, scale=scale,
                                        scaler=scaler)
        sums.append(loss.float())
    return GroupStats(torch.stack(sums).sum(), local, total, len(group))


def _autocast(loss_fn: LossFn, dtype: torch.dtype | None) -> LossFn:
    """``loss_fn`` with its forward under ``torch.autocast(dtype)`` (backward then
    runs outside it, as the autocast recipe has it); ``loss_fn`` itself for None."""
    if dtype is None:
        return loss_fn
    device = ddist.world().device

    def forward(model: nn.Module, *batch: Any) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return loss_fn(model, *batch).float()
    return forward


class AccumulationStep:
    """A ``step_fn`` for :func:`~dtlib.models.run.run_steps`: one optimizer step's
    gradients accumulated over micro-batches by :func:`accumulate_gradients`.

    The loop hands it this rank's batch: a list of micro-batches ``(idx, targets)``
    (used as they are; a remainder group may be shorter), or one tuple of tensors,
    split row-wise into ``accum_steps`` micro-batches. It returns this rank's share
    of the global-batch loss, ``loss_sum * dp_size / global_tokens``, so that the
    mean over data-parallel ranks (``par.global_loss``) is the large batch's mean
    per-token loss. ``stats`` keeps every step's :class:`GroupStats`.

    The loop's own ``loss_fn`` (a mean loss) is not used: token normalisation needs
    a *summed* per-token loss, this step's ``loss_fn``.

    Taught in: Chapter 8, "A small trainer".
    """

    def __init__(self, accum_steps: int, loss_fn: LossFn = token_loss_sum, *,
                 ignore_index: int = IGNORE_INDEX,
                 autocast_dtype: torch.dtype | None = None) -> None:
        _check_accum_steps(accum_steps)
        self.accum_steps = accum_steps
        self.loss_fn = loss_fn
        self.ignore_index = ignore_index
        self.autocast_dtype = autocast_dtype
        self.stats: list[GroupStats] = []

    def micro_batches(self, batch: Any) -> list[MicroBatch]:
        """The micro-batches of one step: ``batch`` itself when it is a list,
        else its tensors' rows cut into ``accum_steps`` equal parts."""
        if isinstance(batch, list):
            return batch
        rows = batch[0].shape[0]
        if rows % self.accum_steps:
            raise ValueError(f"batch has {rows} rows; accum_steps="
                             f"{self.accum_steps} must divide it")
        return list(zip(*(t.chunk(self.accum_steps) for t in batch)))

    def __call__(self, par: Parallelism, wrapped: nn.Module, batch: Any,
                 loss_fn: Any = None, scaler: Any = None) -> torch.Tensor:
        stats = accumulate_gradients(
            par, wrapped, self.micro_batches(batch), self.loss_fn, scaler=scaler,
            autocast_dtype=self.autocast_dtype, ignore_index=self.ignore_index)
        self.stats.append(stats)
        return stats.loss_sum * (par.dp_size / stats.global_tokens)


def accumulation_step(accum_steps: int, loss_fn: LossFn = token_loss_sum, *,
                      ignore_index: int = IGNORE_INDEX,
                      autocast_dtype: torch.dtype | None = None) -> AccumulationStep:
    """The ``step_fn`` of :func:`~dtlib.models.run.run_steps` that accumulates.

    Args:
        accum_steps: micro-batches per optimizer step (>= 1): how a tuple batch is
            split (a list of micro-batches is used as it is).
        loss_fn: ``loss_fn(model, idx, targets)`` -> summed per-token loss.
        ignore_index: padding marker in the targets.
        autocast_dtype: forward under ``torch.autocast`` with this dtype, or None
            (or pass ``autocast_dtype=`` to ``run_steps``, which wraps the step).
    Returns:
        An :class:`AccumulationStep` (``.stats``: each step's :class:`GroupStats`).

    Taught in: Chapter 8, "A small trainer".
    """
    return AccumulationStep(accum_steps, loss_fn, ignore_index=ignore_index,
                            autocast_dtype=autocast_dtype)


def make_grad_scaler(dtype: torch.dtype | None, device: torch.device | None = None
                     ) -> Any:
    """A ``torch.amp.GradScaler`` for float16, None for anything else.

    float16's smallest normal number is 2**-14 (~6.1e-5) and its smallest subnormal
    2**-24 (~6e-8): smaller gradients lose precision, and those at most half the
    subnormal round to zero, unless the loss is scaled up first. bfloat16 keeps
    float32's exponent range, so a scaler buys nothing there (ERRATA 32).

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
    losses: each step's global-batch loss (``run_steps``'s, all ranks' tokens).
    """

    optimizer_steps: int
    micro_batches: int
    tokens: int
    loss: float
    losses: tuple[float, ...] = ()


def train_epoch(par: Parallelism, model: nn.Module,
                optimizer: torch.optim.Optimizer, loader: Iterable[MicroBatch],
                accum_steps: int, *, loss_fn: LossFn = token_loss_sum,
                dtype: torch.dtype | None = None,
                max_grad_norm: float | None = None,
                ignore_index: int = IGNORE_INDEX) -> EpochStats:
    """One epoch of accumulated training over the caller's loader, as it is.

    Each group of ``accum_steps`` micro-batches (the last may be shorter) is one
    optimizer step equal to a large-batch step on the group's tokens: the one loop,
    :func:`~dtlib.models.run.run_steps`, with :func:`accumulation_step`. Batches are
    moved to ``dtlib.runtime.dist.world().device``. A GradScaler is made for float16
    only.

    Args:
        par: the technique (``Parallelism()`` for one process) that ``model`` was
            applied with.
        model: ``par.apply(...)``'s result (a plain module for one process).
        optimizer: its optimizer.
        loader: the caller's iterable of ``(idx, targets)`` (never rebuilt; read
            once, before the first step, into its groups).
        accum_steps: micro-batches per optimizer step.
        loss_fn: summed per-token loss, see :func:`token_loss_sum`.
        dtype: autocast dtype or None (float32).
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
    groups = [[tuple(t.to(device) for t in mb) for mb in group]
              for group in micro_batch_groups(loader, accum_steps)]
    step = accumulation_step(accum_steps, loss_fn, ignore_index=ignore_index,
                             autocast_dtype=autocast_dtype)
    config = RunConfig(len(groups), step_fn=step, max_grad_norm=max_grad_norm,
                       local_batches=True, record_grads=False, record_params=False)
    result = run_steps(par, None, groups.__getitem__, config,
                       TrainState(wrapped=model, optimizer=optimizer, scaler=scaler))
    tokens = sum(s.tokens for s in step.stats)
    loss_sum = float(sum(s.loss_sum for s in step.stats)) if step.stats else 0.0
    return EpochStats(len(step.stats), sum(s.micro_batches for s in step.stats),
                      tokens, loss_sum / tokens if tokens else math.nan,
                      tuple(result.losses))
