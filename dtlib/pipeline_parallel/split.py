"""Pipeline parallelism, part 1: cutting the GPT into stages, and what a stage costs.

A pipeline puts consecutive layers of one model on different ranks. Rank s holds stage
s; activations flow forward from stage s to s + 1, their gradients flow back. This
module cuts :class:`dtlib.models.GPT` into stages (:func:`split_gpt`), estimates what
each piece costs (:func:`gpt_layer_costs`) and finds the contiguous split whose slowest
stage is as fast as possible (:func:`balance`). The schedules that run the stages live
in :mod:`dtlib.pipeline_parallel.schedules`.

Tied weights. The GPT ties its token embedding to its output head by default. In a
pipeline the embedding sits on the first stage and the head on the last, so a tied
weight would live on two ranks and its gradient would have to be summed across them
(an all-reduce between first and last stage after every backward, as Megatron-LM does
for its "embedding group"). We take the simpler road: pipelined models are built with
``GPTConfig(tie_weights=False)`` and :func:`split_gpt` refuses a tied model, so every
parameter has exactly one owner.

Taught in: Chapter 6, "Cutting the model into stages".
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from dtlib.models.gpt import GPT, GPTConfig

__all__ = ["GPTStage", "RankStages", "split_gpt", "balanced_layers", "balance",
           "gpt_layer_costs",
           "stage_costs", "layers_from_split_points"]


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`~dtlib.models.GPT`: a run of blocks, plus the
    embeddings on the first stage and the final LayerNorm and head on the last.

    The modules are the original model's (not copies), and blocks are kept under their
    original index (``blocks.5.ln1.weight``), so a stage's ``named_parameters()`` use
    the same names as the whole model's: comparing with single-process training is a
    dictionary lookup.

    ``forward(x)``: token ids ``(b, s)`` on the first stage, activations ``(b, s, h)``
    elsewhere; returns activations ``(b, s, h)``, or logits ``(b, s, V)`` on the last.
    """

    def __init__(self, model: GPT, first_block: int, n_blocks: int, is_first: bool,
                 is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.block_range = (first_block, first_block + n_blocks)
        if is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
            self.drop = model.drop
        last_block = first_block + n_blocks
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in range(first_block, last_block)})
        if is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # (b, s) token ids -> (b, s, h)
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:  # (b, s, h) -> (b, s, V)
            x = self.head(self.ln_f(x))
        return x


class RankStages(nn.Module):
    """The stages one rank holds when a schedule gives it several (interleaved:
    stages ``r, r + p, ...``; V-shaped: ``r`` and ``2p - 1 - r``), as one module
    whose ``named_parameters()`` use the whole model's names, like one
    :class:`GPTStage`'s. The schedule runs the stages themselves (``stages``); this
    module only holds them for the optimizer, clipping and comparison.

    Taught in: Chapter 12, "Interleaving the pipeline".
    """

    def __init__(self, stages: Sequence[GPTStage]) -> None:
        super().__init__()
        self.stages = list(stages)  # plain list: not registered twice
        self.blocks = nn.ModuleDict()
        for st in stages:
            if st.is_first:
                self.tok_emb, self.pos_emb, self.drop = st.tok_emb, st.pos_emb, st.drop
            self.blocks.update(st.blocks)
            if st.is_last:
                self.ln_f, self.head = st.ln_f, st.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("RankStages holds a rank's stages for the optimizer; the "
                           "schedule runs each stage in its own turn")


