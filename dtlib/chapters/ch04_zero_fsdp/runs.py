"""What chapter 4 runs: a toy mixture of experts under ZeRO (parameters some ranks skip).

In a mixture-of-experts layer each sample goes to a few experts, so on a given step an
expert may get tokens on one rank and none on another, or none anywhere. Its parameters
then get a gradient on some ranks only (or on none). :func:`moe_rank` trains
:class:`TinyMoE` with :class:`dtlib.zero.ZeRO` under such a routing and compares it with
``torch.optim.AdamW`` on one process (:func:`moe_reference`).

Taught in: Chapter 4, "Parameters some ranks do not use".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.zero.optimizer import ZeRO, no_decay_groups

__all__ = ["TinyMoE", "ROUTINGS", "route", "moe_batch", "moe_reference", "moe_rank",
           "moe_demo_rank"]

WIDTH, N_OUT, PER_RANK = 6, 3, 4


class TinyMoE(nn.Module):
    """A shared input layer, two same-sized experts (one unit each), a norm and a head.

    forward(x, experts): x is (batch, WIDTH); each listed expert adds a residual.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, N_OUT)

    def forward(self, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for e in experts:
            h = h + torch.tanh(self.experts[e](h))
        return self.head(self.norm(h))


ROUTINGS = ("ranks", "steps")


def route(rank: int, step: int, routing: str = "ranks") -> list[int]:
    """Experts ``rank`` uses at ``step``: expert 0 always; expert 1 only at even steps
    (so at odd steps no rank uses it), and with ``routing="ranks"`` only on rank 0."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r} not allowed; allowed: {ROUTINGS}")
    on_rank = rank == 0 or routing == "steps"
    return [0, 1] if on_rank and step % 2 == 0 else [0]


def moe_batch(world_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: ``PER_RANK`` samples per rank, inputs (N, WIDTH), labels (N,)."""
    g = torch.Generator().manual_seed(seed)
    n = PER_RANK * world_size
    return torch.randn(n, WIDTH, generator=g), torch.randint(0, N_OUT, (n,), generator=g)


def _prepare(net: TinyMoE, freeze: bool) -> None:
    if freeze:  # fine-tuning style: the input layer is frozen
        for p in net.inp.parameters():
            p.requires_grad_(False)


def moe_reference(world_size: int, steps: int = 4, lr: float = 1e-2,
                  freeze: bool = False, no_decay: bool = False,
                  clip: float = 0.5, routing: str = "ranks"
                  ) -> dict[str, torch.Tensor]:
    """``torch.optim.AdamW`` on one process: the loss is the mean of the ranks' losses.

    Returns:
        Every parameter after ``steps`` steps, by name.
    """
    net = TinyMoE()
    _prepare(net, freeze)
    groups = (no_decay_groups(net, 0.1) if no_decay
              else [p for p in net.parameters() if p.requires_grad])
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)
    x, y = moe_batch(world_size)
    for step in range(steps):
        loss = sum(F.cross_entropy(net(xr, route(r, step, routing)), yr)
                   for r, (xr, yr) in enumerate(zip(x.chunk(world_size),
                                                    y.chunk(world_size))))
        (loss / world_size).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()  # grads become None: a parameter nobody used is skipped
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def moe_rank(stage: int, steps: int = 4, lr: float = 1e-2, freeze: bool = False,
             no_decay: bool = False, clip: float = 0.5, routing: str = "ranks"
             ) -> dict[str, Any]:
    """On every rank: train :class:`TinyMoE` with ZeRO ``stage`` under :func:`route`.

    Args:
        stage: ZeRO stage 1-3.
        freeze: freeze the input layer (``requires_grad=False``).
        no_decay: parameter groups without weight decay on biases and norms.
        routing: ``"ranks"`` (expert 1 on rank 0 only) or ``"steps"`` (on every rank
            at even steps only).

    Returns:
        ``max_abs_err`` against :func:`moe_reference`, ``moved`` (how far the
        reference moved the parameters), and the unit orders of the first backward:
        ``hook_order`` (as gradients completed on this rank) and ``reduce_order``
        (as reduce-scattered).
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    net = TinyMoE()
    _prepare(net, freeze)
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": 0.1}
    if no_decay:
        kwargs["param_groups"] = no_decay_groups(net, 0.1)
    z = ZeRO(net, stage, **kwargs)
    x, y = moe_batch(world_size)
    xr, yr = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    orders: dict[str, list[int]] = {}
    for step in range(steps):
        F.cross_entropy(z(xr, route(rank, step, routing)), yr).backward()
        if step == 0:  # rank 0 used expert 1, the others did not
            orders = {k: list(getattr(z, k, [])) for k in ("hook_order", "reduce_order")}
        z.clip_grad_norm_(clip)
        z.step()
        z.zero_grad()
    got = z.full_parameters()
    ref = moe_reference(world_size, steps, lr, freeze, no_decay, clip, routing)
    return {"max_abs_err": max(float((got[n] - r).abs().max()) for n, r in ref.items()),
            "moved": max(float((r - init[n]).abs().max()) for n, r in ref.items()),
            "missing": sorted(set(ref) - set(got)),
            **orders}


def moe_demo_rank() -> dict[str, Any]:
    """On every rank: the toy MoE (expert 1 on rank 0 only) under stages 1 and 2, and
    stage 3's refusal.

    Returns:
        ``{"stage1": moe_rank(1), "stage2": moe_rank(2), "stage3_error": message}``.
    """
    out: dict[str, Any] = {"stage1": moe_rank(1), "stage2": moe_rank(2)}
    try:
        moe_rank(3, steps=1)
        out["stage3_error"] = "no error"
    except RuntimeError as exc:
        out["stage3_error"] = str(exc)
    return out
