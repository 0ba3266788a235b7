"""What Chapter 7's FP8 section runs: four short trainings, the roofline of an FP8
linear layer, and the bytes FSDP2's fp8 all-gather saves.

The trainings go through the one loop (:func:`~dtlib.models.run.run_steps` with the
identity ``Parallelism()``): bf16 is its ``autocast_dtype``, the FP8 runs a model
whose Linear layers :func:`dtlib.precision.float8_linear.swap_linears` replaced.

Taught in: Chapter 7, "FP8".
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.run import Parallelism, RunConfig, run_steps
from dtlib.models.sizes import size
from dtlib.precision.float8_linear import Float8Linear, swap_linears

__all__ = ["RECIPES", "H100", "LLAMA3_8B_LINEARS", "TORCHAO_LLAMA3_8B",
           "fp8_training", "linear_roofline", "step_speedup", "implied_gemm_share",
           "model_roofline", "fsdp_allgather_bytes"]

#: The four runs: label -> Float8Linear scaling (None: bf16 autocast, no FP8).
RECIPES: dict[str, str | None] = {"bf16": None, "fp8 per-tensor": "tensor",
                                  "fp8 per-row": "row", "fp8 delayed": "delayed"}

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


def fp8_training(steps: int = 150, *, cfg: GPTConfig | None = None, batch: int = 4,
                 lr: float = 3e-3, history: int = 16,
                 device: torch.device | str = "cpu", seed: int = 0
                 ) -> dict[str, Any]:
    """Train the book's GPT ``steps`` AdamW steps under each of :data:`RECIPES`.

    Every run starts from ``build_gpt(cfg, seed)`` and sees the same batches (four
    synthetic ``token_batch`` batches, cycled, as the chapter's other curves). The
    FP8 runs swap every Linear but the head; weights, optimizer state, layer norms,
    attention's score products and the loss stay fp32.

    Returns:
        ``{"losses": {label: [loss per step]}, "paths": {label: Counter of the GEMM
        paths that ran}, "seconds": {label: CPU seconds of this process},
        "swapped": [layer names], "tokens": tokens per step}``.

    Taught in: Chapter 7, "FP8".
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive integer")
    device = torch.device(device)
    cfg = cfg or size("tiny")
    batches = [token_batch(cfg, batch, seed=seed + 1 + i, device=device)
               for i in range(4)]
    out: dict[str, Any] = {"losses": {}, "paths": {}, "seconds": {},
                           "tokens": batch * cfg.seq_len}
    for label, scaling in RECIPES.items():
        model = build_gpt(cfg, seed).to(device)
        if scaling is not None:
            out["swapped"] = swap_linears(model, scaling=scaling, history=history)
        t0 = time.process_time()
        config = RunConfig(steps, optimizer_kwargs={"lr": lr, "foreach": True},
                           autocast_dtype=torch.bfloat16 if scaling is None
                           else None, record_grads=False, record_params=False)
        res = run_steps(Parallelism(), model, lambda i: batches[i % len(batches)],
                        config)
        out["seconds"][label] = time.process_time() - t0
        out["losses"][label] = res.losses
        out["paths"][label] = sum((m.recipe.paths for m in model.modules()
                                   if isinstance(m, Float8Linear)), Counter())
    return out


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


def fsdp_allgather_bytes(cfg: GPTConfig, world_size: int) -> dict[str, float]:
    """Bytes one rank receives per all-gather of the whole model under FSDP2, with
    bf16 parameters, and with the Float8Linear weights gathered in fp8 (torchao's
    ``enable_fsdp_float8_all_gather``: one byte per element; biases, embeddings, norms
    and the head stay bf16). The scales travel apart: one all-reduce of every fp8
    weight's amax, one fp32 each (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``).

    Counted from the model itself: ``build_gpt(cfg)`` with the default swap filter.

    Returns:
        ``{"params", "fp8_params", "bf16_bytes", "fp8_bytes", "saved_fraction",
        "amax_bytes"}`` (bytes received per rank per gather: ``(N - 1) / N`` of the
        model; ``amax_bytes``: the amax all-reduce's payload).

    Taught in: Chapter 7, "FP8".
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or world_size < 2:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 2")
    model = build_gpt(cfg)  # a CPU copy: a meta build would import the compiler
    swapped = swap_linears(model)
    fp8_weights = [model.get_submodule(name).weight for name in swapped]
    params = sum(p.numel() for p in model.parameters())
    fp8_params = sum(w.numel() for w in fp8_weights)
    share = (world_size - 1) / world_size
    bf16_bytes = share * 2 * params
    fp8_bytes = share * (2 * (params - fp8_params) + fp8_params)
    return {"params": params, "fp8_params": fp8_params, "bf16_bytes": bf16_bytes,
            "fp8_bytes": fp8_bytes, "saved_fraction": 1 - fp8_bytes / bf16_bytes,
            "amax_bytes": 4 * len(fp8_weights)}
