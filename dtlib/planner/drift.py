"""The inputs that drift, measured beside each strategy's steps, and the ratio's
spread over rounds.

On a machine whose speed moves while it runs (a virtual machine, cores other work
shares), a compute rate measured at the start is not the rate during steps timed
seconds later. So the launch probes what drifts (Chapter 13's ``probe_rate``: the
GPT's own forward and backward, rank 0 alone and every rank at once, AdamW's step,
a copy and one message of each collective) after every step, and :func:`machine_at`
prices each timed step with the mean of the two probes around it. The launch repeats
this for a few rounds, and :func:`summarize` reports per strategy the median ratio
and its spread over the rounds.

Pure Python: the functions take the numbers the ranks measured.

Taught in: Chapter 13, "Predicted against measured".
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Sequence

from dtlib.planner.machine import Machine

__all__ = ["COMM_OPS", "machine_at", "drift_of", "summarize"]

#: The collectives a probe re-times (``send`` follows the all-reduce's fit).
COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _mean_s(probes: Sequence[dict[str, float]], key: str) -> float:
    values = [p[key] for p in probes]
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"probes={list(probes)!r}: each needs {key} > 0 seconds")
    return sum(values) / len(values)


def machine_at(machine: Machine, probes: Sequence[dict[str, float]],
               world_size: int) -> Machine:
    """``machine`` with the inputs the probes around a timed step measured.

    Args:
        machine: the launch's measured machine (its collective fits and curves,
            re-levelled where the probes timed the collective).
        probes: the :func:`~dtlib.planner.measure.probe_rate` results
            just before and just after a timed step (each ``flops``, ``alone_s``,
            ``all_s``, ``optimizer_s_per_param``, ``copy_s_per_byte``, and
            optionally ``comm_bytes`` with ``<op>_s`` per op of :data:`COMM_OPS`).
        world_size: the ranks that probed (the key of ``Machine.shared``).
    Returns:
        The machine with ``flops_per_s = flops / mean(alone_s)``,
        ``shared[world_size] = mean(alone_s) / mean(all_s)`` (the mean seconds of
        the probes, so the rate is the one over the same work), the probes'
        mean ``optimizer_s_per_param`` and ``copy_s_per_byte``, and each fitted
        collective's alpha and beta scaled by the probes' mean seconds of one
        ``comm_bytes`` message over what the fit says for it (``send`` with the
        all-reduce): one message cannot split alpha from beta, so the fit keeps
        its shape and takes the level measured now. A collective priced by its
        measured points (``Machine.curves``) has them scaled the same way.

    Taught in: Chapter 13, "Predicted against measured".
    """
    alone, together = _mean_s(probes, "alone_s"), _mean_s(probes, "all_s")
    flops = {p["flops"] for p in probes}
    if len(flops) != 1:
        raise ValueError(f"probes={list(probes)!r} timed different passes "
                         f"(flops {sorted(flops)}); probe one GPT")
    fits, curves = dict(machine.fits), dict(machine.curves)
    for op in COMM_OPS:
        key = (op, world_size)
        if (key in fits or key in curves) and all(op + "_s" in p for p in probes):
            # the fit's (or curve's) shape, at the level measured now: one message
            # re-times it
            nbytes = probes[0]["comm_bytes"]
            level = _mean_s(probes, op + "_s") / machine.collective_s(op, nbytes,
                                                                      world_size)
            for k in [key] + ([("send", world_size)] if op == "all_reduce" else []):
                if k in fits:
                    fits[k] = (fits[k][0] * level, fits[k][1] * level)
            if key not in fits and key in curves:
                curves[key] = tuple((b, t * level) for b, t in curves[key])
    return dataclasses.replace(
        machine, flops_per_s=flops.pop() / alone, fits=fits, curves=curves,
        shared={**machine.shared, world_size: alone / together},
        optimizer_s_per_param=_mean_s(probes, "optimizer_s_per_param"),
        copy_s_per_byte=_mean_s(probes, "copy_s_per_byte"))


def drift_of(probes: Sequence[dict[str, float]]) -> float:
    """How far the rate moved over a strategy's steps: the slowest of the probes'
    every-rank seconds over the fastest (1.0: it did not move)."""
    seconds = [p["all_s"] for p in probes]
    return max(seconds) / min(seconds)


def summarize(rows: Sequence[dict[str, Any]], band: tuple[float, float]
              ) -> list[dict[str, Any]]:
    """Per strategy and world size, the ratio over the rounds that timed it.

    Args:
        rows: ``compare`` rows (``strategy``, ``world_size``, ``measured_s``,
            ``predicted_s``, ``ratio``, and ``drift`` where probed), one per round.
        band: the ratios the model promises.
    Returns:
        One dict per (strategy, world size), in first-seen order: ``rounds``,
        ``measured_s`` and ``predicted_s`` (medians), ``ratio`` (the median of the
        rounds' ratios), ``ratio_lo`` and ``ratio_hi`` (their extremes),
        ``spread`` (``ratio_hi / ratio_lo``), ``drift`` (the largest of the rounds'
        :func:`drift_of`, 1.0 where not probed), ``in_band`` (the median's).

    Taught in: Chapter 13, "Predicted against measured".
    """
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["strategy"], r["world_size"]), []).append(r)
    out = []
    for (name, n), rs in groups.items():
        ratios = [r["ratio"] for r in rs]
        ratio = statistics.median(ratios)
        out.append({"strategy": name, "world_size": n, "rounds": len(rs),
                    "measured_s": statistics.median(r["measured_s"] for r in rs),
                    "predicted_s": statistics.median(r["predicted_s"] for r in rs),
                    "ratio": ratio, "ratio_lo": min(ratios), "ratio_hi": max(ratios),
                    "spread": max(ratios) / min(ratios),
                    "drift": max(r.get("drift", 1.0) for r in rs),
                    "in_band": band[0] <= ratio <= band[1]})
    return out
