"""Figures of Chapter 13: measured against predicted, where the time goes, a trace.

matplotlib is imported inside each function, so importing this module stays light.

Taught in: Chapter 13, "Where the time goes".
"""

from __future__ import annotations

from typing import Any, Sequence

from dtlib.planner.trace import intervals

PARTS = (("compute_s", "compute", "tab:blue"), ("optimizer_s", "optimizer", "tab:gray"),
         ("exposed_s", "exposed communication", "tab:red"),
         ("bubble_s", "pipeline bubble", "tab:orange"))


def plot_ratios(records: Sequence[dict[str, Any]], band: tuple[float, float],
                title: str | None = None) -> Any:
    """Measured / predicted step time per strategy and world size, the band shaded.

    Args:
        records: dicts with ``strategy``, ``world_size``, ``ratio`` (and, from
            ``drift.summarize``, ``ratio_lo`` and ``ratio_hi``: drawn as a bar from
            the lowest to the highest round).
        band: the ratios the model promises on an idle machine.
    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["strategy"] for r in records))
    sizes = sorted({r["world_size"] for r in records})
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.axhspan(*band, color="tab:green", alpha=0.15, label="the model's band")
    ax.axhline(1.0, color="k", lw=0.8)
    width = 0.8 / len(sizes)
    for k, n in enumerate(sizes):
        xs = [i + (k - (len(sizes) - 1) / 2) * width for i, s in enumerate(names)
              for r in records if r["strategy"] == s and r["world_size"] == n]
        mine = [r for s in names for r in records
                if r["strategy"] == s and r["world_size"] == n]
        ys = [r["ratio"] for r in mine]
        spread = None
        if all("ratio_lo" in r for r in mine):
            spread = [[y - r["ratio_lo"] for y, r in zip(ys, mine)],
                      [r["ratio_hi"] - y for y, r in zip(ys, mine)]]
        ax.bar(xs, ys, width=width, color=f"C{k}", label=f"{n} ranks", yerr=spread,
               capsize=3 if spread else 0, ecolor="0.25")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=9)
    ax.set_ylabel("measured / predicted")
    inside = sum(band[0] <= r["ratio"] <= band[1] for r in records)
    ax.set_title(title or f"{inside} of {len(records)} steps land in the model's band",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_breakdown(rows: Sequence[tuple[str, Any]], title: str) -> Any:
    """Stacked bars of predicted steps: compute, optimizer, exposed communication,
    bubble, each as a share of its step (one bar per ``(label, StepTime)``).

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = [label for label, _ in rows]
    bottom = [0.0] * len(rows)
    for attr, name, color in PARTS:
        share = [getattr(t, attr) / t.total_s for _, t in rows]
        ax.bar(labels, share, bottom=bottom, color=color, label=name)
        bottom = [b + s for b, s in zip(bottom, share)]
    ax.set_ylabel("share of the step")
    ax.set_ylim(0, 1.05)
    ax.tick_params(axis="x", labelsize=8, rotation=30)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4)
    fig.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.42)
    return fig


def plot_trace(events: Sequence[tuple], title: str) -> Any:
    """One step of a profiler trace: the rank's compute, the collectives it called
    (ticks) and gloo's work on its own threads, on one time axis (ms).

    Args:
        events: ``(name, thread, start_us, end_us)`` from ``runs.profile_step``.
        title: the finding the figure shows.
    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    t0 = min(e[2] for e in events)
    ms = 1e-3
    comm, compute = intervals(events, True), intervals(events, False)
    calls = [e for e in events if e[0].startswith("c10d::")]
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.broken_barh([((s - t0) * ms, (t - s) * ms) for s, t in compute], (1.6, 0.6),
                   color="tab:blue", label="compute (aten ops)")
    ax.broken_barh([((s - t0) * ms, (t - s) * ms) for s, t in comm], (0.4, 0.6),
                   color="tab:red", label="collective work (gloo threads)")
    ax.plot([(e[2] - t0) * ms for e in calls], [1.3] * len(calls), "k|", ms=12,
            label="a collective is called")
    ax.set_yticks([0.7, 1.9], ["communication", "compute"])
    ax.set_xlabel("time since the traced step began (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    fig.subplots_adjust(left=0.17, right=0.98, top=0.88, bottom=0.38)
    return fig
