"""Figures of Chapter 2: every rank's tensor before and after each collective, the ring
step by step, and bus bandwidth against message size.

The rank functions that produce the states live in
:mod:`dtlib.chapters.ch02_collectives.runs`; these draw them in the notebook.
matplotlib is imported only inside the plotting functions.

Taught in: Chapter 2.
"""

from __future__ import annotations

import math
from typing import Any

from dtlib.collectives import cost_model as comm_cost
from dtlib.runtime.i18n import _

PRIMITIVES = ("broadcast", "reduce", "all_reduce", "gather", "scatter", "all_gather",
              "reduce_scatter", "all_to_all", "send/recv", "barrier")


def _draw_rows(ax: Any, rows: list[list[int] | None], title: str, timing: bool,
               width: int) -> None:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    for rank, row in enumerate(rows):
        y = len(rows) - 1 - rank
        if row is None:
            ax.text(0, y, "(no buffer)", va="center", ha="left", color="0.5",
                    fontsize=9)
            continue
        for j, v in enumerate(row):
            color = "0.85" if timing or v >= 100 * len(rows) else cmap(v // 100)
            ax.add_patch(plt.Rectangle((j - 0.5, y - 0.4), 1, 0.8, color=color,
                                       alpha=0.6 if not timing else 1.0))
            ax.text(j, y, f"{v}" + (" ms" if timing else ""), ha="center",
                    va="center", fontsize=9)
    ax.set_xlim(-0.6, width - 0.4)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in reversed(range(len(rows)))],
                  fontsize=9)
    ax.set_xticks([])
    ax.set_title(title, fontsize=10, loc="left")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


_FINDINGS = {
    "broadcast": "broadcast: rank 0's tensor is copied to every rank",
    "reduce": "reduce: only the root (rank 0) receives the sum",
    "all_reduce": "all_reduce: every rank receives the sum",
    "gather": "gather: the root receives every rank's tensor, in rank order",
    "scatter": "scatter: the root's tensor is cut in n pieces, one per rank",
    "all_gather": "all_gather: every rank receives every rank's tensor",
    "reduce_scatter": "reduce_scatter: rank k receives the sum of piece k only",
    "all_to_all": "all_to_all: element j of rank i goes to position i of rank j",
    "send/recv": "send/recv: even ranks send, odd ranks receive; nobody else changes",
    "barrier": "barrier: ranks arrive at different times and all leave together",
}


def plot_primitive(states: list[dict], name: str) -> Any:
    """Draw every rank's buffer before and after primitive ``name``.

    Args:
        states: what :func:`primitive_states` returned on each rank (spawn's list).
        name: one of :data:`PRIMITIVES`.
    Returns:
        The matplotlib figure.

    Taught in: Chapter 2, "Every primitive".
    """
    import matplotlib.pyplot as plt

    if name not in PRIMITIVES:
        raise ValueError(f"name={name!r} is not a primitive; allowed: {PRIMITIVES}")
    timing = name == "barrier"
    before = [s[name][0] for s in states]
    after = [s[name][1] for s in states]
    width = max(len(r) for r in before + after if r)
    # Before above after, never wider than the page (7 in at 100 dpi = 700 px, shown
    # at 1:1): 9 pt text stays 9 pt for the reader, even with 16 elements per rank.
    fig, axes = plt.subplots(2, 1, figsize=(min(7.0, 2.2 + 0.45 * width),
                                            0.4 * 2 * len(states) + 1.6), sharex=True)
    _draw_rows(axes[0], before, "before", timing, width)
    _draw_rows(axes[1], after, "after", timing, width)
    fig.suptitle(_FINDINGS[name], fontsize=10)
    axes[1].set_xlabel("time since a common origin" if timing else
                       "element (colour: the rank it came from; grey: a sum)",
                       fontsize=9)
    fig.tight_layout()
    return fig


