"""Figures for Chapter 11 (matplotlib imported inside each function).

Taught in: Chapter 11, parallelism in several dimensions.
"""

from __future__ import annotations

from typing import Any

LAYOUT_LABELS = {"ours": "ours: TP in DP", "torch": "torch: FSDP2 x TP",
                 "hsdp": "torch: HSDP", "pp_dp": "ours: PP in DP",
                 "fsdp_pp": "torch: FSDP2 x PP"}


def plot_bytes_per_dimension(by_layout: dict[str, dict[str, dict[str, int]]],
                             ax: Any = None) -> Any:
    """Bytes one rank sent per mesh dimension in one step, a bar group per layout.

    Args:
        by_layout: ``{layout: comm_by_dim(result)}`` (see ``runs.comm_by_dim``).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    dims = list(dict.fromkeys(d for per in by_layout.values() for d in per))
    width = 0.8 / max(len(dims), 1)
    for i, dim in enumerate(dims):
        kib = [sum(per.get(dim, {}).values()) / 1024 for per in by_layout.values()]
        xs = [j + (i - (len(dims) - 1) / 2) * width for j in range(len(by_layout))]
        ax.bar(xs, kib, width, label=dim)
    ax.set_xticks(range(len(by_layout)),
                  [LAYOUT_LABELS.get(k, k) for k in by_layout])
    ax.set_ylabel("KiB per rank, one step")
    ax.set_title("Activations cross the tp and pp lines; gradients and weights "
                 "the dp lines")
    ax.legend(title="mesh dimension")
    return ax


def plot_planner_vs_published(rows: list[tuple[str, float, float]],
                              ax: Any = None) -> Any:
    """Planner-estimated against published TFLOP/s per GPU, one point per run.

    Args:
        rows: ``(source, published, planner)`` triples; source names the table.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4.6))
    for source in dict.fromkeys(r[0] for r in rows):
        pts = [(p, q) for s, p, q in rows if s == source]
        ax.scatter(*zip(*pts), label=source)
    hi = max(max(p, q) for _, p, q in rows) * 1.1
    ax.plot([0, hi], [0, hi], color="gray", lw=1, label="equal")
    ax.fill_between([0, hi], [0, 0.75 * hi], [0, 1.25 * hi], color="gray",
                    alpha=0.12, label="within 25 %")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("published TFLOP/s per GPU")
    ax.set_ylabel("planner's estimate (TFLOP/s per GPU)")
    ax.set_title("The planner tracks Megatron's runs, not Llama 3's")
    ax.legend(fontsize=8)
    return ax
