"""Accumulation against the large batch: data, references, and the rank functions.

- :func:`variable_length_dataset` and :func:`pad_collate`: sequences of different
  lengths, padded per micro-batch with ``targets = -100``, so micro-batches hold
  different numbers of real tokens (the case where the mean of means goes wrong);
- :func:`large_batch` and :func:`reference_steps`: one process, the whole accumulated
  batch at once (the truth);
- :func:`ddp_accumulation` (a rank function for :func:`dtlib.runtime.launch.spawn`): one rank
  of DDP training with accumulation, by a chosen method, counting all-reduces.

Taught in: Chapter 8, "Equal to the large batch" and "Accumulation under DDP".
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.runtime import dist as ddist
from dtlib.accumulation.micro_batches import (IGNORE_INDEX, MicroBatch, accumulate_gradients,
                                count_tokens, train_epoch)
from dtlib.chapters.ch08_gradient_accumulation.seed import seed_accumulate
from dtlib.chapters.ch03_data_parallel.runs import TINY, wrap
from dtlib.models.reference import grads_of, params_of, train_reference
from dtlib.models.gpt import GPTConfig, build_gpt

METHODS = ("tokens", "seed", "local_tokens", "trainer")
__all__ = ["TINY", "METHODS", "variable_length_dataset", "pad_collate",
           "variable_length_batches", "large_batch", "large_batch_grads",
           "reference_steps", "relative_error", "global_groups", "ddp_accumulation",
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
                    lr: float = 1e-3, seed: int = 0) -> dict[str, Any]:
    """One process, one AdamW step per group on the group's large batch.

    Returns:
        ``{"grads": first step's gradients, "params": after the last step,
        "losses": [large-batch mean loss per step]}``.
    """
    return train_reference(build_gpt(cfg, seed), (large_batch(g) for g in groups), lr=lr)


def global_groups(cfg: GPTConfig, world_size: int, accum_steps: int,
                  micro_batch: int, steps: int) -> list[list[MicroBatch]]:
    """Step ``s``'s micro-batches, all ranks together; rank ``r``'s ``k``-th micro-batch
    is entry ``k * world_size + r``."""
    return [variable_length_batches(cfg, world_size * accum_steps, micro_batch,
                                    seed=1000 + s) for s in range(steps)]


def _local_tokens_accumulate(model: nn.Module, group: Sequence[MicroBatch]) -> None:
    """Token-normalised on this rank only (no all-reduce of the count): DDP then
    averages per-rank means, wrong when ranks hold different numbers of tokens."""
    local = sum(count_tokens(mb) for mb in group)
    for i, (idx, targets) in enumerate(group):
        quiet = i < len(group) - 1
        with model.no_sync() if quiet else contextlib.nullcontext():
            logits = model(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                   targets.reshape(-1), reduction="sum")
            (loss / local).backward()


def ddp_accumulation(cfg: GPTConfig, variant: str, accum_steps: int, micro_batch: int,
                     steps: int, method: str = "tokens", use_no_sync: bool = True,
                     lr: float = 1e-3, seed: int = 0, bucket_cap_mb: float = 0.02
                     ) -> dict[str, Any]:
    """One rank of DDP training with gradient accumulation (a rank function).

    Args:
        cfg: the GPT.
        variant: ``"torch"`` or a :class:`dtlib.data_parallel.DataParallel` mode.
        accum_steps: micro-batches per rank per optimizer step.
        micro_batch: sequences per micro-batch.
        steps: AdamW steps.
        method: ``"tokens"`` (:func:`dtlib.accumulation.accumulate_gradients`),
            ``"seed"`` (mean / accum_steps), ``"local_tokens"`` (per-rank count),
            ``"trainer"`` (:func:`dtlib.accumulation.train_epoch` over all steps'
            micro-batches as one loader: returns ``params`` and ``stats`` only).
        use_no_sync: for ``"tokens"``, ``"seed"`` and ``"trainer"``.
    Returns:
        ``grads`` (first step), ``params`` (after the last step), ``grad_allreduces``
        and ``count_allreduces`` (per step, this rank), ``tokens`` (per step, this
        rank), ``n_buckets`` (gradient all-reduces of one synchronised backward).
    """
    from dtlib.collectives.accounting import count_comms, ddp_comm_hook_accounting

    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed; allowed: {METHODS}")
    world = ddist.world()
    model = wrap(build_gpt(cfg, seed).to(world.device), variant, bucket_cap_mb)
    if variant == "torch":
        ddp_comm_hook_accounting(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out: dict[str, Any] = {"grad_allreduces": [], "count_allreduces": [], "tokens": []}
    groups = global_groups(cfg, world.world_size, accum_steps, micro_batch, steps)
    if method == "trainer":
        # This rank's micro-batches of every step, as one loader (left on the CPU:
        # train_epoch moves them to the rank's device).
        loader = [g[k * world.world_size + world.rank] for g in groups
                  for k in range(accum_steps)]
        out["stats"] = train_epoch(model, opt, loader, accum_steps,
                                   use_no_sync=use_no_sync)
        out["params"] = params_of(model.module)
        return out
    for step, group in enumerate(groups):
        mine = [tuple(t.to(world.device) for t in group[k * world.world_size
                                                         + world.rank])
                for k in range(accum_steps)]
        with count_comms(functional=False) as log:
            if method == "tokens":
                accumulate_gradients(model, mine, use_no_sync=use_no_sync)
            elif method == "seed":
                seed_accumulate(model, mine, accum_steps, use_no_sync=use_no_sync)
            else:
                _local_tokens_accumulate(model, mine)
        # A gradient bucket is never one element; the token count always is.
        ar = [r for r in log.records if r.op == "all_reduce"]
        out["grad_allreduces"].append(sum(r.numel > 1 for r in ar))
        out["count_allreduces"].append(sum(r.numel == 1 for r in ar))
        out["tokens"].append(sum(count_tokens(mb) for mb in mine))
        if step == 0:
            out["grads"] = grads_of(model.module)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = params_of(model.module)
    synced_once = use_no_sync or method == "local_tokens"
    out["n_buckets"] = out["grad_allreduces"][-1] // (1 if synced_once else accum_steps)
    return out


def ddp_suite(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`ddp_accumulation` for each keyword set in ``runs``, in one launch."""
    results = []
    for kwargs in runs:
        dist.barrier()
        results.append(ddp_accumulation(**kwargs))
    return results