def plot_ring_trace(traces: list[list[list[int]]]) -> Any:
    """One panel per step: rows are ranks, columns chunks, changed cells highlighted."""
    import matplotlib.pyplot as plt

    n = len(traces)
    steps = len(traces[0])
    # Three rows (start; the n-1 reduce-scatter steps; the n-1 all-gather steps) so
    # the figure fits the page width and its 9 pt digits stay readable.
    cols = n - 1
    fig, grid = plt.subplots(3, cols, figsize=(7.0, 3 * (0.35 * n + 0.9)),
                             sharey=True, squeeze=False)
    for ax in grid[0, 1:]:
        ax.set_visible(False)
    axes = [grid[0, 0], *grid[1], *grid[2]]
    full = int("1" * n)
    for k, ax in zip(range(steps), axes):
        for rank in range(n):
            row = traces[rank][k]
            y = n - 1 - rank
            for j, v in enumerate(row):
                changed = k > 0 and v != traces[rank][k - 1][j]
                color = ("tab:green" if v == full else
                         "tab:orange" if changed else "0.9")
                ax.add_patch(plt.Rectangle((j - 0.48, y - 0.4), 0.96, 0.8, color=color,
                                           alpha=0.7))
                ax.text(j, y, f"{v:0{n}d}"[::-1], ha="center", va="center",
                        fontsize=9)
        ax.set_xlim(-0.6, len(traces[0][0]) - 0.4)
        ax.set_ylim(-0.6, n - 0.4)
        ax.set_xticks(range(len(traces[0][0])), [f"c{j}" for j in range(len(row))],
                      fontsize=9)
        ax.set_yticks(range(n), [f"rank {r}" for r in reversed(range(n))], fontsize=9)
        phase = "start" if k == 0 else ("reduce-scatter" if k < n else "all-gather")
        ax.set_title(f"{phase}, step {k}" if k else phase, fontsize=9)
    fig.suptitle("Ring all-reduce: after n-1 steps each rank owns one full chunk\n"
                 "(green); n-1 more spread them (digit r = rank r's contribution)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_busbw(records: list[dict], op: str = "all_reduce",
               fits: list[dict] | None = None) -> Any:
    """Bus bandwidth against message size, torch vs ring, with the fitted model."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for variant, marker in (("torch", "o"), ("ring", "s")):
        rs = sorted((r for r in records
                     if r.get("op") == op and r.get("variant") == variant),
                    key=lambda r: r["bytes"])
        if not rs:
            continue
        line, = ax.plot([r["bytes"] for r in rs], [r["busbw_GBps"] for r in rs],
                        marker=marker, label=f"{variant} (measured)")
        fit = next((f for f in fits or [] if f["op"] == f"{op}_fit"
                    and f["variant"] == variant), None)
        # Only a fit that can be trusted is drawn (cost_model.fit_distrust).
        if fit is not None and fit.get("trusted"):
            n = rs[0]["world_size"]
            alpha, beta = fit["alpha_us"] * 1e-6, 1e-9 / fit["link_GBps"]
            octaves = math.log2(rs[-1]["bytes"] / rs[0]["bytes"])
            xs = [rs[0]["bytes"] * 2 ** (i / 4) for i in range(int(4 * octaves) + 1)]
            model = [x / comm_cost.collective_time("ring", op, x, n, alpha, beta) / 1e9
                     * comm_cost.bus_bandwidth_factor(op, n) for x in xs]
            ax.plot(xs, model, "--", color=line.get_color(),
                    label=f"{variant}: alpha-beta fit")
            ax.axvline(fit["crossover_bytes"], color=line.get_color(), lw=0.8, ls=":")
    # Both axes span orders of magnitude: log-log, where latency-bound busbw is a
    # line of slope 1 and bandwidth-bound busbw is flat.
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{op}: bus bandwidth grows with size while latency dominates,\n"
                 "then flattens (dashed: alpha-beta fit, dotted: crossover)",
                 fontsize=10)
    ax.legend(fontsize=9)
    fig.tight_layout()
    return fig


def _why(fit: dict, records: list[dict]) -> str:
    """Why ``fit`` is not trusted, in the language dtlib speaks now (the fit's own
    ``why`` was written in the language of the run that made it)."""
    rs = [r for r in records if f"{r['op']}_fit" == fit["op"]
          and r["variant"] == fit["variant"]]
    beta = 1 / (fit["link_GBps"] * 1e9) if fit.get("link_GBps") else 0.0
    why = comm_cost.fit_distrust(rs, fit["op"][:-len("_fit")], fit["world_size"],
                                 fit["alpha_us"] / 1e6, beta) if rs else None
    return why or fit["why"]


def fit_summary(fits: list[dict], records: list[dict]) -> str:
    """The sentence the page prints about the alpha-beta fits: the fitted numbers when
    every fit can be trusted, otherwise what went wrong (never an inf or a nan).

    Args:
        fits: the ``*_fit`` records of ``bench.collectives.run``.
        records: its measured records (``bytes``, ``busbw_GBps``).
    Returns:
        Markdown text for one paragraph, in the language dtlib speaks (the notebook
        glues it once per language: :func:`dtlib.runtime.i18n.glue_in_each_language`).

    Taught in: Chapter 2, "The cost model against measurement".
    """
    by_variant = {f["variant"]: f for f in fits}
    largest = max(r["bytes"] for r in records)
    doubts = [f"{variant}: {_why(f, records)}" for variant, f in by_variant.items()
              if not f["trusted"]]
    if doubts:
        return _("The alpha-beta fit **cannot be trusted on this run**, so the page "
                 "prints no α or 1/β ({doubts}). The measured points above are what "
                 "this machine did; rerun the cell on an idle machine, or the full "
                 "benchmark, for a fit.").format(doubts="; ".join(doubts))
    t, r = by_variant["torch"], by_variant["ring"]
    return _("The fit gives α ≈ {t_alpha:.0f} µs per message for gloo and "
             "{r_alpha:.0f} µs for our ring (each of its 2(n−1) steps is a "
             "Python-level `isend`/`irecv` pair, on four processes that share two "
             "cores with other work), and a per-link bandwidth 1/β of {t_link:.2f} and "
             "{r_link:.2f} GB/s. Latency stops dominating around {cross_kib:.0f} KiB "
             "for the ring: below that, bus bandwidth grows in proportion to the "
             "message size; above it, it approaches 1/β. The largest messages, "
             "{largest_mib:.0f} MiB, are {times:.1f} times that size.").format(
        t_alpha=t["alpha_us"], r_alpha=r["alpha_us"], t_link=t["link_GBps"],
        r_link=r["link_GBps"], cross_kib=r["crossover_bytes"] / 1024,
        largest_mib=largest / 2**20, times=largest / r["crossover_bytes"])
