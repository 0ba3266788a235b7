"""Accumulation against the large batch: data, references, and the rank functions.

- :func:`variable_length_dataset` and :func:`pad_collate`: sequences of different
  lengths, padded per micro-batch with ``targets = -100``, so micro-batches hold
  different numbers of real tokens (the case where the mean of means goes wrong);
- :func:`large_batch` and :func:`reference_steps`: one process, the whole accumulated
  batch at once (the truth);
- :func:`ddp_accumulation` (a rank function for :func:`dtlib.runtime.launch.spawn`):
  one rank of DDP training with accumulation, by a chosen method, counting
  all-reduces; the one loop with the DDP's Parallelism and a ``step_fn`` per method.

Taught in: Chapter 8, "Equal to the large batch" and "Accumulation under DDP".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.accumulation.micro_batches import (IGNORE_INDEX, MicroBatch,
                                              accumulation_step, count_tokens,
                                              token_loss_sum, train_epoch)
from dtlib.chapters.ch03_data_parallel.runs import TINY
from dtlib.chapters.ch08_gradient_accumulation.seed import seed_accumulate
from dtlib.collectives.accounting import count_comms
from dtlib.data_parallel import DataParallelism
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import grads_of, reference_run
from dtlib.models.run import Parallelism, RunConfig, RunResult, TrainState, run_steps
from dtlib.runtime import dist as ddist

METHODS = ("tokens", "seed", "local_tokens", "trainer")
__all__ = ["TINY", "METHODS", "variable_length_dataset", "pad_collate",
           "variable_length_batches", "large_batch", "large_batch_grads",
           "reference_steps", "relative_error", "global_groups",
           "SyncEveryMicroBatch", "local_tokens_accumulate", "ddp_accumulation",
           "ddp_suite"]


def variable_length_dataset(cfg: GPTConfig, n: int, seed: int = 0, min_len: int = 1
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` sequences ``(idx, targets)`` of random lengths in ``[min_len, seq_len]``.

    Targets are the inputs shifted by one (language modelling). 1-D tensors.
    """
    if not 1 <= min_len <= cfg.seq_len:
        raise ValueError(f"min_len={min_len!r} must be in [1, seq_len={cfg.seq_len}]")
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, cfg.seq_len + 1, (n,), generator=gen)
    out = []
    for length in lengths.tolist():
        data = torch.randint(0, cfg.vocab_size, (length + 1,), generator=gen)
        out.append((data[:-1], data[1:]))
    return out


