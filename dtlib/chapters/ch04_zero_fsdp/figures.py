"""Figures for Chapter 4 (matplotlib imported inside each function).

Taught in: Chapter 4, "ZeRO and FSDP".
"""

from __future__ import annotations

from typing import Any, Sequence

from dtlib.memory.formulas import model_state_bytes


def plot_stage_memory_vs_world(n_params: int, world_sizes: Sequence[int],
                               precision: str = "mixed", ax: Any = None) -> Any:
    """Predicted per-device model-state GB against the number of ranks, stages 0-3."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.6))
    for stage in range(4):
        gb = [model_state_bytes(n_params, zero_stage=stage, dp=n,
                                precision=precision).total / 1e9 for n in world_sizes]
        ax.plot(world_sizes, gb, marker="o", label=f"stage {stage}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("model states per device (GB)")
    ax.set_title("Only ZeRO-3 memory keeps falling as 1/N")
    ax.legend()
    return ax


def plot_measured_vs_predicted(records: list[dict[str, Any]], ax: Any = None) -> Any:
    """Bars of measured and predicted model-state KiB per rank, one pair per record.

    Args:
        records: dicts with ``variant``, ``measured_state_bytes``,
            ``predicted_state_bytes``.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(records))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], [r["measured_state_bytes"] / 1024 for r in records],
           w, label="measured")
    ax.bar([x + w / 2 for x in xs],
           [r["predicted_state_bytes"] / 1024 for r in records], w,
           label="formula (fp32 Adam)")
    ax.set_xticks(list(xs), [r["variant"] for r in records])
    ax.set_ylabel("model states per rank (KiB)")
    ax.set_title("Measured per-rank model states equal the ZeRO formula")
    ax.legend()
    return ax


def plot_comm_per_step(records: list[dict[str, Any]], ax: Any = None) -> Any:
    """Communication per step in units of Psi, with the paper's 2 and 3 marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.6))
    names = [r["variant"] for r in records]
    ax.bar(names, [r["comm_elements_per_step"] / r["n_params"] for r in records],
           color="tab:gray")
    for level, label in ((2, "2 Psi: DDP, ZeRO-1/2"), (3, "3 Psi: ZeRO-3")):
        ax.axhline(level, ls="--", lw=1, color="tab:red")
        ax.text(len(names) - 0.5, level, label, ha="right", va="bottom", fontsize=9)
    ax.set_ylabel("elements sent per step / Psi")
    ax.set_title("ZeRO-3 moves 1.5x the data of ZeRO-1/2")
    return ax


