"""Rank functions that put a tensor-parallel Hugging Face Llama next to one process.

- :func:`llama_reference`: one process trains the tiny Llama (the truth);
- :func:`llama_tp_rank`: one rank of the same training, tensor-parallel with the
  book's layers ("ours") or torch's DTensor plan ("dtensor").

Taught in: Chapter 5, "A Hugging Face Llama".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.models import hf
from dtlib.tensor_parallel.hf_llama import (dtensor_parallelize_llama,
                                            full_parameters_tp,
                                            tensor_parallelize_llama)

__all__ = ["TINY_LLAMA", "IMPLS", "llama_reference", "llama_tp_rank"]

#: vocab 128, hidden 64, 2 layers, 4 heads (2 per rank at tp = 2, 1 at tp = 4).
TINY_LLAMA = dict(vocab_size=128, hidden=64, n_layers=2, n_heads=4, seq_len=16)
IMPLS = ("ours", "dtensor")


def _batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    rows = torch.randint(0, TINY_LLAMA["vocab_size"],
                         (batch, TINY_LLAMA["seq_len"] + 1), generator=gen)
    return rows[:, :-1], rows[:, 1:]


def _train(model: torch.nn.Module, steps: int, batch: int, lr: float,
           seed: int) -> list[float]:
    x, y = _batch(batch, seed)  # tensor parallel: every rank sees the whole batch
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        logits = model(x).logits  # ModelOutput; (batch, seq_len, vocab) everywhere
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def llama_reference(steps: int = 3, batch: int = 4, lr: float = 1e-2,
                    seed: int = 0) -> dict[str, Any]:
    """One process: ``{"losses", "params"}`` after ``steps`` AdamW steps.

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    model = hf.build_hf_llama(hf.llama_config(**TINY_LLAMA), seed=seed)
    losses = _train(model, steps, batch, lr, seed)
    return {"losses": losses, "params": full_parameters_tp(model)}


def llama_tp_rank(impl: str, steps: int = 3, batch: int = 4, lr: float = 1e-2,
                  seed: int = 0) -> dict[str, Any]:
    """On every rank: the same training, tensor-parallel over all ranks.

    Args:
        impl: ``"ours"`` (ColumnParallelLinear / RowParallelLinear) or
            ``"dtensor"`` (``parallelize_module`` with ColwiseParallel /
            RowwiseParallel).
    Returns:
        ``{"losses", "params" (full, rank 0 only), "local_numel"}``.

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} not allowed; allowed: {IMPLS}")
    model = hf.build_hf_llama(hf.llama_config(**TINY_LLAMA), seed=seed)
    if impl == "ours":
        tensor_parallelize_llama(model)
    else:
        dtensor_parallelize_llama(model)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                for p in model.parameters())
    losses = _train(model, steps, batch, lr, seed)
    params = full_parameters_tp(model)
    return {"losses": losses, "local_numel": local,
            "params": params if dist.get_rank() == 0 else {}}
