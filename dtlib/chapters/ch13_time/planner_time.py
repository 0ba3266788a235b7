"""Chapter 11's planner with this chapter's overlap rules, against the published runs
it is checked on: Narayanan et al. 2021's Tables 1 and 2 and Llama 3's Table 4.

Taught in: Chapter 13, "The planner with time".
"""

from __future__ import annotations

from typing import Any

from dtlib.planner import ClusterSpec, ModelSpec, ParallelConfig, estimate
from dtlib.planner import published as pub

__all__ = ["published_runs", "with_and_without_overlap"]


def published_runs() -> list[tuple[str, ModelSpec, ClusterSpec, ParallelConfig, int,
                                   float]]:
    """Every published run the planner is checked on, as Chapter 11 sets it up:
    ``(label, model, cluster, config, global_batch, published TFLOP/s per GPU)``.
    Megatron's runs recompute fully without sequence parallelism; Llama 3's FSDP
    keeps what ZeRO-2 keeps, with FlashAttention priced as "selective"."""
    runs = []
    for r in pub.TABLE1:
        model = ModelSpec(r.n_layers, r.hidden, r.n_heads, pub.GPT_VOCAB,
                          pub.GPT_SEQ_LEN)
        config = ParallelConfig(dp=r.dp, tp=r.tp, pp=r.pp, recompute="full",
                                sequence_parallel=False)
        runs.append((f"Table 1, {r.params_b}B", model,
                     ClusterSpec.preset("A100-80GB", r.n_gpus), config, r.batch,
                     r.tflops_per_gpu))
    for r in pub.TABLE2:
        model = ModelSpec(vocab_size=pub.GPT_VOCAB, seq_len=pub.GPT_SEQ_LEN,
                          **pub.TABLE2_SHAPES[r.params_b])
        tp, pp, zero = (8, r.model_parallel // 8, 0) if r.scheme == "PTD-P" \
            else (1, 1, 3)
        config = ParallelConfig(r.n_gpus // (tp * pp), tp, pp, zero_stage=zero,
                                micro_batch=r.micro_batch, recompute="full",
                                sequence_parallel=False)
        runs.append((f"Table 2, {r.scheme} {r.params_b}B on {r.n_gpus}", model,
                     ClusterSpec.preset("A100-80GB", r.n_gpus), config, r.batch,
                     r.tflops_per_gpu))
    for r in pub.TABLE4_LLAMA3:
        model = ModelSpec(seq_len=r.seq_len, **pub.LLAMA3_405B)
        config = ParallelConfig(dp=r.dp, tp=r.tp, pp=r.pp, cp=r.cp, zero_stage=2,
                                recompute="selective")
        runs.append((f"Llama 3, {r.n_gpus} GPUs, cp {r.cp}", model,
                     ClusterSpec.preset("H100-80GB", r.n_gpus), config,
                     r.global_batch, r.tflops_per_gpu))
    return runs


def with_and_without_overlap() -> list[dict[str, Any]]:
    """Per published run: the published TFLOP/s per GPU, the planner's with every
    byte charged (``overlap=False``, Chapter 11's default) and with this chapter's
    rules (``overlap=True``), each as estimated / published.

    Taught in: Chapter 13, "The planner with time".
    """
    rows = []
    for label, model, cluster, config, batch, published in published_runs():
        flat, hidden = (estimate(model, cluster, config, batch, overlap=o)
                        for o in (False, True))
        rows.append({"run": label, "published": published,
                     "flat": flat.tflops_per_gpu, "overlap": hidden.tflops_per_gpu,
                     "flat_ratio": flat.tflops_per_gpu / published,
                     "overlap_ratio": hidden.tflops_per_gpu / published,
                     "zero3": config.zero_stage == 3})
    return rows
