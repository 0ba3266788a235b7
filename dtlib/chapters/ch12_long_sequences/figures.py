"""Figures of Chapter 12 (matplotlib imported inside the functions).

- :func:`plot_recompute_memory`: saved bytes per block against sequence length, for
  no recomputation, fused attention, selective and full recomputation: measured
  points on the formula's lines.
- :func:`plot_load_balance`: causal attention work per rank, contiguous pieces vs the
  load-balanced layout.

Taught in: Chapter 12, long sequences.
"""

from __future__ import annotations

from typing import Any

from dtlib.context_parallel.sharding import causal_pairs_per_rank

_COLORS = {"none": "#C44E52", "sdpa": "#DD8452", "selective": "#4C72B0",
           "full": "#55A868"}
_LABELS = {"none": "explicit attention, no recomputation",
           "sdpa": "fused attention (SDPA)", "selective": "selective recomputation",
           "full": "full recomputation"}


def plot_recompute_memory(seq_lens: list[int], measured: dict[str, list[int]],
                          formula: dict[str, list[int]]) -> Any:
    """Saved KiB per block vs sequence length: formula as lines, measurement as dots.

    Args:
        seq_lens: the sequence lengths measured.
        measured, formula: ``{variant: [bytes per seq_len]}`` with variants among
            ``"none"``, ``"sdpa"``, ``"selective"``, ``"full"``.
    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key, values in formula.items():
        ax.plot(seq_lens, [v / 1024 for v in values], color=_COLORS[key],
                label=_LABELS[key])
        ax.plot(seq_lens, [v / 1024 for v in measured[key]], "o", color=_COLORS[key])
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel("saved for backward per block (KiB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_title("Only the explicit attention grows as s²")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_load_balance(seq_len: int, cp: int) -> Any:
    """Unmasked query-key pairs per rank under a causal mask, two layouts.

    Args:
        seq_len: full sequence length (divisible by ``2 * cp``).
        cp: context-parallel ranks.
    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    ranks = list(range(cp))
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    width = 0.4
    for offset, balanced, label, color in ((-width / 2, False, "contiguous pieces",
                                            "#C44E52"),
                                           (width / 2, True, "chunks r and 2cp-1-r",
                                            "#4C72B0")):
        pairs = causal_pairs_per_rank(seq_len, cp, balanced)
        ax.bar([r + offset for r in ranks], pairs, width, label=label, color=color)
    ax.set_xticks(ranks)
    ax.set_xlabel("rank")
    ax.set_ylabel("unmasked (query, key) pairs")
    ax.set_title("Two chunks per rank even out the causal work")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
