"""FP8's cost on paper: the roofline of one Linear layer's training step in bf16
and in FP8 (its three GEMMs and the casts), Amdahl's law for a whole step, and the
published figures they are checked against. Pure Python.

Taught in: Chapter 7, "FP8".
"""

from __future__ import annotations

from typing import Any

__all__ = ["H100", "LLAMA3_8B_LINEARS", "TORCHAO_LLAMA3_8B", "linear_roofline",
           "step_speedup", "implied_gemm_share", "model_roofline"]

#: H100 SXM datasheet figures {cite:p}`nvidiah100`: dense tensor-core peaks in FLOP/s
#: and HBM3 bandwidth in bytes/s.
H100 = {"bf16_flops": 989.4e12, "fp8_flops": 1978.9e12, "hbm_bytes": 3.35e12}

#: One Llama 3 8B block's Linear layers {cite:p}`dubey2024llama` as (d_in, d_out):
#: hidden 4096, 32 query and 8 key/value heads of 128 (qkv: 4096 + 2 x 1024), FFN
#: 14336 (SwiGLU: gate and up, then down).
LLAMA3_8B_LINEARS = {"wqkv": (4096, 6144), "wo": (4096, 4096),
                     "w1": (4096, 14336), "w3": (4096, 14336), "w2": (14336, 4096)}

#: torchao's published torchtitan run {cite:p}`torchaotraining`: Llama 3 8B on 8 H100,
#: batch 1 x 8192 tokens per GPU, torch.compile, FSDP2: median tokens/s per GPU.
TORCHAO_LLAMA3_8B = {"tokens_per_gpu": 8192, "bf16": 6150.0,
                     "tensorwise, fp8 all-gather": 7689.5,
                     "rowwise, bf16 all-gather": 6768.0}


def linear_roofline(tokens: int, d_in: int, d_out: int,
                    hw: dict[str, float] | None = None) -> dict[str, float]:
    """Time of one Linear's training step (three GEMMs) in bf16 and in FP8, on the
    roofline: a GEMM takes ``max(FLOPs / peak, bytes / bandwidth)``; an FP8 cast is
    memory-bound, reading the bf16 tensor twice (amax, then scale and cast) and
    writing one byte per element.

    FP8 casts: the input and the weight (E4M3) and the output gradient (E5M2), once
    each (per-tensor scaling reuses them for the transposed GEMMs of backward).

    Args:
        tokens, d_in, d_out: the GEMM ``(tokens, d_in) @ (d_in, d_out)``.
        hw: peaks as :data:`H100` (the default).
    Returns:
        ``{"bf16_s", "fp8_gemm_s", "cast_s", "fp8_s", "speedup", "cast_share"}``:
        seconds per step of the layer, and the cast's share of the FP8 time.

    Taught in: Chapter 7, "FP8".
    """
    for name, v in (("tokens", tokens), ("d_in", d_in), ("d_out", d_out)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    hw = hw or H100
    m, k, n = tokens, d_in, d_out
    flops = 3 * 2 * m * k * n  # forward, grad of input, grad of weight
    # Operands and result of each GEMM once through memory: (mk + kn + mn) elements.
    elements = 3 * (m * k + k * n + m * n)
    bf16 = max(flops / hw["bf16_flops"], 2 * elements / hw["hbm_bytes"])
    # FP8 GEMMs read 1-byte operands and write a 2-byte (bf16) result.
    fp8_bytes = 3 * ((m * k + k * n) * 1 + m * n * 2)
    fp8_gemm = max(flops / hw["fp8_flops"], fp8_bytes / hw["hbm_bytes"])
    cast = (2 + 2 + 1) * (m * k + k * n + m * n) / hw["hbm_bytes"]
    fp8 = fp8_gemm + cast
    return {"bf16_s": bf16, "fp8_gemm_s": fp8_gemm, "cast_s": cast, "fp8_s": fp8,
            "speedup": bf16 / fp8, "cast_share": cast / fp8}


def step_speedup(gemm_share: float, linear_speedup: float) -> float:
    """Amdahl's law for a step: a share ``gemm_share`` of the bf16 step's time runs
    ``linear_speedup`` times faster, the rest as before.

    Taught in: Chapter 7, "FP8".
    """
    if not 0.0 <= gemm_share <= 1.0:
        raise ValueError(f"gemm_share={gemm_share!r} must be in [0, 1]")
    if not linear_speedup > 0:
        raise ValueError(f"linear_speedup={linear_speedup!r} must be > 0")
    return 1.0 / ((1.0 - gemm_share) + gemm_share / linear_speedup)


def implied_gemm_share(step: float, linear: float) -> float:
    """The share of a bf16 step's time in the FP8 GEMMs that Amdahl's law needs to
    turn a per-layer speedup ``linear`` into a measured step speedup ``step``
    (:func:`step_speedup` solved for its first argument).

    Taught in: Chapter 7, "FP8".
    """
    if not linear > 1.0:
        raise ValueError(f"linear={linear!r} must be > 1 (no speedup to share)")
    if not 1.0 <= step <= linear:
        raise ValueError(f"step={step!r} must be in [1, linear={linear}]")
    return (1.0 - 1.0 / step) / (1.0 - 1.0 / linear)


def model_roofline(linears: dict[str, tuple[int, int]], tokens: int,
                   hw: dict[str, float] | None = None) -> dict[str, Any]:
    """:func:`linear_roofline` of each layer of a block, and of all of them together
    (their times summed): ``{"layers": {name: row}, "speedup", "cast_share"}``.

    Taught in: Chapter 7, "FP8".
    """
    rows = {name: linear_roofline(tokens, d_in, d_out, hw)
            for name, (d_in, d_out) in linears.items()}
    bf16 = sum(r["bf16_s"] for r in rows.values())
    fp8 = sum(r["fp8_s"] for r in rows.values())
    cast = sum(r["cast_s"] for r in rows.values())
    return {"layers": rows, "speedup": bf16 / fp8, "cast_share": cast / fp8}