def balanced_layers(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage, as equal as possible, the extra ones on the middle stages.

    The first and last stages also carry the embeddings and the head, so the remainder
    goes to the stages in between first (``10`` blocks on ``4`` stages: 2, 3, 3, 2).

    Args:
        n_layers: transformer blocks in the model.
        n_stages: pipeline stages, ``1 <= n_stages <= n_layers``.
    Returns:
        ``n_stages`` positive integers summing to ``n_layers``.

    Taught in: Chapter 6, "Cutting the model into stages".
    """
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages={n_stages!r} must be a positive integer")
    if n_stages > n_layers:
        raise ValueError(f"n_stages={n_stages} must be <= n_layers={n_layers}: "
                         "every stage needs at least one block")
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    middle_first = list(range(1, n_stages - 1)) + [0, n_stages - 1]
    for s in middle_first[:extra]:
        counts[s] += 1
    return counts


def split_gpt(model: GPT, n_stages: int,
              layers_per_stage: Sequence[int] | None = None) -> list[GPTStage]:
    """Cut ``model`` into ``n_stages`` consecutive stages.

    Args:
        model: a GPT built with ``tie_weights=False`` (see the module docstring).
        n_stages: number of stages (the pipeline depth ``pp``).
        layers_per_stage: blocks on each stage; default :func:`balanced_layers`.
    Returns:
        The stages, first to last. They share parameters with ``model``.

    Taught in: Chapter 6, "Cutting the model into stages".
    """
    n_layers = model.cfg.n_layers
    counts = list(layers_per_stage) if layers_per_stage is not None else \
        balanced_layers(n_layers, n_stages)
    if layers_per_stage is not None:
        bad = any(not isinstance(c, int) or c < 1 for c in counts)
        if len(counts) != n_stages or bad or sum(counts) != n_layers:
            raise ValueError(f"layers_per_stage={counts!r} must be {n_stages} positive "
                             f"integers summing to n_layers={n_layers}")
        balanced_layers(n_layers, n_stages)  # validates n_stages
    if model.cfg.tie_weights and n_stages > 1:
        raise ValueError("model has tie_weights=True: the tied embedding/head weight "
                         "would live on two stages; build it with "
                         "GPTConfig(tie_weights=False) for pipelining")
    stages, start = [], 0
    for s, n in enumerate(counts):
        stages.append(GPTStage(model, start, n, s == 0, s == n_stages - 1))
        start += n
    return stages


def layers_from_split_points(n_layers: int, split_points: Sequence[int]) -> list[int]:
    """Blocks per stage for a ``split_spec`` that starts a new stage at the BEGINNING
    of each block in ``split_points`` (``{"layers.5": SplitPoint.BEGINNING, ...}``).

    ``layers_from_split_points(24, [5, 11, 17]) == [5, 6, 6, 7]``: not "every 6".

    Taught in: Chapter 6, "Balancing the stages" (ERRATA 22).
    """
    bounds = [0, *split_points, n_layers]
    if any(b >= a for a, b in zip(bounds[1:], bounds[:-1])) or bounds[-2] >= n_layers:
        raise ValueError(f"split_points={list(split_points)!r} must increase strictly "
                         f"within 1..{n_layers - 1}")
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def gpt_layer_costs(cfg: GPTConfig, tokens: int = 1) -> list[float]:
    """Forward matmul FLOPs of the pieces a split can separate: the embeddings, each
    block, then final LayerNorm + head (backward costs about twice each, so the
    ratios hold for forward + backward too).

    A block does ``24 h^2`` FLOPs per token in its linear layers (QKV 6h^2, projection
    2h^2, MLP 16h^2) plus ``4 s h`` in attention scores and the weighted sum
    (Narayanan et al., 2021); the head does ``2 h V``; an embedding lookup does
    no matmul (we count its ``h`` additions).

    Args:
        cfg: the model's shape.
        tokens: tokens per micro-batch (scales every entry).
    Returns:
        ``[embedding, block_0, ..., block_{l-1}, head]`` in FLOPs.

    Taught in: Chapter 6, "Balancing the stages".
    """
    h, s, v = cfg.hidden, cfg.seq_len, cfg.vocab_size
    block = 24 * h * h + 4 * s * h
    return [float(tokens * h)] + [float(tokens * block)] * cfg.n_layers + \
        [float(tokens * 2 * h * v)]


def stage_costs(layer_costs: Sequence[float],
                layers_per_stage: Sequence[int]) -> list[float]:
    """Sum ``gpt_layer_costs`` per stage: the embedding joins stage 0, the head the
    last.

    Taught in: Chapter 6, "Balancing the stages".
    """
    if sum(layers_per_stage) != len(layer_costs) - 2:
        raise ValueError(f"layers_per_stage={list(layers_per_stage)!r} must sum to the "
                         f"{len(layer_costs) - 2} blocks in layer_costs")
    blocks = list(layer_costs[1:-1])
    out, start = [], 0
    for n in layers_per_stage:
        out.append(float(sum(blocks[start:start + n])))
        start += n
    out[0] += layer_costs[0]
    out[-1] += layer_costs[-1]
    return out


def balance(layer_costs: Sequence[float], n_stages: int) -> list[int]:
    """Cut ``layer_costs`` (``[embedding, blocks..., head]``) into ``n_stages`` runs of
    blocks minimising the cost of the slowest stage (every stage keeps >= 1 block).

    The step time of a pipeline is set by its slowest stage, so this is the split to
    want. Dynamic programming over prefixes, O(n_stages * l^2): tiny for real depths.

    Args:
        layer_costs: as returned by :func:`gpt_layer_costs` (or measured times).
        n_stages: number of stages.
    Returns:
        Blocks per stage, for ``split_gpt(..., layers_per_stage=...)``.

    Taught in: Chapter 6, "Balancing the stages".
    """
    n_blocks = len(layer_costs) - 2
    balanced_layers(n_blocks, n_stages)  # validates n_stages against the depth
    if any(c < 0 for c in layer_costs):
        raise ValueError("layer_costs must be non-negative")
    blocks = list(layer_costs[1:-1])
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        extra = (layer_costs[0] if s == 0 else 0.0) + \
            (layer_costs[-1] if s == n_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[s][j]: the smallest max-stage-cost placing blocks 0..j-1 on stages 0..s.
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages)]
    for j in range(1, n_blocks + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n_blocks + 1):
            for i in range(s, j):
                c = max(best[s - 1][i], cost(s, i, j))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    counts, j = [], n_blocks
    for s in range(n_stages - 1, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]
