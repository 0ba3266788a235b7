"""The single-process computation every parallel chapter is proven against.

Each strategy chapter trains the same GPT twice: once split across ranks, once here on
one process with the whole batch, and compares losses, the first step's gradients and
the parameters after the last step. The reference is the one loop
(:func:`dtlib.models.run.run_steps`) with the identity ``Parallelism()``: the parallel
runs and the truth differ only in the technique plugged in.

Taught in: Chapter 3 ("Equal to one process"); used by every parallel chapter.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.run import (Parallelism, RunConfig, RunResult, TrainState,
                              gpt_loss, run_steps, tensors_by_name)

__all__ = ["grads_of", "params_of", "gpt_loss", "reference_run", "reference_gpt_run",
           "gpt_batches"]


def grads_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every gradient, by parameter name (a tied weight once)."""
    return tensors_by_name(module, grads=True)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter, by name."""
    return tensors_by_name(module)


def gpt_batches(cfg: GPTConfig, batch: int, device: Any = "cpu"):
    """``batch_fn`` of the proofs: step ``k`` trains on ``token_batch(cfg, batch,
    seed=k)``, the same global batch on every rank and in the reference."""
    return lambda step: token_batch(cfg, batch, seed=step, device=device)


def reference_run(model: nn.Module, batches: Iterable[tuple[Any, ...]], *,
                  optimizer: torch.optim.Optimizer | None = None, lr: float = 1e-3,
                  loss_fn: Callable[..., torch.Tensor] = gpt_loss,
                  optimizer_class: type = torch.optim.AdamW,
                  **optimizer_kwargs: Any) -> RunResult:
    """Train ``model`` on one process, one optimizer step per batch of ``batches``
    (:func:`reference_gpt_run` is this on the book's GPT and its token batches).

    Args:
        model: the full model.
        batches: one argument tuple of ``loss_fn`` after the model per step (the
            whole global batch of that step).
        optimizer: an optimizer over ``model``'s parameters, or None to build
            ``optimizer_class(lr=lr, **optimizer_kwargs)``.
        loss_fn: ``loss_fn(model, *batch)`` returns the scalar loss.
    Returns:
        A :class:`~dtlib.models.run.RunResult`.

    Taught in: Chapter 3, "Equal to one process".
    """
    batches = list(batches)
    config = RunConfig(len(batches), optimizer_class=optimizer_class,
                       optimizer_kwargs={"lr": lr, **optimizer_kwargs},
                       loss_fn=loss_fn)
    return run_steps(Parallelism(), model, batches.__getitem__, config,
                     TrainState(optimizer=optimizer))


def reference_gpt_run(cfg: GPTConfig, batch: int, steps: int, lr: float = 1e-3,
                      seed: int = 0, optimizer_class: type = torch.optim.AdamW,
                      **optimizer_kwargs: Any) -> RunResult:
    """The single-process run every data- and tensor-parallel proof compares against.

    ``build_gpt(cfg, seed)`` trains ``steps`` steps of ``optimizer_class`` at ``lr``
    (AdamW by default; the proofs of a trajectory use SGD with momentum, whose step
    is smooth in the gradient); step ``k`` uses ``token_batch(cfg, batch, seed=k)``,
    the whole global batch.

    Returns:
        A :class:`~dtlib.models.run.RunResult` (``["losses"]``, ``["grads"]``,
        ``["params"]``).

    Taught in: Chapter 3, "Equal to one process"; reused by every parallel chapter.
    """
    batches = gpt_batches(cfg, batch)
    return reference_run(build_gpt(cfg, seed), (batches(k) for k in range(steps)),
                         lr=lr, optimizer_class=optimizer_class, **optimizer_kwargs)
