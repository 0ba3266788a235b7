"""The seed tutorial's accumulation mistakes, rewritten small so the book can run them.

Each function reproduces one defect of ERRATA 28-32 on purpose, for the chapter to show
it happening next to the fix in :mod:`dtlib.accumulation`. None of them is meant for
training.

Taught in: Chapter 8, "The seed's accumulation, defect by defect".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from dtlib.accumulation.micro_batches import MicroBatch

SEED_BATCH_SIZE = 32  # the batch size the seed's trainer hard-codes

#: The seed's accumulation mistakes the chapter shows, one entry each (ERRATA 32 holds
#: two), in the order the chapter meets them.
SEED_DEFECTS: tuple[tuple[int, str], ...] = (
    (29, "a mean of per-micro-batch means instead of the token mean"),
    (28, "the remainder group divided by accum_steps"),
    (30, "the loop variable read after a loop that may not run"),
    (31, "a DDP all-reduce after every micro-batch (no no_sync)"),
    (32, "the trainer rebuilds the caller's DataLoader"),
    (32, "a GradScaler with bfloat16"),
)


def seed_accumulate(model: nn.Module, group: Sequence[MicroBatch], accum_steps: int,
                    use_no_sync: bool = False) -> None:
    """The seed's accumulation: each micro-batch's *mean* loss divided by
    ``accum_steps``, and (by default) every backward synchronised.

    Wrong twice: a mean of per-micro-batch means is not the large-batch mean when the
    micro-batches hold different numbers of tokens (ERRATA 29), and a remainder group
    of ``r < accum_steps`` micro-batches gets ``r / accum_steps`` of its gradient
    (ERRATA 28). Without ``no_sync`` DDP all-reduces after every micro-batch
    (ERRATA 31).

    Args:
        model: the (possibly DDP-wrapped) GPT; ``model(idx, targets)[1]`` is the mean
            loss over the micro-batch's real tokens.
        group: the micro-batches of one optimizer step.
        accum_steps: the configured number of micro-batches per step.
        use_no_sync: wrap all but the last micro-batch in ``model.no_sync()``.
    Returns:
        None (gradients accumulate in ``.grad``).

    Taught in: Chapter 8, "Mean of means" and "The remainder group".
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r} must be >= 1")
    for i, (idx, targets) in enumerate(group):
        quiet = use_no_sync and hasattr(model, "no_sync") and i < len(group) - 1
        with model.no_sync() if quiet else contextlib.nullcontext():
            loss = model(idx, targets)[1] / accum_steps
            loss.backward()


def seed_epoch(model: nn.Module, optimizer: torch.optim.Optimizer,
               loader: Iterable[MicroBatch], accum_steps: int) -> int:
    """The seed's epoch loop: steps every ``accum_steps`` and flushes the remainder by
    reading the loop variable *after* the loop, which raises ``UnboundLocalError`` (a
    ``NameError``) when the loader is empty (ERRATA 30).

    Returns:
        The number of optimizer steps taken.

    Taught in: Chapter 8, "An empty loader".
    """
    steps = 0
    for step, (idx, targets) in enumerate(loader):
        (model(idx, targets)[1] / accum_steps).backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    if (step + 1) % accum_steps != 0:  # noqa: F821 - the defect being taught
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return steps


def seed_rebuilt_loader(loader: DataLoader) -> DataLoader:
    """The seed's trainer: it builds its own DataLoader from ``loader.dataset`` with a
    hard-coded batch size, discarding the caller's batch size, collate function and
    sampler (ERRATA 32).

    Taught in: Chapter 8, "A small trainer".
    """
    return DataLoader(loader.dataset, batch_size=SEED_BATCH_SIZE, shuffle=True,
                      collate_fn=loader.collate_fn)


def scaler_with_bf16(model: nn.Module, micro_batch: MicroBatch) -> dict[str, Any]:
    """Gradients of one bfloat16-autocast backward, without and with a GradScaler.

    A scale factor is a power of two and bfloat16 has float32's exponent range, so
    scaling then unscaling changes nothing representable: the gradients agree and the
    scaler only adds work (ERRATA 32). Also reports how many gradient entries would be
    below float16's smallest subnormal (``2**-24``), the case a scaler exists for.

    Returns:
        ``max_abs_diff`` between the two gradients, ``scale`` used, ``n_grads``,
        ``below_fp16`` (entries under 2**-24 in magnitude, nonzero),
        ``below_bf16`` (entries under bfloat16's smallest normal).

    Taught in: Chapter 8, "A scaler only for float16".
    """
    device = next(model.parameters()).device
    idx, targets = micro_batch

    def grads(scaler: Any) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(idx, targets)[1]
        (scaler.scale(loss) if scaler is not None else loss).backward()
        g = torch.cat([p.grad.reshape(-1).float() for p in model.parameters()
                       if p.grad is not None])
        if scaler is not None:
            g = g / scaler.get_scale()  # what scaler.unscale_ would leave in .grad
        return g

    plain = grads(None)
    scaler = torch.amp.GradScaler(device.type)
    scaled = grads(scaler)
    model.zero_grad(set_to_none=True)
    tiny = plain.abs()
    nonzero = tiny > 0
    return {"max_abs_diff": float((plain - scaled).abs().max()),
            "scale": float(scaler.get_scale()), "n_grads": plain.numel(),
            "below_fp16": int((nonzero & (tiny < 2.0 ** -24)).sum()),
            "below_bf16": int((nonzero & (tiny < torch.finfo(torch.bfloat16).tiny)
                               ).sum())}
