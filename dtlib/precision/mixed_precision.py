"""Mixed-precision training by hand (fp32 master weights, 16-bit compute) and autocast.

The recipe of {cite:t}`micikevicius2018mixed`: keep an fp32 master copy of the weights
and the optimizer's state; each step, copy the weights to 16 bits, run forward and
backward there, cast the gradients up, and update the master copy in fp32. With fp16
the loss is scaled so that small gradients survive; with bf16 (fp32's exponent range)
it need not be.

Taught in: Chapter 7, "Mixed-precision training".
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models.gpt import GPT, GPTConfig, build_gpt, token_batch
from dtlib.models.run import Batch, Parallelism, gpt_loss
from dtlib.precision.loss_scaling import DynamicLossScaler

LOW_DTYPES = (torch.bfloat16, torch.float16)
MODES = ("fp32", "autocast", "manual")


class ManualMixedPrecision:
    """A 16-bit working copy of ``model`` for compute; ``model`` stays the fp32 master.

    Args:
        model: the fp32 master model; the optimizer must hold its parameters.
        optimizer: an optimizer over ``model``'s parameters (its state stays fp32),
            or None when another loop steps it (:func:`parallelism`).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        scaler: a :class:`DynamicLossScaler` (fp16), or None (bf16, or to show fp16
            losing gradients without one).

    Taught in: Chapter 7, "Mixed-precision training".
    """

    def __init__(self, model: GPT, optimizer: torch.optim.Optimizer | None,
                 dtype: torch.dtype = torch.bfloat16,
                 scaler: DynamicLossScaler | None = None) -> None:
        if dtype not in LOW_DTYPES:
            raise ValueError(f"dtype={dtype} must be one of {LOW_DTYPES}")
        self.master = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.low = copy.deepcopy(model).to(dtype)  # deepcopy keeps tied weights tied
        self.dtype = dtype

    def backward(self, idx: torch.Tensor, targets: torch.Tensor,
                 loss_weight: float = 1.0, loss_fn: Any = None) -> torch.Tensor:
        """Copy weights down, forward and backward in 16 bits, cast gradients up
        and add them to the master's ``.grad`` (several calls accumulate).

        Args:
            loss_weight: multiplies the loss before backward (1 in training; the
                normaliser under gradient accumulation).
            loss_fn: ``loss_fn(low_model, idx, targets)``; None: the mean
                cross-entropy of the 16-bit logits, its log-softmax in fp32.
        Returns:
            The (unscaled, unweighted) loss, fp32. Master ``.grad`` holds fp32
            gradients, still multiplied by the scaler's S if there is one.
        """
        with torch.no_grad():
            for lo, hi in zip(self.low.parameters(), self.master.parameters()):
                lo.copy_(hi)  # rounds fp32 -> 16 bit
        self.low.zero_grad(set_to_none=True)
        if loss_fn is None:
            logits = self.low(idx)  # (batch, seq, vocab), 16 bit
            # The loss's log-softmax runs in fp32, as autocast does it.
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   targets.reshape(-1))
        else:
            loss = loss_fn(self.low, idx, targets).float()
        weighted = loss * loss_weight
        (self.scaler.scale(weighted) if self.scaler else weighted).backward()
        for lo, hi in zip(self.low.parameters(), self.master.parameters()):
            if lo.grad is not None:
                up = lo.grad.float()
                hi.grad = up if hi.grad is None else hi.grad + up
        return loss.detach()

    def step(self, idx: torch.Tensor, targets: torch.Tensor,
             clip: float | None = None) -> tuple[float, bool]:
        """One training step. Returns ``(loss, stepped)``."""
        loss = self.backward(idx, targets)
        stepped = True
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), clip)
        if self.scaler is not None:
            stepped = self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), stepped


class ManualPrecision(Parallelism):
    """:class:`ManualMixedPrecision` as the one loop's Parallelism: ``apply`` keeps
    the fp32 master (what the optimizer steps) and makes its 16-bit copy; each
    ``forward_backward`` copies the weights down, runs in 16 bits and casts the
    gradients up into the master's ``.grad``."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in LOW_DTYPES:
            raise ValueError(f"dtype={dtype} must be one of {LOW_DTYPES}")
        self.dtype = dtype
        self.name = f"manual-{str(dtype).removeprefix('torch.')}"

    def apply(self, model: nn.Module) -> nn.Module:
        self.mp = ManualMixedPrecision(model, None, self.dtype)
        return model

    def forward_backward(self, wrapped: nn.Module, batch: Batch, loss_fn: Any,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        idx, targets = batch
        self.mp.scaler = scaler  # the loop unscales, steps and updates it
        # gpt_loss: the GPT's mean cross-entropy, its log-softmax in fp32; any
        # other loss (accumulation's summed one) runs on the 16-bit copy as given
        return self.mp.backward(idx, targets, loss_weight=scale,
                                loss_fn=None if loss_fn is gpt_loss else loss_fn)


def parallelism(dtype: torch.dtype = torch.bfloat16) -> ManualPrecision:
    """fp32 master weights and a 16-bit working copy, for ``run_steps``.

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16`` (pass ``run_steps`` a
            :class:`DynamicLossScaler` as ``scaler=`` with fp16).
    Returns:
        A :class:`ManualPrecision`.

    Taught in: Chapter 7, "Mixed-precision training".
    """
    return ManualPrecision(dtype)


def state_bytes_per_param(mp: ManualMixedPrecision) -> dict[str, float]:
    """Bytes per parameter held between steps, measured from the tensors themselves.

    Gradients are counted as the 16-bit ones backward produced (the fp32 copy of a
    gradient lives only inside a step). Returns keys params_16, grads_16, master_32,
    optimizer, total.

    Taught in: Chapter 7, "Mixed-precision training".
    """
    n = sum(p.numel() for p in mp.master.parameters())
    low = list(mp.low.parameters())
    opt_bytes = sum(t.numel() * t.element_size() for st in mp.optimizer.state.values()
                    for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    out = {"params_16": sum(p.numel() * p.element_size() for p in low) / n,
           "grads_16": sum(p.numel() * p.element_size() for p in low) / n,
           "master_32": sum(p.numel() * p.element_size()
                            for p in mp.master.parameters()) / n,
           "optimizer": opt_bytes / n}
    out["total"] = sum(out.values())
    return out


def flushed_fraction(dtype: torch.dtype, loss_scale: float = 1.0, *,
                     loss_weight: float = 2.0 ** -12,
                     cfg: GPTConfig | None = None, batch: int = 4,
                     device: torch.device | str = "cpu",
                     seed: int = 0) -> dict[str, Any]:
    """How many gradient entries a 16-bit backward pass flushes to zero.

    Runs one backward in fp32 (the reference) and one in ``dtype`` (the model copy of
    :class:`ManualMixedPrecision`) with the loss multiplied by ``loss_scale`` and the
    gradients divided by it again in fp32. ``loss_weight`` multiplies the loss of both
    runs, and so every gradient of backward: it shrinks the per-token activation
    gradients as a mean over 1/loss_weight times more tokens would (a weight
    gradient, an average over the tokens, would not shrink that way; measure it
    with :func:`gradient_underflow`).

    Returns:
        ``{"flushed": fraction of entries nonzero in fp32 but zero in dtype,
        "nonzero_ref": number of nonzero reference entries,
        "min_abs_ref": smallest nonzero |grad| in the reference}``.

    Taught in: Chapter 7, "Loss scaling".
    """
    if dtype not in LOW_DTYPES:
        raise ValueError(f"dtype={dtype} must be one of {LOW_DTYPES}")
    if not loss_weight > 0:
        raise ValueError(f"loss_weight={loss_weight!r} must be > 0")
    if not loss_scale > 0:
        raise ValueError(f"loss_scale={loss_scale!r} must be > 0")
    device = torch.device(device)
    cfg = cfg or GPTConfig(n_layers=2, hidden=32, seq_len=16, vocab_size=64)
    model = build_gpt(cfg, seed).to(device)
    idx, tgt = token_batch(cfg, batch, seed=seed + 1, device=device)
    _, loss = model(idx, tgt)
    (loss * loss_weight).backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters()])
    scaler = DynamicLossScaler(init_scale=loss_scale) if loss_scale != 1.0 else None
    mp = ManualMixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0),
                              dtype, scaler)
    model.zero_grad(set_to_none=True)  # mp.backward adds to the master's .grad
    mp.backward(idx, tgt, loss_weight)
    low = torch.cat([p.grad.flatten() for p in model.parameters()]) / loss_scale
    nonzero = ref != 0
    return {"flushed": ((low == 0) & nonzero).sum().item() / nonzero.sum().item(),
            "nonzero_ref": int(nonzero.sum().item()),
            "min_abs_ref": ref[nonzero].abs().min().item()}


