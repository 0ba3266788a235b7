"""What Chapter 7's FP8 section runs: four short trainings. The roofline of an FP8
linear layer is :mod:`dtlib.planner.fp8`, the bytes FSDP2's fp8 all-gather saves
:func:`dtlib.precision.float8_linear.fsdp_allgather_bytes`; both are re-exported
here for the page.

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
from dtlib.planner.fp8 import (H100, LLAMA3_8B_LINEARS, TORCHAO_LLAMA3_8B,
                               implied_gemm_share, linear_roofline, model_roofline,
                               step_speedup)
from dtlib.precision.float8_linear import (Float8Linear, fsdp_allgather_bytes,
                                           swap_linears)

__all__ = ["RECIPES", "H100", "LLAMA3_8B_LINEARS", "TORCHAO_LLAMA3_8B",
           "fp8_training", "linear_roofline", "step_speedup", "implied_gemm_share",
           "model_roofline", "fsdp_allgather_bytes"]

#: The four runs: label -> Float8Linear scaling (None: bf16 autocast, no FP8).
RECIPES: dict[str, str | None] = {"bf16": None, "fp8 per-tensor": "tensor",
                                  "fp8 per-row": "row", "fp8 delayed": "delayed"}

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
