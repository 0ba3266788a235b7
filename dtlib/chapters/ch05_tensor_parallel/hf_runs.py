"""Rank functions that put a tensor-parallel Hugging Face Llama next to one process.

- :func:`llama_reference`: one process trains the tiny Llama (the truth);
- :func:`llama_tp_rank`: one rank of the same training, tensor-parallel with the
  book's layers ("ours") or torch's DTensor plan ("dtensor").

Both are the one loop (``run_steps``) with SGD with momentum, whose step is linear in
the gradient: equal gradients give equal trajectories, to rounding.

Taught in: Chapter 5, "A Hugging Face Llama".
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models import hf
from dtlib.models.run import (Parallelism, RunConfig, RunResult, TrainState,
                              local_tensor, run_steps)
from dtlib.runtime import dist as ddist
from dtlib.tensor_parallel import VARIANTS, parallelism

__all__ = ["TINY_LLAMA", "VARIANTS", "OPTIMIZER", "llama_loss", "llama_run",
           "llama_reference", "llama_tp_rank"]

#: vocab 128, hidden 64, 2 layers, 4 heads (2 per rank at tp = 2, 1 at tp = 4).
TINY_LLAMA = dict(vocab_size=128, hidden=64, n_layers=2, n_heads=4, seq_len=16)
#: The optimizer of both runs: SGD with momentum (see the module docstring).
OPTIMIZER = dict(lr=0.05, momentum=0.9)


def _batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    rows = torch.randint(0, TINY_LLAMA["vocab_size"],
                         (batch, TINY_LLAMA["seq_len"] + 1), generator=gen)
    device = ddist.world().device
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def llama_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of an HF causal LM (``model(x).logits``).

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    logits = model(x).logits  # ModelOutput; (batch, seq_len, vocab) on every rank
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def llama_run(par: Parallelism, steps: int = 3, batch: int = 4, seed: int = 0
              ) -> RunResult:
    """The tiny Llama trained under ``par`` (the one loop, SGD with momentum).

    Args:
        par: the technique (``Parallelism()``: one process).
        steps, batch, seed: optimizer steps (:data:`OPTIMIZER`), rows of the one
            batch, seed of the model and the batch.
    Returns:
        The :class:`~dtlib.models.run.RunResult` (``losses``, full first-step
        ``grads``, full final ``params``) and ``local_numel`` (elements this rank
        stores).

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    model = hf.build_hf_llama(hf.llama_config(**TINY_LLAMA), seed=seed)
    model = par.apply(model.to(ddist.world().device))
    data = _batch(batch, seed)  # every step the same batch, on every rank
    config = RunConfig(steps, optimizer_class=torch.optim.SGD,
                       optimizer_kwargs=OPTIMIZER, loss_fn=llama_loss)
    result = run_steps(par, None, lambda step: data, config, TrainState(model))
    result.extra["local_numel"] = sum(local_tensor(p).numel()
                                      for p in model.parameters())
    return result


def llama_reference(steps: int = 3, batch: int = 4, seed: int = 0) -> RunResult:
    """One process: ``losses``, first-step ``grads`` and final ``params``.

    Args:
        steps, batch, seed: as :func:`llama_run`.
    Returns:
        The :class:`~dtlib.models.run.RunResult`.

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    return llama_run(Parallelism(), steps, batch, seed)


def llama_tp_rank(variant: str, steps: int = 3, batch: int = 4,
                  seed: int = 0) -> RunResult:
    """On every rank: the same training, tensor-parallel over all ranks.

    Args:
        variant: ``"ours"`` (ColumnParallelLinear / RowParallelLinear) or
            ``"dtensor"`` (``parallelize_module`` with ColwiseParallel /
            RowwiseParallel).
        steps, batch, seed: as :func:`llama_run`.
    Returns:
        :func:`llama_run`'s result (full ``grads`` and ``params`` on every rank).

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    return llama_run(parallelism(variant), steps, batch, seed)