def _record_block_grads(model: GPT) -> tuple[list[torch.Tensor], list[Any]]:
    """Hooks that keep the gradient reaching each block's output (an activation
    gradient, one value per token and feature) during backward."""
    grads: list[torch.Tensor] = []

    def on_forward(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: grads.append(g.detach().float()))

    return grads, [b.register_forward_hook(on_forward) for b in model.blocks]


def gradient_underflow(dtype: torch.dtype, batches: tuple[int, ...] = (4, 64, 1024),
                       loss_scale: float = 1.0, *, cfg: GPTConfig | None = None,
                       device: torch.device | str = "cpu",
                       seed: int = 0) -> list[dict[str, Any]]:
    """Where a 16-bit backward loses gradients: activations or weights, by batch.

    For each micro-batch size, one backward of the mean loss over its
    ``batch x seq_len`` tokens in fp32 (the reference) and one in ``dtype`` (the
    16-bit copy of :class:`ManualMixedPrecision`, the loss multiplied by
    ``loss_scale``, the gradients divided by it again in fp32). Hooks on every
    block's output record the activation gradients of both runs. The mean gives each
    token's loss the weight 1/T, so a per-token activation gradient shrinks as 1/T;
    a weight gradient sums T such contributions and stays an average.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        batches: micro-batch sizes (sequences) to run.
        loss_scale: S, the loss scale of the 16-bit run.
        cfg: the GPT's shape (default: 2 layers, hidden 32, 16 tokens a sequence).
        device: where to run.
        seed: weights and batch seed (the same weights at every batch size).
    Returns:
        One dict per batch: tokens, act_median and weight_median (median nonzero
        |gradient| in fp32), act_flushed and weight_flushed (fraction of the
        reference's nonzero entries that are exactly 0 in the 16-bit run), and
        act_grads (the reference's activation gradients, flattened, fp32).

    Taught in: Chapter 7, "Loss scaling".
    """
    if dtype not in LOW_DTYPES:
        raise ValueError(f"dtype={dtype} must be one of {LOW_DTYPES}")
    if not loss_scale > 0:
        raise ValueError(f"loss_scale={loss_scale!r} must be > 0")
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                          for b in batches):
        raise ValueError(f"batches={batches!r} must be positive integers")
    device = torch.device(device)
    cfg = cfg or GPTConfig(n_layers=2, hidden=32, seq_len=16, vocab_size=64)
    rows = []
    for batch in batches:
        model = build_gpt(cfg, seed).to(device)
        idx, tgt = token_batch(cfg, batch, seed=seed + 1, device=device)
        ref_acts, handles = _record_block_grads(model)
        model(idx, tgt)[1].backward()
        for h in handles:
            h.remove()
        ref_w = torch.cat([p.grad.flatten() for p in model.parameters()])
        scaler = DynamicLossScaler(init_scale=loss_scale) if loss_scale != 1.0 else None
        mp = ManualMixedPrecision(model, None, dtype, scaler)
        low_acts, handles = _record_block_grads(mp.low)
        model.zero_grad(set_to_none=True)  # mp.backward adds to the master's .grad
        mp.backward(idx, tgt)
        for h in handles:
            h.remove()
        low_w = torch.cat([p.grad.flatten() for p in model.parameters()]) / loss_scale
        ref_a = torch.cat([g.flatten() for g in ref_acts])
        low_a = torch.cat([g.flatten() for g in low_acts]) / loss_scale
        row: dict[str, Any] = {"tokens": batch * cfg.seq_len, "act_grads": ref_a}
        for name, ref, low in (("act", ref_a, low_a), ("weight", ref_w, low_w)):
            nonzero = ref != 0
            row[f"{name}_median"] = ref[nonzero].abs().median().item()
            row[f"{name}_flushed"] = (((low == 0) & nonzero).sum()
                                      / nonzero.sum()).item()
        rows.append(row)
    return rows
