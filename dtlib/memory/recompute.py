"""Activation recomputation: keep less for backward, compute part of the forward again.

Two modes of Korthikanti et al. (2022), built on ``torch.utils.checkpoint``:

- **full**: each transformer block is one checkpointed region. Only its input
  (``sbh`` values) is kept; backward runs the block's forward again, which costs one
  more forward pass of every layer: ``24 bsh^2 + 4 bs^2 h`` FLOPs per layer.
- **selective**: only the attention core (``QK^T``, mask, softmax, dropout,
  ``x V``) is checkpointed. It stores the ``5 as^2 b`` bytes that grow with ``s^2``
  yet costs little to recompute: the two ``s x s`` matmuls, ``4 b s^2 h`` FLOPs
  per layer.

Production equivalents: ``apply_activation_checkpointing`` (torch.distributed's
checkpoint wrapper) for full, ``create_selective_checkpoint_contexts`` (an op-level
save/recompute policy) for selective; FlashAttention-style kernels
(``scaled_dot_product_attention``) make the selective saving by construction.

Taught in: Chapter 12, "Recomputation".
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable

import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from dtlib.memory.measure import gpt_layer_activation_terms, measure_activations
from dtlib.models.gpt import build_gpt, token_batch

RECOMPUTE_MODES = ("none", "selective", "full")


def _checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        # non-reentrant: works with any inputs, nests, and its saved inputs are seen
        # by saved_tensors_hooks (so measure_activations counts them)
        return checkpoint(fn, *args, use_reentrant=False)

    return run


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make a ``dtlib.models.gpt.GPT`` recompute activations in backward, in place.

    Args:
        model: the GPT (its blocks have ``attn.core`` / ``attn.core_fn``).
        mode: ``"none"`` (nothing changes), ``"selective"`` (checkpoint each attention
            core) or ``"full"`` (checkpoint each block).
    Returns:
        ``model``; parameter names and results are unchanged (only what is saved and
        when it is computed change).

    Taught in: Chapter 12, "Recomputation".
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"mode={mode!r} is not a recomputation mode; allowed: "
                         f"{RECOMPUTE_MODES}")
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"model={type(model).__name__} has no .blocks; expected a "
                         "dtlib.models.gpt.GPT")
    for block in blocks:
        if mode == "full":
            # an instance attribute shadows the class's forward; names stay the same
            block.forward = _checkpointed(block.forward)
        elif mode == "selective":
            attn = block.attn
            attn.core_fn = _checkpointed(attn.core_fn or attn.core)
    return model


def recompute_activation_terms(seq_len: int, micro_batch: int, hidden: int,
                               n_heads: int, mode: str, *, attention: str = "explicit",
                               dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes one block saves for backward, per term, under a recomputation mode.

    Starts from Chapter 1's exact itemisation of a block without dropout
    (``gpt_layer_activation_terms``) and removes what each mode does not keep:

    - selective: the softmax output and the causal mask (``5 as^2 b`` in the paper's
      16-bit, with-dropout accounting; ``e as^2 b + s^2`` here).
    - full: everything but the block input, ``e sbh`` (the paper's ``2 sbh``).
    - ``attention="sdpa"`` without recomputation: the fused kernel keeps no ``s x s``
      tensor, only the fp32 log-sum-exp ``(b, a, s)`` beside q, k, v and its output.
      (The output costs nothing extra on CPU: the kernel lays it out as
      ``(b, s, a, h/a)``, so it is the very storage the output projection saves.)

    Args:
        seq_len, micro_batch, hidden, n_heads: s, b, h, a.
        mode: ``"none"``, ``"selective"`` or ``"full"``.
        attention: ``"explicit"`` or ``"sdpa"`` (the GPT's attention core).
        dtype_bytes: bytes per value (4: the book's fp32 CPU runs).
    Returns:
        ``{term: bytes}``; the sum is what :func:`measure_recompute_layer` measures.

    Taught in: Chapter 12, "Recomputation".
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"mode={mode!r} is not a recomputation mode; allowed: "
                         f"{RECOMPUTE_MODES}")
    if attention not in ("explicit", "sdpa"):
        raise ValueError(f"attention={attention!r} must be 'explicit' or 'sdpa'")
    s, b, h, a, e = seq_len, micro_batch, hidden, n_heads, dtype_bytes
    if mode == "full":
        return {"block input": e * s * b * h}
    terms = gpt_layer_activation_terms(s, b, h, a, dtype_bytes=e, dropout=False)
    if mode == "selective" or attention == "sdpa":
        for key in ("softmax output", "attention dropout mask + output",
                    "causal mask (s x s bools)"):
            terms.pop(key)
    if mode == "none" and attention == "sdpa":
        terms["fused attention log-sum-exp (fp32)"] = 4 * b * a * s
    return terms


def recompute_extra_flops(seq_len: int, micro_batch: int, hidden: int, n_layers: int,
                          mode: str, early_stop: bool = False) -> int:
    """Matmul FLOPs that recomputation adds to one training step.

    Korthikanti et al. 2022 §5: a layer's forward is ``24 bsh^2 + 4 bs^2 h`` FLOPs
    (qkv 6, proj 2, MLP 16 ``bsh^2``; ``QK^T`` and ``x V`` ``2 bs^2 h`` each). Full
    recomputation runs it again; selective runs only the two attention matmuls.
    ``torch.utils.checkpoint`` by default stops recomputing as soon as every tensor
    backward needs is back ("early stop"), so it skips the region's last matmul,
    whose output nobody saved: ``x V`` (selective) or the MLP's second matmul,
    ``8 bsh^2`` (full).

    Args:
        seq_len, micro_batch, hidden, n_layers: s, b, h, l.
        mode: ``"none"``, ``"selective"`` or ``"full"``.
        early_stop: whether the recomputation stops early (torch's default) or reruns
            the whole region (the paper's count).
    Returns:
        Extra FLOPs per step (0 for ``"none"``).

    Taught in: Chapter 12, "Recomputation".
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"mode={mode!r} is not a recomputation mode; allowed: "
                         f"{RECOMPUTE_MODES}")
    s, b, h, l = seq_len, micro_batch, hidden, n_layers
    attention = 4 * b * s * s * h
    per_layer = {"none": 0, "selective": attention,
                 "full": 24 * b * s * h * h + attention}
    skipped = {"none": 0, "selective": attention // 2, "full": 8 * b * s * h * h}
    return l * (per_layer[mode] - (skipped[mode] if early_stop else 0))


def _gpt(cfg: Any, mode: str, seed: int) -> nn.Module:
    return apply_recompute(build_gpt(cfg, seed=seed).train(), mode)


def measure_recompute_layer(cfg: Any, micro_batch: int, mode: str,
                            seed: int = 0) -> int:
    """Measured bytes one block saves for backward under ``mode`` (CPU, fp32).

    As Chapter 1's ``measure_gpt_layer``: the model with ``n_layers + 1`` blocks minus
    the one with ``n_layers``, which cancels embeddings, final norm and loss.

    Args:
        cfg: a ``dtlib.models.gpt.GPTConfig`` (``attention`` chooses the core).
        micro_batch: sequences per batch.
        mode: ``"none"``, ``"selective"`` or ``"full"``.
        seed: weights and batch seed.
    Returns:
        Bytes (compare with ``sum(recompute_activation_terms(...).values())``).

    Taught in: Chapter 12, "Recomputation".
    """
    totals = []
    for n_layers in (cfg.n_layers, cfg.n_layers + 1):
        c = replace(cfg, n_layers=n_layers)
        idx, targets = token_batch(c, micro_batch, seed=seed)
        model = _gpt(c, mode, seed)
        totals.append(measure_activations(model, idx, targets).activations)
    return totals[1] - totals[0]


def measure_recompute_flops(cfg: Any, micro_batch: int, mode: str,
                            early_stop: bool = False, seed: int = 0) -> int:
    """Matmul FLOPs of one forward + backward under ``mode`` minus those without.

    Counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls; it has no
    formula for the CPU fused-attention kernel, so use ``attention="explicit"``),
    which also sees the forward that checkpointing re-runs inside backward.

    Args:
        cfg, micro_batch, mode, seed: as :func:`measure_recompute_layer`.
        early_stop: let checkpointing stop recomputing early (torch's default).
    Returns:
        Extra FLOPs (compare with :func:`recompute_extra_flops`).

    Taught in: Chapter 12, "Recomputation".
    """
    from torch.utils.flop_counter import FlopCounterMode

    idx, targets = token_batch(cfg, micro_batch, seed=seed)
    counts = []
    for m in ("none", mode):
        model = _gpt(cfg, m, seed)
        with FlopCounterMode(display=False) as counter, \
                set_checkpoint_early_stop(early_stop):
            _, loss = model(idx, targets)
            loss.backward()
        counts.append(counter.get_total_flops())
    return counts[1] - counts[0]
