"""Figures of Chapter 8: activation memory against the micro-batch.

matplotlib is imported inside the function, so importing this module stays light.

Taught in: Chapter 8, "Why accumulate".
"""

from __future__ import annotations

from typing import Any, Sequence


def plot_activation_memory(micro_batches: Sequence[int],
                           activation_bytes: Sequence[int], model_state_bytes: int,
                           accum_for: int | None = None) -> Any:
    """Measured activation bytes per micro-batch size, with the model states.

    Args:
        micro_batches: micro-batch sizes measured (sequences).
        activation_bytes: bytes autograd saved for each.
        model_state_bytes: params + grads + optimizer state (independent of the batch).
        accum_for: a global batch to annotate: reached with every micro-batch size by
            accumulating ``accum_for / micro_batch`` micro-batches.
    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    if len(micro_batches) != len(activation_bytes) or not micro_batches:
        raise ValueError(f"micro_batches ({len(micro_batches)}) and activation_bytes "
                         f"({len(activation_bytes)}) must be non-empty, of equal "
                         "length")
    mib = 2**20
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(micro_batches, [a / mib for a in activation_bytes], "o-",
            label="activations saved for backward (measured)")
    ax.axhline(model_state_bytes / mib, color="tab:gray", ls="--",
               label="model states: params + grads + AdamW")
    if accum_for is not None:
        for b, a in zip(micro_batches, activation_bytes):
            if accum_for % b == 0:
                ax.annotate(f"x{accum_for // b}", (b, a / mib),
                            textcoords="offset points", xytext=(4, -12), fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("micro-batch (sequences)")
    ax.set_ylabel("memory (MiB)")
    title = "Activations grow with the micro-batch, model states do not"
    if accum_for is not None:
        title += f"\n(xk: micro-batches accumulated for a batch of {accum_for})"
    ax.set_title(title)
    ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    return fig
