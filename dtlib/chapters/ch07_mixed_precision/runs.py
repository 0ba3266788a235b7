"""What Chapter 7's page runs: loss-scaler trajectories and short training runs.

Both go through the one loop (:func:`~dtlib.models.run.run_steps`): the loss scaler
is its ``scaler``, bf16 autocast its ``autocast_dtype``, fp32 master weights by hand
:func:`dtlib.precision.parallelism`.

Taught in: Chapter 7, "Mixed precision".
"""

from __future__ import annotations

from typing import Any

import torch

from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.run import (OnStepEnd, Parallelism, RunConfig, StepEnd, TrainState,
                              default_step, run_steps)
from dtlib.precision import parallelism
from dtlib.precision.loss_scaling import DynamicLossScaler
from dtlib.precision.mixed_precision import LOW_DTYPES, MODES

__all__ = ["scaler_trajectory", "train_losses"]


def scaler_trajectory(kind: str, steps: int = 8, *, init_scale: float = 2.0 ** 16,
                      growth_interval: int = 2, inject_inf_at: tuple[int, ...] = (),
                      cfg: GPTConfig | None = None, batch: int = 4, lr: float = 1e-3,
                      clip: float = 1.0, device: torch.device | str = "cpu",
                      seed: int = 0) -> dict[str, Any]:
    """Train the GPT ``steps`` steps with a loss scaler; record what it did.

    Forward runs under bf16 autocast on ``device``; step ``i`` in ``inject_inf_at``
    gets one gradient entry set to inf after backward (an overflow, as fp16 would
    produce); gradients are unscaled, clipped to ``clip``, and AdamW steps.

    Args:
        kind: ``"ours"`` (:class:`DynamicLossScaler`) or ``"torch"`` (GradScaler).
    Returns:
        ``{"scale": [S used at each step], "skipped": [bool], "loss": [float],
        "params": {name: tensor}}``.

    Taught in: Chapter 7, "Loss scaling".
    """
    if kind not in ("ours", "torch"):
        raise ValueError(f"kind={kind!r} must be 'ours' or 'torch'")
    if steps < 1:
        raise ValueError(f"steps={steps!r} must be >= 1")
    device = torch.device(device)
    cfg = cfg or GPTConfig(n_layers=1, hidden=32, seq_len=16, vocab_size=64)
    model = build_gpt(cfg, seed).to(device)
    kwargs = dict(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=growth_interval)
    scaler = (DynamicLossScaler(**kwargs) if kind == "ours"
              else torch.amp.GradScaler(device.type, **kwargs))
    out: dict[str, Any] = {"scale": [], "skipped": []}
    before: list[torch.Tensor] = []

    def step_fn(par: Parallelism, wrapped: Any, batch: Any, loss_fn: Any,
                scaler: Any = None) -> torch.Tensor:
        out["scale"].append(float(scaler.get_scale()))  # S used at this step
        loss = default_step(par, wrapped, batch, loss_fn, scaler=scaler)
        if len(out["scale"]) - 1 in inject_inf_at:  # an fp16 overflow
            next(wrapped.parameters()).grad.view(-1)[0] = float("inf")
        before[:] = [p.detach().clone() for p in wrapped.parameters()]
        return loss

    def skipped(end: StepEnd) -> None:
        out["skipped"].append(all(torch.equal(b, p) for b, p in
                                  zip(before, model.parameters())))

    config = RunConfig(steps, optimizer_kwargs={"lr": lr}, step_fn=step_fn,
                       autocast_dtype=torch.bfloat16, max_grad_norm=clip,
                       record_grads=False)
    res = run_steps(Parallelism(), model,
                    lambda i: token_batch(cfg, batch, seed=seed + 1 + i,
                                          device=device), config,
                    TrainState(scaler=scaler), [OnStepEnd(skipped)])
    out["loss"], out["params"] = res.losses, res.params
    return out


def train_losses(mode: str, steps: int = 12, *, dtype: torch.dtype = torch.bfloat16,
                 cfg: GPTConfig | None = None, batch: int = 4, lr: float = 1e-2,
                 device: torch.device | str = "cpu", seed: int = 0) -> list[float]:
    """Train the GPT ``steps`` AdamW steps on fixed synthetic batches; the losses.

    Args:
        mode: ``"fp32"``; ``"autocast"`` (fp32 weights, forward under
            ``torch.autocast(device.type, dtype)``); ``"manual"``
            (:func:`dtlib.precision.parallelism`: fp32 master weights, a 16-bit
            copy, with a loss scaler when dtype is fp16).
        dtype: the low-precision dtype of the two mixed modes.
    Returns:
        The loss at each step (fp32 values).

    Taught in: Chapter 7, "Mixed-precision training".
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    if dtype not in LOW_DTYPES:
        raise ValueError(f"dtype={dtype} must be one of {LOW_DTYPES}")
    device = torch.device(device)
    cfg = cfg or GPTConfig(n_layers=2, hidden=32, seq_len=16, vocab_size=64)
    manual = mode == "manual"
    # Four batches cycled: the loss falls visibly in a few steps.
    batches = [token_batch(cfg, batch, seed=seed + 1 + i, device=device)
               for i in range(4)]
    res = run_steps(parallelism(dtype) if manual else Parallelism(),
                    build_gpt(cfg, seed).to(device),
                    lambda i: batches[i % len(batches)],
                    RunConfig(steps, optimizer_kwargs={"lr": lr},
                              autocast_dtype=dtype if mode == "autocast" else None,
                              record_grads=False, record_params=False),
                    TrainState(scaler=DynamicLossScaler()
                               if manual and dtype == torch.float16 else None))
    return res.losses