def pad_collate(samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
                ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad 1-D ``(idx, targets)`` samples to the longest: idx with 0, targets with
    ``ignore_index`` (so padding never counts in the loss). Returns ``(b, s)`` tensors.
    """
    length = max(len(idx) for idx, _ in samples)
    idx = torch.zeros(len(samples), length, dtype=torch.long)
    targets = torch.full((len(samples), length), ignore_index, dtype=torch.long)
    for row, (i, t) in enumerate(samples):
        idx[row, :len(i)] = i
        targets[row, :len(t)] = t
    return idx, targets


def variable_length_batches(cfg: GPTConfig, n_micro: int, micro_batch: int,
                            seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_micro`` padded micro-batches of ``micro_batch`` variable-length sequences."""
    data = variable_length_dataset(cfg, n_micro * micro_batch, seed)
    return [pad_collate(data[i * micro_batch:(i + 1) * micro_batch])
            for i in range(n_micro)]


def large_batch(micro_batches: Sequence[MicroBatch],
                ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate micro-batches into one batch, padded to the longest (causal
    attention: trailing padding changes no real token's logits)."""
    length = max(mb[0].shape[1] for mb in micro_batches)
    idx = torch.cat([F.pad(mb[0], (0, length - mb[0].shape[1]))
                     for mb in micro_batches])
    targets = torch.cat([F.pad(mb[1], (0, length - mb[1].shape[1]), value=ignore_index)
                         for mb in micro_batches])
    return idx, targets


def large_batch_grads(model: nn.Module, micro_batches: Sequence[MicroBatch]
                      ) -> dict[str, torch.Tensor]:
    """Gradients of the large batch's mean loss over its real tokens (the truth)."""
    model.zero_grad(set_to_none=True)
    model(*large_batch(micro_batches))[1].backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return grads


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
                   ) -> float:
    """``||got - want|| / ||want||`` over all tensors together (2-norm)."""
    diff = torch.cat([(got[k] - want[k]).reshape(-1) for k in want])
    ref = torch.cat([want[k].reshape(-1) for k in want])
    return float(diff.norm() / ref.norm())


def reference_steps(cfg: GPTConfig, groups: Sequence[Sequence[MicroBatch]],
                    lr: float = 1e-3, seed: int = 0,
                    optimizer_class: type = torch.optim.AdamW,
                    **optimizer_kwargs: Any) -> RunResult:
    """One process, one optimizer step per group on the group's large batch.

    Args:
        cfg: the GPT (``build_gpt(cfg, seed)``).
        groups: each step's micro-batches (all ranks' together).
        lr, optimizer_class, optimizer_kwargs: the optimizer (AdamW by default).
    Returns:
        A :class:`~dtlib.models.run.RunResult`: ``grads`` of the first step,
        ``params`` after the last, ``losses`` (large-batch mean loss per step).

    Taught in: Chapter 8, "Equal to the large batch".
    """
    return reference_run(build_gpt(cfg, seed), (large_batch(g) for g in groups),
                         lr=lr, optimizer_class=optimizer_class, **optimizer_kwargs)


def global_groups(cfg: GPTConfig, world_size: int, accum_steps: int,
                  micro_batch: int, steps: int) -> list[list[MicroBatch]]:
    """Step ``s``'s micro-batches, all ranks together; rank ``r``'s ``k``-th micro-batch
    is entry ``k * world_size + r``."""
    return [variable_length_batches(cfg, world_size * accum_steps, micro_batch,
                                    seed=1000 + s) for s in range(steps)]


class SyncEveryMicroBatch(DataParallelism):
    """Data parallelism that never skips a synchronisation: ``grad_sync`` ignores
    ``on=False``, so every micro-batch's backward all-reduces (ERRATA 31's cost,
    with the same gradients).

    Taught in: Chapter 8, "Accumulation under DDP".
    """

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return contextlib.nullcontext()


def local_tokens_accumulate(par: Parallelism, model: nn.Module,
                            group: Sequence[MicroBatch]) -> torch.Tensor:
    """Token-normalised on this rank only (no all-reduce of the count): DDP then
    averages per-rank means, wrong when ranks hold different numbers of tokens.

    Returns:
        This rank's mean per-token loss (detached).

    Taught in: Chapter 8, "Accumulation under DDP" (the per-rank count).
    """
    local = sum(count_tokens(mb) for mb in group)
    sums = []
    for i, micro_batch in enumerate(group):
        with par.grad_sync(model, on=i == len(group) - 1):
            sums.append(par.forward_backward(model, micro_batch, token_loss_sum,
                                             scale=1 / local))
    return torch.stack(sums).sum() / local


def _counted(step_fn: Callable[..., torch.Tensor], extra: dict[str, list[int]]
             ) -> Callable[..., torch.Tensor]:
    """``step_fn`` under the accounting: per step, gradient all-reduces (a bucket is
    never one element) and token-count all-reduces (always one element)."""
    def step(par: Parallelism, wrapped: nn.Module, batch: list[MicroBatch],
             loss_fn: Any, scaler: Any = None) -> torch.Tensor:
        with count_comms() as log:
            loss = step_fn(par, wrapped, batch, loss_fn, scaler=scaler)
        ar = [r for r in log.records if r.op == "all_reduce"]
        extra["grad_allreduces"].append(sum(r.numel > 1 for r in ar))
        extra["count_allreduces"].append(sum(r.numel == 1 for r in ar))
        extra["tokens"].append(sum(count_tokens(mb) for mb in batch))
        return loss
    return step


def _seed_step(accum_steps: int, use_no_sync: bool) -> Callable[..., torch.Tensor]:
    def step(par: Parallelism, wrapped: nn.Module, batch: list[MicroBatch],
             loss_fn: Any, scaler: Any = None) -> torch.Tensor:
        seed_accumulate(wrapped, batch, accum_steps, use_no_sync=use_no_sync)
        return torch.zeros((), device=ddist.world().device)  # no loss compared
    return step


def ddp_accumulation(cfg: GPTConfig, variant: str, accum_steps: int, micro_batch: int,
                     steps: int, method: str = "tokens", use_no_sync: bool = True,
                     lr: float = 1e-3, seed: int = 0, bucket_cap_mb: float = 0.02,
                     optimizer_class: type = torch.optim.AdamW,
                     optimizer_kwargs: dict[str, Any] | None = None) -> RunResult:
    """One rank of DDP training with gradient accumulation (a rank function).

    The one loop, :func:`~dtlib.models.run.run_steps`, with the DDP's Parallelism
    (:class:`SyncEveryMicroBatch` when ``use_no_sync`` is False) and a ``step_fn``
    per method, counted by the accounting.

    Args:
        cfg: the GPT.
        variant: ``"torch"`` or a :class:`dtlib.data_parallel.DataParallel` variant.
        accum_steps: micro-batches per rank per optimizer step.
        micro_batch: sequences per micro-batch.
        steps: optimizer steps.
        method: ``"tokens"`` (:func:`dtlib.accumulation.accumulation_step`),
            ``"seed"`` (mean / accum_steps), ``"local_tokens"`` (per-rank count),
            ``"trainer"`` (:func:`dtlib.accumulation.train_epoch` over all steps'
            micro-batches as one loader: ``params`` and ``stats`` only).
        use_no_sync: skip the synchronisation of all micro-batches but the last
            (``"tokens"``, ``"seed"`` and ``"trainer"``).
        lr, optimizer_class, optimizer_kwargs: the optimizer (AdamW by default).
    Returns:
        A :class:`~dtlib.models.run.RunResult`: ``grads`` (first step), ``params``
        (after the last step), and ``grad_allreduces``, ``count_allreduces`` (per
        step, this rank), ``tokens`` (per step, this rank), ``n_buckets`` (gradient
        all-reduces of one synchronised backward) by key.

    Taught in: Chapter 8, "Accumulation under DDP".
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed; allowed: {METHODS}")
    world = ddist.world()
    make = DataParallelism if use_no_sync or method == "local_tokens" \
        else SyncEveryMicroBatch
    par = make(variant, bucket_cap_mb=bucket_cap_mb)
    model = par.apply(build_gpt(cfg, seed))
    opt = par.make_optimizer(model, optimizer_class,
                             **{"lr": lr, **(optimizer_kwargs or {})})
    groups = global_groups(cfg, world.world_size, accum_steps, micro_batch, steps)
    # This rank's micro-batches of step s: entries k * world_size + rank.
    mine = [[g[k * world.world_size + world.rank] for k in range(accum_steps)]
            for g in groups]
    if method == "trainer":
        stats = train_epoch(par, model, opt, [mb for m in mine for mb in m],
                            accum_steps)
        return RunResult(params=par.full_state(model), extra={"stats": stats})
    if method == "tokens":
        step_fn = accumulation_step(accum_steps)
    elif method == "seed":
        step_fn = _seed_step(accum_steps, use_no_sync)
    else:
        step_fn = local_tokens_accumulate_step
    extra: dict[str, list[int]] = {"grad_allreduces": [], "count_allreduces": [],
                                   "tokens": []}
    device = world.device
    config = RunConfig(steps, step_fn=_counted(step_fn, extra), local_batches=True)
    out = run_steps(par, None,
                    lambda s: [tuple(t.to(device) for t in mb) for mb in mine[s]],
                    config, TrainState(model, opt))
    out.extra.update(extra)
    synced_once = use_no_sync or method == "local_tokens"
    out.extra["n_buckets"] = extra["grad_allreduces"][-1] // (
        1 if synced_once else accum_steps)
    return out


def local_tokens_accumulate_step(par: Parallelism, wrapped: nn.Module,
                                 batch: list[MicroBatch], loss_fn: Any,
                                 scaler: Any = None) -> torch.Tensor:
    """:func:`local_tokens_accumulate` as a ``step_fn`` of the one loop."""
    return local_tokens_accumulate(par, wrapped, batch)


def ddp_suite(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`ddp_accumulation` for each keyword set in ``runs``, in one launch."""
    results = []
    for kwargs in runs:
        dist.barrier()
        results.append(ddp_accumulation(**kwargs))
    return results
