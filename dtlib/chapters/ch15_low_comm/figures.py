"""Figures of Chapter 15 (matplotlib imported inside the functions).

- :func:`plot_loss_per_token`: each method's training loss against the tokens it
  has read, smoothed.

Taught in: Chapter 15, "Loss against tokens".
"""

from __future__ import annotations

from typing import Any


def smooth(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss_per_token(runs: list[dict[str, Any]], tokens_per_step: int,
                        window: int = 10) -> Any:
    """Loss (smoothed over ``window`` steps) against tokens read, one line per run
    (``label`` and ``losses`` of :func:`dtlib.low_comm.timing.train_methods`).

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for run in runs:
        losses = smooth(run["losses"], window)
        tokens = [tokens_per_step * (k + 1) / 1e3 for k in range(len(losses))]
        ax.plot(tokens, losses, label=run["label"], lw=1.4)
    ax.set_xlabel("tokens read (thousands)")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    ax.set_title("Loss against tokens, each method on the book's own text")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
