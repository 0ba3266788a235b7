"""The book's GPT with mixture-of-experts blocks: the MLP of a block becomes an MoE.

``moe_gpt(cfg, moe, layers)`` builds :func:`dtlib.models.build_gpt` (same weights
for everything else) and swaps the MLP of the chosen blocks for an
:class:`~dtlib.expert_parallel.moe.MoE` whose experts are MLPs of the same shape.
:func:`moe_loss` is the GPT's cross-entropy plus every MoE layer's auxiliary loss.

Taught in: Chapter 14, "An MoE GPT".
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from dtlib.expert_parallel.layer import ExpertParallelMoE
from dtlib.expert_parallel.moe import MoE, MoEConfig
from dtlib.models.gpt import GPT, Block, GPTConfig, build_gpt

__all__ = ["MoEBlock", "moe_gpt", "moe_loss", "moe_layers"]


class MoEBlock(nn.Module):
    """Pre-norm block with an MoE for an MLP: x + attn(ln(x)), then x + moe(ln(x)).

    A token the MoE drops entirely gets ``moe(ln(x)) = 0``: the residual passes it on.
    """

    def __init__(self, block: Block, moe: nn.Module) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.moe = block.ln1, block.attn, block.ln2, moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


def moe_gpt(cfg: GPTConfig, moe: MoEConfig, layers: Iterable[int] | None = None,
            seed: int = 0) -> GPT:
    """A GPT whose blocks ``layers`` (default: all) have MoE layers for MLPs.

    Args:
        cfg: the GPT's shape (no dropout: ranks must compute the same).
        moe: the MoE layers' configuration.
        layers: indices of the blocks to make MoE blocks.
        seed: the weights' seed; the same on every rank gives the same model.
    Returns:
        The model (a :class:`dtlib.models.GPT`).

    Taught in: Chapter 14, "An MoE GPT".
    """
    layers = list(range(cfg.n_layers)) if layers is None else sorted(set(layers))
    if any(not 0 <= i < cfg.n_layers for i in layers):
        raise ValueError(f"layers={layers} must lie in 0..{cfg.n_layers - 1}")
    model = build_gpt(cfg, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for i in layers:
            model.blocks[i] = MoEBlock(model.blocks[i], MoE(cfg.hidden, moe))
    return model


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every MoE layer of ``model`` (one process or expert-parallel), in order."""
    return [m for m in model.modules() if isinstance(m, (MoE, ExpertParallelMoE))]


def moe_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor
             ) -> torch.Tensor:
    """Cross-entropy plus the auxiliary losses of every MoE layer (a ``loss_fn``
    of :func:`dtlib.models.run_steps`).

    Taught in: Chapter 14, "An MoE GPT".
    """
    loss = model(idx, targets)[1]
    return sum((m.aux_loss for m in moe_layers(model)), loss)
