"""Published training runs, typed from the papers' tables, to check the planner.

Each row is what the paper printed; nothing here is computed. Units as printed:
parameters in billions, TFLOP/s per GPU (16-bit, recomputation counted).

Taught in: Chapter 11, a planner checked against published runs.
"""

from __future__ import annotations

from typing import NamedTuple

# Narayanan et al. 2021 (Megatron-LM), §5.1: every GPT in Tables 1-2 has
# vocabulary 51,200 and sequence length 2,048, runs in 16-bit with full activation
# recomputation on DGX A100 (80 GB) nodes of 8 GPUs.
GPT_VOCAB = 51200
GPT_SEQ_LEN = 2048


class WeakScalingRow(NamedTuple):
    """One row of Narayanan et al. 2021, Table 1."""

    params_b: float
    n_heads: int
    hidden: int
    n_layers: int
    tp: int
    pp: int
    n_gpus: int
    batch: int
    tflops_per_gpu: float
    percent_of_peak: int
    aggregate_pflops: float

    @property
    def dp(self) -> int:
        """Data-parallel size: n_gpus / (tp * pp)."""
        return self.n_gpus // (self.tp * self.pp)


# Narayanan et al. 2021, Table 1: "Weak-scaling throughput for GPT models ranging
# from 1 billion to 1 trillion parameters."
TABLE1 = (
    WeakScalingRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    WeakScalingRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    WeakScalingRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    WeakScalingRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    WeakScalingRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    WeakScalingRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    WeakScalingRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    WeakScalingRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    WeakScalingRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    WeakScalingRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
)


class ZeroComparisonRow(NamedTuple):
    """One row of Narayanan et al. 2021, Table 2."""

    scheme: str  # "PTD-P" or "ZeRO-3" (ZeRO-3 without model parallelism)
    params_b: float
    model_parallel: int  # tp * pp (PTD-P: tp = 8); 1 for ZeRO-3
    batch: int
    n_gpus: int
    micro_batch: int
    tflops_per_gpu: float
    days_300b_tokens: int


# Narayanan et al. 2021, Table 2: "Comparison of PTD Parallelism to ZeRO-3
# (without model parallelism)". 174.6B: 96 layers, h 12288, 96 heads;
# 529.6B: 105 layers, h 20480, 128 heads (the Table 1 shapes). PTD-P splits
# 96 = 8 x 12 and 280 = 8 x 35 (tp 8 inside a node).
TABLE2 = (
    ZeroComparisonRow("ZeRO-3", 174.6, 1, 1536, 384, 4, 144, 90),
    ZeroComparisonRow("ZeRO-3", 174.6, 1, 1536, 768, 2, 88, 74),
    ZeroComparisonRow("ZeRO-3", 174.6, 1, 1536, 1536, 1, 44, 74),
    ZeroComparisonRow("ZeRO-3", 529.6, 1, 2560, 640, 4, 138, 169),
    ZeroComparisonRow("ZeRO-3", 529.6, 1, 2240, 1120, 2, 98, 137),
    ZeroComparisonRow("ZeRO-3", 529.6, 1, 2240, 2240, 1, 48, 140),
    ZeroComparisonRow("PTD-P", 174.6, 96, 1536, 384, 1, 153, 84),
    ZeroComparisonRow("PTD-P", 174.6, 96, 1536, 768, 1, 149, 43),
    ZeroComparisonRow("PTD-P", 174.6, 96, 1536, 1536, 1, 141, 23),
    ZeroComparisonRow("PTD-P", 529.6, 280, 2240, 560, 1, 171, 156),
    ZeroComparisonRow("PTD-P", 529.6, 280, 2240, 1120, 1, 167, 80),
    ZeroComparisonRow("PTD-P", 529.6, 280, 2240, 2240, 1, 159, 42),
)

# The model shape of each Table 2 size (from Table 1).
TABLE2_SHAPES = {174.6: dict(n_layers=96, hidden=12288, n_heads=96),
                 529.6: dict(n_layers=105, hidden=20480, n_heads=128)}

# Dubey et al. 2024 (The Llama 3 Herd of Models), Table 3: Llama 3 405B has 126
# layers, model dimension 16,384, FFN dimension 53,248, 128 attention heads, 8
# key/value heads, vocabulary 128,000 tokens (the released tokenizer has 128,256
# entries with special tokens; we count 128,256), SwiGLU, RoPE.
LLAMA3_405B = dict(n_layers=126, hidden=16384, n_heads=128, n_kv_heads=8,
                   ffn_hidden=53248, vocab_size=128256, gated_mlp=True)


class Llama3Row(NamedTuple):
    """One row of Dubey et al. 2024, Table 4."""

    n_gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq_len: int
    batch_per_dp: int
    tokens_per_batch: int
    tflops_per_gpu: float
    bf16_mfu_percent: int

    @property
    def global_batch(self) -> int:
        """Sequences per iteration: batch_per_dp * dp."""
        return self.batch_per_dp * self.dp


# Dubey et al. 2024, Table 4: "Scaling configurations and MFU for each stage of
# Llama 3 405B pre-training" (H100 80 GB, 8 per node). Tokens per batch: 16M.
TABLE4_LLAMA3 = (
    Llama3Row(8192, 8, 1, 16, 64, 8192, 32, 16 * 2**20, 430, 43),
    Llama3Row(16384, 8, 1, 16, 128, 8192, 16, 16 * 2**20, 400, 41),
    Llama3Row(16384, 8, 16, 16, 8, 131072, 16, 16 * 2**20, 380, 38),
)
