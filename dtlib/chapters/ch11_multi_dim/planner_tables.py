"""The planner tables Chapter 11 prints: published runs beside the planner's estimate.

Pure Python (no ranks, no torch): :mod:`dtlib.planner` estimates each configuration
that a paper published and searches for its own best one on the same GPUs and batch.

- :func:`ranked_rows`: the top of a :func:`~dtlib.planner.search` ranking;
- :func:`table1_rows`, :func:`table2_rows`: Narayanan et al. 2021, Tables 1 and 2;
- :func:`llama_rows`: Dubey et al. 2024, Table 4 (Llama 3 405B);
- :func:`table1_choices`, :func:`llama_choices`: the planner's best configuration per
  published row, as objects, so that a page can assert what it says about them.

Taught in: Chapter 11, "A planner checked against published runs".
"""

from __future__ import annotations

import functools
from typing import Any

from dtlib.planner import (ClusterSpec, Estimate, ModelSpec, ParallelConfig, estimate,
                           search)
from dtlib.planner.published import (GPT_SEQ_LEN, GPT_VOCAB, LLAMA3_405B, TABLE1,
                                     TABLE2, TABLE2_SHAPES, TABLE4_LLAMA3)


def _gpt(n_layers: int, hidden: int, n_heads: int) -> ModelSpec:
    return ModelSpec(n_layers, hidden, n_heads, GPT_VOCAB, GPT_SEQ_LEN)


def _beside(est: Estimate, best: ParallelConfig, best_est: Estimate) -> dict[str, Any]:
    """The planner's columns: its estimate of the published run, and its choice."""
    return {"planner TFLOP/s": round(est.tflops_per_gpu),
            "memory (GB)": round(est.memory_per_gpu_bytes / 1e9, 1),
            "fits": est.fits, "bubble": round(est.bubble_fraction, 3),
            "step (s)": round(est.step_time_s, 1), "planner's choice": best.label(),
            "its step (s)": round(best_est.step_time_s, 1)}


