"""A language model must not see the future: a test for causal attention (ERRATA 23).

The seed's pipeline example builds its blocks from ``nn.MultiheadAttention`` and calls
it without an attention mask. Every position then attends to every other, later ones
included: the model is trained to predict token t + 1 while looking at it. The loss
falls beautifully and the model is useless for generation.

:func:`future_influence` makes the defect measurable: change the input at position
``t`` and report how much the outputs at positions ``< t`` moved. For a causal model the
answer is exactly zero.

Taught in: Chapter 6, "Seed defects" (ERRATA 23).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models.gpt import CausalSelfAttention, GPTConfig

__all__ = ["UnmaskedSelfAttention", "future_influence", "token_future_influence"]


class UnmaskedSelfAttention(nn.Module):
    """Self-attention as ``nn.MultiheadAttention(x, x, x)`` computes it without
    ``attn_mask``: the same projections as :class:`dtlib.models.CausalSelfAttention`,
    no mask. :meth:`from_causal` copies a causal layer's weights, so the two differ
    only in the mask."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    @classmethod
    def from_causal(cls, layer: CausalSelfAttention,
                    cfg: GPTConfig) -> "UnmaskedSelfAttention":
        """An unmasked twin of ``layer`` with the same weights."""
        twin = cls(cfg)
        twin.load_state_dict({k: v for k, v in layer.state_dict().items()
                              if k.startswith(("qkv", "proj"))})
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.n_heads, h // self.n_heads).transpose(1, 2)
                   for t in self.qkv(x).split(h, dim=2))
        att = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(k.size(-1)), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, s, h))


@torch.no_grad()
def future_influence(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     position: int) -> float:
    """Largest change of ``layer``'s output at positions ``< position`` when the input
    at ``position`` (``x[:, position]``, shape ``(b, s, h)``) is replaced by noise.

    Args:
        layer: maps ``(b, s, h) -> (b, s, h)``.
        x: an input.
        position: the position to change, ``1 <= position < s``.
    Returns:
        The max absolute difference over earlier positions: 0.0 for a causal layer.

    Taught in: Chapter 6, "Seed defects" (ERRATA 23).
    """
    if not 1 <= position < x.shape[1]:
        raise ValueError(f"position={position!r} must be in 1..{x.shape[1] - 1}")
    changed = x.clone()
    changed[:, position] = torch.randn_like(x[:, position])
    return (layer(changed)[:, :position] - layer(x)[:, :position]).abs().max().item()


@torch.no_grad()
def token_future_influence(model: nn.Module, idx: torch.Tensor, position: int,
                           vocab_size: int) -> float:
    """Like :func:`future_influence` for a whole language model: change token
    ``idx[:, position]`` and return the largest change of the logits at earlier
    positions. Taught in: Chapter 6, "Seed defects" (ERRATA 23)."""
    if not 1 <= position < idx.shape[1]:
        raise ValueError(f"position={position!r} must be in 1..{idx.shape[1] - 1}")
    changed = idx.clone()
    changed[:, position] = (idx[:, position] + 1) % vocab_size
    return (model(changed)[:, :position] - model(idx)[:, :position]).abs().max().item()
