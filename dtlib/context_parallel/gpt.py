"""The book's GPT trained with context parallelism.

Every layer of a transformer but attention acts on each token alone, so with the
sequence split across ranks (load-balanced, :func:`cp_shard`) the embeddings, norms,
MLPs, head and loss run unchanged on the local tokens. Two things need care:

- attention mixes tokens: each block's attention core becomes :func:`ring_attention`;
- the position embedding must be looked up at each token's *global* position.

Every rank holds the whole model and computes the mean loss of its own ``s / cp``
tokens; the ranks' gradients are then averaged, exactly as in data parallelism (the
mean of the ranks' means is the mean over all tokens, since every rank has the same
number of tokens). The ring's backward has already brought every rank the dK/dV that
other ranks' queries contributed, so the averaged gradient is the full one.

In the one loop (:func:`~dtlib.models.run.run_steps`) this is
:func:`dtlib.context_parallel.parallelism`: :class:`ContextParallelGPT` feeds the
global positions, ``local_batch`` keeps this rank's tokens, and ``grad_sync``
averages the gradients.

Taught in: Chapter 12, "A GPT trained with context parallelism".
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.context_parallel.ring_attention import ring_attention
from dtlib.context_parallel.sharding import cp_shard, cp_world, positions


def context_parallelize(model: nn.Module, group: Any = None) -> nn.Module:
    """Make every block of a ``dtlib.models.gpt.GPT`` attend through the ring, in place.

    Args:
        model: the GPT, identical on every rank (same seed); dropout must be 0 (the
            ring has no attention dropout).
        group: the context-parallel process group (``None``: the default group).
    Returns:
        ``model``; feed it with :func:`cp_loss`.

    Taught in: Chapter 12, "A GPT trained with context parallelism".
    """
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "blocks"):
        raise ValueError(f"model={type(model).__name__} must be a dtlib.models.gpt.GPT")
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout} must be 0 with context parallelism "
                         "(ring attention has no attention dropout)")
    for block in model.blocks:
        block.attn.core_fn = functools.partial(ring_attention, causal=True, group=group)
    return model


class ContextParallelGPT(nn.Module):
    """A GPT after :func:`context_parallelize` fed with this rank's tokens only.

    ``forward(idx, targets)`` takes this rank's load-balanced share of the tokens
    (:func:`cp_shard` along dim 1) and looks the position embedding up at their
    global positions. The GPT is ``.module`` (parameter names unchanged underneath).

    Taught in: Chapter 12, "A GPT trained with context parallelism".
    """

    def __init__(self, module: nn.Module, group: Any = None) -> None:
        super().__init__()
        self.module, self.group = module, group

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> Any:
        rank, cp = cp_world(self.group)
        pos = positions(idx.size(1), rank, cp, idx.device)  # global positions
        return self.module(idx, targets, pos=pos)


def cp_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
            group: Any = None) -> torch.Tensor:
    """This rank's mean loss over its load-balanced share of the tokens.

    Args:
        model: a GPT after :func:`context_parallelize`.
        idx, targets: the full ``(batch, seq)`` batch, the same on every rank;
            ``seq`` divisible by ``2 * cp``.
        group: the context-parallel process group.
    Returns:
        The scalar loss of the local tokens (average it over ranks for the global loss).

    Taught in: Chapter 12, "A GPT trained with context parallelism".
    """
    rank, cp = cp_world(group)
    idx_local, tgt_local = cp_shard(idx, 1, group), cp_shard(targets, 1, group)
    pos = positions(idx_local.size(1), rank, cp, idx.device)  # global positions
    return model(idx_local, tgt_local, pos=pos)[1]


def average_cp_grads(model: nn.Module, group: Any = None) -> None:
    """Average every gradient over the context-parallel group (as DDP does).

    Args:
        model: the GPT after a backward of :func:`cp_loss`.
        group: the context-parallel process group.
    Returns:
        None; ``p.grad`` is the gradient of the mean loss over all tokens.

    Taught in: Chapter 12, "A GPT trained with context parallelism".
    """
    _, cp = cp_world(group)
    if cp == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= cp
