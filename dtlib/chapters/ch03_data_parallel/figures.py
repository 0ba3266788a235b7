"""Figures of Chapter 3: the overlap timeline and the variants side by side.

matplotlib is imported inside each function, so importing this module stays light.

Taught in: Chapter 3, "Three DDPs and torch's".
"""

from __future__ import annotations

from typing import Any, Sequence


def plot_timeline(events: Sequence[tuple[str, int, float]], title: str | None = None
                  ) -> Any:
    """Backward (gradients becoming ready) and bucket all-reduces on one time axis.

    Args:
        events: ``(name, index, seconds)`` from
            :func:`dtlib.chapters.ch03_data_parallel.runs.record_timeline`
            (names: forward_start/end, grad, launch, done, backward_end, synced).
    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    def first(name: str) -> float:
        return next(t for n, _, t in events if n == name)

    ms = 1e3
    fwd0, fwd1 = first("forward_start"), first("forward_end")
    bwd1, synced = first("backward_end"), first("synced")
    grads = [t for n, _, t in events if n == "grad"]
    launches = {i: t for n, i, t in events if n == "launch"}
    dones = {i: t for n, i, t in events if n == "done"}
    fig, ax = plt.subplots(figsize=(7, 4.0))
    ax.barh(2, (fwd1 - fwd0) * ms, left=fwd0 * ms, color="tab:gray", label="forward")
    ax.barh(2, (bwd1 - fwd1) * ms, left=fwd1 * ms, color="tab:blue", label="backward")
    ax.plot([g * ms for g in grads], [2] * len(grads), "k|", ms=14,
            label="a gradient is ready")
    for i, start in sorted(launches.items()):
        end = dones.get(i, synced)
        # Buckets in flight at the same time: three lanes, so no bar hides another.
        ax.barh(1.25 - 0.25 * (i % 3), (end - start) * ms, left=start * ms, height=0.22,
                color=f"C{2 + i % 6}", edgecolor="k",
                label=("a bucket's all-reduce (launch to completion)" if i == 0
                       else None))
    ax.axvline(synced * ms, color="k", ls="--", lw=1, label="backward() returns")
    ax.set_yticks([1, 2], ["all-reduces", "compute"])
    ax.set_xlabel("time since forward started (ms)")
    early = sum(1 for i in launches if dones.get(i, synced) <= bwd1)
    started = sum(1 for t in launches.values() if t <= bwd1)
    ax.set_title(title or f"{started} of {len(launches)} bucket all-reduces start "
                 f"during backward; {early} finish before it ends", fontsize=10)
    # Legend under the axes: the figure keeps the page width and 9 pt text.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=9)
    fig.subplots_adjust(left=0.14, right=0.97, top=0.9, bottom=0.38)
    return fig


def plot_step_times(records: Sequence[dict[str, Any]], title: str | None = None) -> Any:
    """Median step time per DDP variant, labelled with its all-reduce calls per step.

    Args:
        records: dicts with ``variant``, ``step_time_s``, ``allreduce_calls``.
    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in records]
    times = [r["step_time_s"] * 1e3 for r in records]
    fig, ax = plt.subplots(figsize=(6, 3))
    bars = ax.bar(names, times, color=["C0", "C1", "C2", "C3"][:len(names)])
    for bar, r in zip(bars, records):
        ax.annotate(f"{r['allreduce_calls']} all-reduces", (bar.get_x() + 0.05,
                    bar.get_height()), textcoords="offset points", xytext=(0, 3),
                    fontsize=9)
    ax.set_ylabel("median step time (ms)")
    ax.set_xlabel("DDP variant")
    ax.set_title(title or "Fewer, larger messages: bucketing cuts the call count")
    fig.tight_layout()
    return fig
