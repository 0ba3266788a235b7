"""Figures for Chapter 6: schedule diagrams, the bubble, activations in flight, stage
costs. matplotlib is imported inside each function, so importing this module is light.

Taught in: Chapter 6.
"""

from __future__ import annotations

from typing import Any, Sequence

from dtlib.pipeline_parallel.schedules import (Event, bubble_fraction, in_flight_peak,
                                               schedule_order)

__all__ = ["plot_timeline", "plot_schedules", "plot_bubble_vs_microbatches",
           "plot_in_flight", "plot_stage_costs"]

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def plot_timeline(events: Sequence[Event], n_stages: int, ax: Any = None,
                  title: str = "", unit: str = "time slots") -> Any:
    """The classic pipeline diagram: one row per stage (stage 0 on top), a box per
    forward (blue), backward (orange) or, in a split schedule, weight gradient
    (green, W) labelled with its micro-batch; white is idle.

    Args:
        events: from :func:`dtlib.pipeline_parallel.schedules.simulate` or measured
            by :func:`dtlib.pipeline_parallel.schedules.pipeline_step` (all stages
            together).
        n_stages: rows to draw.
        ax: a matplotlib Axes (default: a new figure).
        title: the figure's finding.
        unit: the x-axis unit ("ms" for measured timelines).
    Returns:
        The Axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.7 + 0.5 * n_stages))
    span = max(e.end for e in events)
    for e in events:
        ax.barh(e.stage, e.end - e.start, left=e.start, height=0.8,
                color=_COLORS[e.kind], edgecolor="black", linewidth=0.5)
        if e.end - e.start > span / 40:  # room for a 9 pt digit at 7 in
            ax.text((e.start + e.end) / 2, e.stage, str(e.mb), ha="center",
                    va="center", fontsize=9, color="white")
    ax.set_yticks(range(n_stages), [f"stage {s}" for s in range(n_stages)])
    ax.set_ylim(n_stages - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(unit)
    ax.set_title(title)
    from matplotlib.patches import Patch
    split = any(e.kind == "W" for e in events)
    ax.legend(handles=[Patch(color=_COLORS["F"], label="forward"),
                       Patch(color=_COLORS["B"],
                             label="B (input grad)" if split else "backward")]
              + ([Patch(color=_COLORS["W"], label="W (weight grad)")] if split else []),
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    return ax


def plot_schedules(named_events: dict[str, Sequence[Event]], n_stages: int,
                   unit: str = "time slots", suptitle: str = "") -> Any:
    """Several timelines stacked on a shared x-axis, one per schedule.

    Returns:
        The Figure.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(named_events), 1, sharex=True,
                             figsize=(7, 0.8 + 0.55 * n_stages * len(named_events)))
    axes = list(axes) if len(named_events) > 1 else [axes]
    for ax, (name, events) in zip(axes, named_events.items()):
        plot_timeline(events, n_stages, ax=ax, title=name, unit=unit)
    for ax in axes:
        ax.set_xlim(0, max(max(e.end for e in ev) for ev in named_events.values()))
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def plot_bubble_vs_microbatches(n_stages_list: Sequence[int], max_mb: int = 32,
                                measured: dict[int, dict[int, float]] | None = None,
                                ax: Any = None) -> Any:
    """Bubble fraction ``(p - 1)/(m + p - 1)`` against ``m`` for each ``p``, with
    optional measured points ``measured[p][m] = idle fraction``.

    Returns:
        The Axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    ms = list(range(1, max_mb + 1))
    for p in n_stages_list:
        line, = ax.plot(ms, [bubble_fraction(p, m) for m in ms],
                        label=f"p = {p} (formula)")
        if measured and p in measured:
            pts = sorted(measured[p].items())
            ax.plot([m for m, _ in pts], [f for _, f in pts], "o",
                    color=line.get_color(),
                    label=f"p = {p} (measured)")
    ax.set_xlabel("micro-batches per step m")
    ax.set_ylabel("idle fraction of the step")
    ax.set_ylim(0, 1)
    ax.set_title("More micro-batches shrink the bubble")
    ax.legend(fontsize=9)
    return ax


def plot_in_flight(n_stages: int, n_microbatches: int, ax: Any = None) -> Any:
    """Peak micro-batches held per stage, GPipe against 1F1B (bars).

    Returns:
        The Axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    stages = range(n_stages)
    for k, name in enumerate(("gpipe", "1f1b")):
        peaks = [in_flight_peak(schedule_order(name, s, n_stages, n_microbatches))
                 for s in stages]
        ax.bar([s + 0.4 * k - 0.2 for s in stages], peaks, width=0.4,
               label={"gpipe": "GPipe", "1f1b": "1F1B"}[name])
    ax.set_xticks(list(stages), [f"stage {s}" for s in stages])
    ax.set_ylabel("micro-batches of activations held")
    ax.set_title("1F1B holds at most p - s micro-batches, GPipe all "
                 f"m = {n_microbatches}")
    ax.legend()
    return ax


def plot_stage_costs(splits: dict[str, Sequence[float]], unit: str = "GFLOP",
                     ax: Any = None) -> Any:
    """Per-stage cost for each named split, with a dashed line at each split's slowest
    stage (the one that sets the step time).

    Returns:
        The Axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / len(splits)
    for k, (name, costs) in enumerate(splits.items()):
        xs = [s - 0.4 + width * (k + 0.5) for s in range(len(costs))]
        bars = ax.bar(xs, costs, width=width, label=name)
        ax.axhline(max(costs), color=bars[0].get_facecolor(), linestyle="--", lw=1)
    n = len(next(iter(splits.values())))
    ax.set_xticks(range(n), [f"stage {s}" for s in range(n)])
    ax.set_ylabel(f"forward cost ({unit})")
    ax.set_title("The slowest stage sets the pace: balance by cost, not layer count")
    ax.legend(fontsize=9)
    return ax
