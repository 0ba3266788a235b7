"""What Chapter 7's page runs: loss-scaler trajectories and short training runs.

Taught in: Chapter 7, "Mixed precision".
"""

from __future__ import annotations

from typing import Any

import torch

from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.precision.loss_scaling import DynamicLossScaler
from dtlib.precision.mixed_precision import LOW_DTYPES, MODES, ManualMixedPrecision

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
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    kwargs = dict(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=growth_interval)
    scaler = (DynamicLossScaler(**kwargs) if kind == "ours"
              else torch.amp.GradScaler(device.type, **kwargs))
    out: dict[str, Any] = {"scale": [], "skipped": [], "loss": []}
    for i in range(steps):
        idx, tgt = token_batch(cfg, batch, seed=seed + 1 + i, device=device)
        with torch.amp.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
        out["scale"].append(float(scaler.get_scale()))
        scaler.scale(loss).backward()
        if i in inject_inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        out["skipped"].append(not moved)
        out["loss"].append(loss.item())
    out["params"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return out


def train_losses(mode: str, steps: int = 12, *, dtype: torch.dtype = torch.bfloat16,
                 cfg: GPTConfig | None = None, batch: int = 4, lr: float = 1e-2,
                 device: torch.device | str = "cpu", seed: int = 0) -> list[float]:
    """Train the GPT ``steps`` steps on fixed synthetic batches; return the losses.

    Args:
        mode: ``"fp32"``; ``"autocast"`` (fp32 weights, forward under
            ``torch.amp.autocast(device.type, dtype)``); ``"manual"``
            (:class:`ManualMixedPrecision`, with a loss scaler when dtype is fp16).
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
    model = build_gpt(cfg, seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = DynamicLossScaler() if dtype == torch.float16 else None
    manual = (ManualMixedPrecision(model, opt, dtype, scaler) if mode == "manual"
              else None)
    # Four batches cycled: the loss falls visibly in a few steps.
    batches = [token_batch(cfg, batch, seed=seed + 1 + i, device=device)
               for i in range(4)]
    losses = []
    for i in range(steps):
        idx, tgt = batches[i % len(batches)]
        if manual is not None:
            losses.append(manual.step(idx, tgt)[0])
            continue
        with torch.amp.autocast(device.type, dtype=dtype, enabled=mode == "autocast"):
            _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
