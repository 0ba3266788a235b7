"""Figures of Chapter 14 (matplotlib imported inside the functions).

- :func:`plot_load_imbalance`: the busiest expert's tokens over the mean, per
  training step, with and without the load-balancing loss.

Taught in: Chapter 14, mixture of experts.
"""

from __future__ import annotations

from typing import Any


def imbalance(counts: list[list[list[int]]]) -> list[float]:
    """Per step, the busiest expert's tokens over the mean (the largest over layers).

    Args:
        counts: ``extra["counts"]`` of a run: per step, per layer, tokens per expert.
    Returns:
        One ratio per step (1: perfectly even; E: one expert takes everything).
    """
    return [max(max(c) * len(c) / sum(c) for c in step) for step in counts]


def plot_load_imbalance(runs: dict[str, list[list[list[int]]]]) -> Any:
    """Busiest-expert load over the mean vs training step, one line per run.

    Args:
        runs: label -> ``extra["counts"]`` of a run.
    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for (label, counts), color in zip(runs.items(), ("#C44E52", "#4C72B0")):
        ratios = imbalance(counts)
        ax.plot(range(1, len(ratios) + 1), ratios, color=color, label=label)
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("training step")
    ax.set_ylabel("busiest expert's tokens / mean")
    ax.set_title("The load-balancing loss takes load off the busiest expert")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
