"""Reduce in what dtype? The error of summing 16-bit gradients, across ranks and steps.

Two sums of gradients happen in data-parallel training, and each can run in 16 bits:

- across ranks: the reduce-scatter (all-reduce) adds N ranks' gradients. A ring
  passes a partial sum from rank to rank; each rank adds its own term and sends the
  result on, rounded to the wire's dtype (``reduce_dtype``): N - 1 roundings per
  element, in an order that starts at a different rank for each chunk.
  :func:`ring_sum` computes exactly that on one process (a tree, NCCL's other
  algorithm, has the same roundings in log N levels; the bound below holds for both);
- across micro-batches: gradient accumulation adds K micro-batches' gradients into
  ``.grad``. With bf16 parameters autograd adds in bf16 (``.grad += g``), K - 1
  roundings of a growing sum; Megatron-LM keeps an fp32 ``main_grad`` instead
  (``--accumulate-allreduce-grads-in-fp32``) and adds each micro-batch's bf16
  gradient into it.

A sum of n terms rounded after each addition is off by at most (n - 1) u sum|terms|
(Higham, *Accuracy and Stability*, 4.2), u the unit roundoff: 2**-8 for bf16, 2**-24
for fp32. :func:`reduction_errors` and :func:`accumulation_errors` measure the errors
on the book's GPT's real bf16 gradients against an fp64 sum of the same values, beside
that bound.

Taught in: Chapter 7, "Mixed precision across ranks".
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dtlib.models.gpt import GPTConfig, build_gpt, token_batch

__all__ = ["UNIT_ROUNDOFF", "micro_batch_grads", "ring_sum", "sequential_sum",
           "reduction_errors", "accumulation_errors"]

#: Half an ulp of 1.0: the largest relative error of one rounding.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}


def micro_batch_grads(count: int, dtype: torch.dtype = torch.bfloat16, *,
                      cfg: GPTConfig | None = None, rows: int = 2,
                      normalise: bool = True, seed: int = 0) -> list[torch.Tensor]:
    """The flat gradient of ``count`` micro-batches (or ranks' batches) of the GPT,
    each of the mean loss over its ``rows`` sequences, divided by ``count`` (as
    accumulation normalises) when ``normalise``, computed in ``dtype`` on a
    ``dtype`` copy of the same weights.

    Returns:
        ``count`` 1-D tensors of ``dtype``.

    Taught in: Chapter 7, "Mixed precision across ranks".
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count={count!r} must be an int >= 1")
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype={dtype!r} not allowed; allowed: "
                         f"{tuple(UNIT_ROUNDOFF)}")
    cfg = cfg or GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32,
                           n_heads=2)
    low = copy.deepcopy(build_gpt(cfg, seed)).to(dtype)
    idx, tgt = token_batch(cfg, rows * count, seed=seed + 1)
    out = []
    for k in range(count):  # backward only: no optimizer step, nothing accumulates
        low.zero_grad(set_to_none=True)
        logits = low(idx[k * rows:(k + 1) * rows])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            tgt[k * rows:(k + 1) * rows].reshape(-1))
        (loss / count if normalise else loss).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in low.parameters()]))
    return out


def sequential_sum(terms: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``terms`` added one after another, the running sum rounded to ``dtype`` after
    each addition (``.grad += g`` in ``dtype``)."""
    acc = terms[0].to(dtype)
    for t in terms[1:]:
        acc = (acc.double() + t.double()).to(dtype)  # one rounding per addition
    return acc


def ring_sum(terms: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The sum a ring reduce-scatter of ``terms`` (one per rank) computes in
    ``dtype``: chunk ``c`` starts at rank ``c + 1`` and travels once around the ring,
    each rank adding its term and rounding before sending it on."""
    n = len(terms)
    chunks = [t.chunk(n) for t in terms]
    out = []
    for c in range(n):
        order = [(c + 1 + i) % n for i in range(n)]
        out.append(sequential_sum([chunks[r][c] for r in order], dtype))
    return torch.cat(out)


def _rel(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def _bound(terms: list[torch.Tensor], exact: torch.Tensor, u: float) -> float:
    """(n - 1) u ||sum|terms| || / ||sum||, plus one rounding of the result."""
    mags = torch.stack([t.double().abs() for t in terms]).sum(0)
    return (len(terms) - 1) * u * float(mags.norm() / exact.norm()) + u


def reduction_errors(world_sizes: tuple[int, ...] = (2, 4, 8),
                     dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,
                                                        torch.float32),
                     seed: int = 0) -> list[dict[str, Any]]:
    """The relative error of a ring reduction of N ranks' bf16 gradients, summed in
    each of ``dtypes``, against the fp64 sum of the same values.

    Returns:
        One dict per (world_size, dtype): ``world_size``, ``dtype`` (its name),
        ``rel_err`` (||got - exact|| / ||exact||) and ``bound`` (the Higham bound
        of the same norm ratio).

    Taught in: Chapter 7, "Mixed precision across ranks".
    """
    rows = []
    # each rank's gradient of its mean loss; the 1/N of the average is applied
    # after the sum, as a reduce-scatter then divides
    every = micro_batch_grads(max(world_sizes), normalise=False, seed=seed)
    for n in world_sizes:
        terms = every[:n]
        exact = torch.stack([t.double() for t in terms]).sum(0)
        for dtype in dtypes:
            rows.append({"world_size": n, "dtype": str(dtype).removeprefix("torch."),
                         "rel_err": _rel(ring_sum(terms, dtype), exact),
                         "bound": _bound(terms, exact, UNIT_ROUNDOFF[dtype])})
    return rows


def accumulation_errors(counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                        seed: int = 0) -> list[dict[str, Any]]:
    """What accumulating K micro-batches' bf16 gradients loses: into a bf16 ``.grad``
    against into an fp32 ``main_grad`` (Megatron's fix), each against the fp64 sum.

    Returns:
        One dict per K: ``micro_batches``, ``bf16_rel_err``, ``fp32_rel_err``,
        ``bf16_bound``, ``fp32_bound``.

    Taught in: Chapter 7, "Mixed precision across ranks".
    """
    rows = []
    every = micro_batch_grads(max(counts), normalise=False, seed=seed)
    for k in counts:
        # loss / K in backward: a division by a power of two, exact in bf16
        terms = [t / k for t in every[:k]]
        exact = torch.stack([t.double() for t in terms]).sum(0)
        row: dict[str, Any] = {"micro_batches": k}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            row[f"{name}_rel_err"] = _rel(sequential_sum(terms, dtype), exact)
            row[f"{name}_bound"] = _bound(terms, exact, UNIT_ROUNDOFF[dtype])
        rows.append(row)
    return rows
