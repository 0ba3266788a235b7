"""Enumerate parallel configurations, keep those that fit, rank them by step time.

Taught in: Chapter 11, a planner checked against published runs.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from dtlib.planner.estimate import Estimate, estimate
from dtlib.planner.specs import RECOMPUTE, ClusterSpec, ModelSpec, ParallelConfig


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, cluster: ClusterSpec, global_batch: int, *,
               micro_batches: Iterable[int] = (1, 2, 4, 8),
               zero_stages: Iterable[int] = (0, 1, 2, 3),
               recomputes: Iterable[str] = RECOMPUTE,
               cps: Iterable[int] | None = None,
               schedules: Iterable[str] = ("1f1b",)) -> Iterator[ParallelConfig]:
    """Every configuration the planner considers, valid for this model and batch.

    tp divides n_heads and the node size, so each tp group sits inside a node
    (Narayanan et al. 2021, Takeaway #1); pp <= n_layers; dp * micro_batch divides
    the global batch; cp divides the sequence (by default cp is 1 up to 16K
    tokens, else a power of two <= 32).

    Args:
        model, cluster, global_batch: the problem.
        micro_batches, zero_stages, recomputes, cps: the values to try.
        schedules: the pipeline schedules to try where pp > 1 (default 1F1B;
            ``PP_SCHEDULES`` has the zero-bubble ones; ZB-V needs 2 pp <= l).
    Yields:
        :class:`ParallelConfig` with dp * cp * pp * tp == cluster.n_gpus.

    Taught in: Chapter 11, a planner checked against published runs.
    """
    n, s = cluster.n_gpus, model.seq_len
    if cps is None:
        cps = (1,) if s <= 16384 else tuple(
            c for c in (1, 2, 4, 8, 16, 32) if s % c == 0)
    for tp in _divisors(n):
        if cluster.gpus_per_node % tp or model.n_heads % tp:
            continue
        for cp in cps:
            if (n // tp) % cp or s % cp:
                continue
            for pp in _divisors(n // (tp * cp)):
                if pp > model.n_layers:
                    continue
                dp = n // (tp * cp * pp)
                for b in micro_batches:
                    if global_batch % (dp * b):
                        continue
                    for sched in (schedules if pp > 1 else ("1f1b",)):
                        if sched == "zb-v" and 2 * pp > model.n_layers:
                            continue
                        for z in zero_stages:
                            for r in recomputes:
                                yield ParallelConfig(dp=dp, tp=tp, pp=pp,
                                                     zero_stage=z, micro_batch=b,
                                                     recompute=r, cp=cp,
                                                     schedule=sched)


def search(model: ModelSpec, cluster: ClusterSpec, global_batch: int,
           **options: Iterable) -> list[tuple[ParallelConfig, Estimate]]:
    """The configurations that fit in memory, fastest first.

    Args:
        model: the :class:`ModelSpec`.
        cluster: the :class:`ClusterSpec`.
        global_batch: sequences per iteration.
        options: ``micro_batches``, ``zero_stages``, ``recomputes``, ``cps``,
            ``schedules`` as in :func:`candidates`.
    Returns:
        ``[(config, estimate), ...]`` sorted by ``estimate.step_time_s`` (ties:
        less memory first); empty when nothing fits.

    Taught in: Chapter 11, a planner checked against published runs.
    """
    found = []
    for config in candidates(model, cluster, global_batch, **options):
        est = estimate(model, cluster, config, global_batch)
        if est.fits:
            found.append((config, est))
    found.sort(key=lambda ce: (ce[1].step_time_s, ce[1].memory_per_gpu_bytes))
    return found
