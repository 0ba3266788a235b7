"""Figures of Chapter 7 (matplotlib imported lazily, inside each function).

Taught in: Chapter 7, "Mixed precision".
"""

from __future__ import annotations

from typing import Any


def plot_flushed(fractions: dict[str, float], title: str) -> Any:
    """Bar chart: percent of gradient entries flushed to zero, per setting.

    Args:
        fractions: ``{label: fraction in [0, 1]}``.
        title: the finding the figure shows.
    Returns:
        The matplotlib Figure.

    Taught in: Chapter 7, "Loss scaling".
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = list(fractions)
    ax.bar(labels, [100 * fractions[k] for k in labels], color="tab:red")
    ax.set_ylabel("gradient entries flushed to 0 (%)")
    ax.set_xlabel("backward-pass precision")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_loss_curves(curves: dict[str, list[float]], title: str) -> Any:
    """Training loss per step, one line per precision mode.

    Args:
        curves: ``{label: [loss at step 0, 1, ...]}``.
        title: the finding the figure shows.
    Returns:
        The matplotlib Figure.

    Taught in: Chapter 7, "Mixed-precision training".
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for (label, losses), style in zip(curves.items(), ("-", "--", ":", "-.")):
        ax.plot(range(len(losses)), losses, style, label=label, marker=".")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_fp8_losses(curves: dict[str, list[float]], baseline: str, title: str) -> Any:
    """Loss curves of several recipes (log scale) and each one's gap to ``baseline``.

    Args:
        curves: ``{label: [loss at step 0, 1, ...]}``, ``baseline`` among them.
        baseline: the label the right panel subtracts.
        title: the finding the figure shows.
    Returns:
        The matplotlib Figure.

    Taught in: Chapter 7, "FP8".
    """
    import matplotlib.pyplot as plt

    fig, (ax, gap) = plt.subplots(1, 2, figsize=(7, 3.2))
    base = curves[baseline]
    for (label, losses), style in zip(curves.items(), ("-", "--", ":", "-.")):
        ax.plot(range(len(losses)), losses, style, label=label)
        if label != baseline:
            gap.plot(range(len(losses)), [a - b for a, b in zip(losses, base)],
                     style, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.legend()
    gap.axhline(0.0, color="grey", linewidth=0.8)
    gap.set_xlabel("training step")
    gap.set_ylabel(f"loss - {baseline} loss (nats)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
