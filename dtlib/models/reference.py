"""The single-process computation every parallel chapter is proven against.

Each strategy chapter trains the same GPT twice: once split across ranks, once here on
one process with the whole batch, and compares losses, the first step's gradients and
the parameters after the last step.

Taught in: Chapter 3 ("Equal to one process"); used by Chapters 5, 6 and 8.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from dtlib.models.gpt import GPTConfig, build_gpt, token_batch


def grads_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every gradient, by parameter name (a tied weight once)."""
    return {n: p.grad.detach().cpu().clone() for n, p in module.named_parameters()
            if p.grad is not None}


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter, by name."""
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters()}


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's own mean cross-entropy (``model(idx, targets)[1]``)."""
    return model(idx, targets)[1]


def train_reference(model: nn.Module, batches: Iterable[tuple[Any, ...]], *,
                    optimizer: torch.optim.Optimizer | None = None, lr: float = 1e-3,
                    loss_fn: Callable[..., torch.Tensor] = gpt_loss) -> dict[str, Any]:
    """Train ``model`` on one process, one optimizer step per batch.

    Args:
        model: the full model.
        batches: one ``(inputs, targets)`` (or any argument tuple of ``loss_fn`` after
            the model) per step: the whole global batch of that step.
        optimizer: default AdamW at ``lr``.
        lr: learning rate of the default optimizer.
        loss_fn: ``loss_fn(model, *batch)`` returns the scalar loss.
    Returns:
        ``{"losses": [loss per step], "grads": the first step's gradients,
        "params": parameters after the last step}`` (CPU copies, by name).

    Taught in: Chapter 3, "Equal to one process".
    """
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr)
    out: dict[str, Any] = {"losses": [], "grads": {}}
    for step, batch in enumerate(batches):
        loss = loss_fn(model, *batch)
        loss.backward()
        if step == 0:
            out["grads"] = grads_of(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    out["params"] = params_of(model)
    return out


def reference_gpt_run(cfg: GPTConfig, batch: int, steps: int, lr: float = 1e-3,
                      seed: int = 0) -> dict[str, Any]:
    """The single-process run every data- and tensor-parallel proof compares against.

    ``build_gpt(cfg, seed)`` trains ``steps`` AdamW steps at ``lr``; step ``k`` uses
    ``token_batch(cfg, batch, seed=k)``, the whole global batch.

    Returns:
        As :func:`train_reference`.

    Taught in: Chapter 3, "Equal to one process"; reused by Chapters 5 and 8.
    """
    batches = (token_batch(cfg, batch, seed=step) for step in range(steps))
    return train_reference(build_gpt(cfg, seed), batches, lr=lr)