def ranked_rows(ranked: list[tuple[ParallelConfig, Estimate]],
                top: int = 5) -> list[dict[str, Any]]:
    """The first ``top`` configurations of a search, one row each.

    Args:
        ranked: what :func:`dtlib.planner.search` returns, fastest first.
        top: how many rows (a positive integer).
    Returns:
        Rows with the configuration, its step time, memory per GPU, pipeline bubble
        and the overhead that dominates its step.

    Taught in: Chapter 11, "A planner checked against published runs".
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top={top!r} must be a positive integer")
    return [{"configuration": c.label(), "step (s)": round(e.step_time_s, 1),
             "memory (GB)": round(e.memory_per_gpu_bytes / 1e9, 1),
             "bubble": round(e.bubble_fraction, 3), "dominant": e.breakdown.dominant}
            for c, e in ranked[:top]]


@functools.lru_cache(maxsize=1)
def _table1() -> tuple[tuple[dict[str, Any], ...], tuple[ParallelConfig, ...]]:
    rows, choices = [], []
    for r in TABLE1:
        model = _gpt(r.n_layers, r.hidden, r.n_heads)
        cluster = ClusterSpec.preset("A100-80GB", r.n_gpus)
        est = estimate(model, cluster, ParallelConfig(
            r.dp, r.tp, r.pp, recompute="full", sequence_parallel=False), r.batch)
        # the options of 2021: no distributed optimizer (ZeRO) in Megatron-LM yet
        best, best_est = search(model, cluster, r.batch, zero_stages=(0,))[0]
        rows.append({"params (B)": r.params_b, "GPUs": r.n_gpus, "batch": r.batch,
                     "published t,p,d": f"{r.tp},{r.pp},{r.dp}",
                     "published TFLOP/s": r.tflops_per_gpu,
                     **_beside(est, best, best_est)})
        choices.append(best)
    return tuple(rows), tuple(choices)


def table1_rows() -> list[dict[str, Any]]:
    """Narayanan et al. 2021, Table 1 beside the planner: the published (t, p, d)
    estimated as Megatron ran it (full recomputation, micro-batch 1), and the
    planner's own best configuration for the same GPUs and batch.

    Returns:
        One row per published run: its size, GPUs, batch, (t, p, d), published and
        estimated TFLOP/s, memory, bubble, and the planner's choice.

    Taught in: Chapter 11, "The planner against Megatron-LM".
    """
    return [dict(r) for r in _table1()[0]]


def table1_choices() -> list[ParallelConfig]:
    """The planner's best configuration for each row of Narayanan et al. 2021,
    Table 1 (the "planner's choice" column of :func:`table1_rows`, computed once).

    Returns:
        One :class:`~dtlib.planner.ParallelConfig` per row of ``TABLE1``, in order.

    Taught in: Chapter 11, "The planner against Megatron-LM".
    """
    return list(_table1()[1])


def table2_rows() -> list[dict[str, Any]]:
    """Narayanan et al. 2021, Table 2 (PTD-P vs ZeRO-3) beside the planner.

    Returns:
        One row per published run: scheme, size, GPUs, batch, micro-batch,
        published and estimated TFLOP/s, and the overhead that dominates.

    Taught in: Chapter 11, "The planner against Megatron-LM".
    """
    rows = []
    for r in TABLE2:
        model = _gpt(**TABLE2_SHAPES[r.params_b])
        tp, pp, zero = (8, r.model_parallel // 8, 0) if r.scheme == "PTD-P" \
            else (1, 1, 3)
        config = ParallelConfig(r.n_gpus // (tp * pp), tp, pp, zero_stage=zero,
                                micro_batch=r.micro_batch, recompute="full",
                                sequence_parallel=False)
        est = estimate(model, ClusterSpec.preset("A100-80GB", r.n_gpus), config,
                       r.batch)
        rows.append({"scheme": r.scheme, "params (B)": r.params_b, "GPUs": r.n_gpus,
                     "batch": r.batch, "micro-batch": r.micro_batch,
                     "published TFLOP/s": r.tflops_per_gpu,
                     "planner TFLOP/s": round(est.tflops_per_gpu),
                     "dominant overhead": est.breakdown.dominant})
    return rows


@functools.lru_cache(maxsize=1)
def _llama() -> tuple[tuple[dict[str, Any], ...], tuple[ParallelConfig, ...]]:
    rows, choices = [], []
    for r in TABLE4_LLAMA3:
        model = ModelSpec(seq_len=r.seq_len, **LLAMA3_405B)
        cluster = ClusterSpec.preset("H100-80GB", r.n_gpus)
        config = ParallelConfig(dp=r.dp, tp=r.tp, pp=r.pp, cp=r.cp, zero_stage=2,
                                recompute="selective")
        est = estimate(model, cluster, config, r.global_batch)
        best, best_est = search(model, cluster, r.global_batch)[0]
        rows.append({"GPUs": r.n_gpus, "seq": r.seq_len,
                     "published tp,cp,pp,dp": f"{r.tp},{r.cp},{r.pp},{r.dp}",
                     "published TFLOP/s": r.tflops_per_gpu,
                     **_beside(est, best, best_est)})
        choices.append(best)
    return tuple(rows), tuple(choices)


def llama_rows() -> list[dict[str, Any]]:
    """Dubey et al. 2024, Table 4 (Llama 3 405B) beside the planner: the published
    configuration (FSDP without resharding after forward, i.e. ZeRO-2's memory;
    FlashAttention modelled as "selective"), and the planner's best for the same
    GPUs, sequence and batch.

    Returns:
        One row per published run: GPUs, sequence, (tp, cp, pp, dp), published and
        estimated TFLOP/s, memory, bubble, and the planner's choice.

    Taught in: Chapter 11, "The planner against Llama 3".
    """
    return [dict(r) for r in _llama()[0]]


def llama_choices() -> list[ParallelConfig]:
    """The planner's best configuration for each row of Dubey et al. 2024, Table 4
    (the "planner's choice" column of :func:`llama_rows`, computed once).

    Returns:
        One :class:`~dtlib.planner.ParallelConfig` per row of ``TABLE4_LLAMA3``.

    Taught in: Chapter 11, "The planner against Llama 3".
    """
    return list(_llama()[1])
