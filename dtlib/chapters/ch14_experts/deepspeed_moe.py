"""DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``) beside the book's, on real ranks.

The same weights (router and experts copied from :func:`~.runs.build_moe`), the same
tokens per rank, the same routing rules where DeepSpeed has them: top-1 or top-2,
no random token selection (``use_rts=False``), no noise on the second choice
(``top2_2nd_expert_sampling=False``), ``min_capacity=0``, and either no dropping
(``drop_tokens=False``) or a capacity factor. Where DeepSpeed drops, it drops other
tokens than ours: its top-2 gate keeps first choices before second choices and
earlier tokens first, as ours does, but renormalises the two gates *after* dropping
(ours before); its top-1 gate keeps the tokens ``torch.topk`` picks from the 0/1
routing mask (from a randomised one with ``use_rts``), among equal entries an order
torch does not promise (not the earliest, measured). Its load-balancing loss counts
first choices only (ours all assignments). So outputs and gradients are compared
with nothing dropped, and the load-balancing losses under top-1, where both count
the same assignments.

Taught in: Chapter 14, "The library it meets".
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from dtlib.chapters.ch14_experts.runs import (HIDDEN, TOKENS, build_moe,
                                              layer_inputs)
from dtlib.expert_parallel import MoEConfig, route
from dtlib.runtime import dist as ddist

__all__ = ["deepspeed_moe_check"]


def _deepspeed_layer(cfg: MoEConfig, ep: int) -> Any:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    # No compiled op: DeepSpeed would JIT-build its CPU shared-memory collectives
    # (minutes) inside init_distributed; without them, torch.distributed.
    deepspeed.ops.__compatible_ops__ = {}
    deepspeed.init_distributed(dist_init_required=False)
    ours = build_moe(cfg)
    drop = cfg.capacity_factor is not None
    layer = DeepSpeedMoE(HIDDEN, ours.experts[0], num_experts=cfg.n_experts,
                         ep_size=ep, k=cfg.top_k,
                         capacity_factor=cfg.capacity_factor or 1.0,
                         eval_capacity_factor=cfg.capacity_factor or 1.0,
                         min_capacity=0, drop_tokens=drop, use_rts=False,
                         top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()  # deepspeed.initialize would: the ep groups
    inner = layer.deepspeed_moe
    first = ddist.world().rank % ep * (cfg.n_experts // ep)
    with torch.no_grad():
        inner.gate.wg.weight.copy_(ours.router.weight)
        for j, expert in enumerate(inner.experts.deepspeed_experts):
            expert.load_state_dict(ours.experts[first + j].state_dict())
    return layer.to(ddist.world().device), first


def _one_check(cfg: MoEConfig) -> dict[str, Any]:
    world = ddist.world()
    layer, first = _deepspeed_layer(cfg, world.world_size)
    x, dout = (t.chunk(world.world_size)[world.rank].to(world.device)
               for t in layer_inputs(world.world_size * TOKENS))
    x.requires_grad_()
    out, aux, _ = layer(x[None])  # DeepSpeed takes (batch, seq, h)
    (out[0] * dout).sum().backward()
    ours = route(build_moe(cfg).router.to(world.device)(x.detach()),
                 replace(cfg, aux_loss_coef=1.0, z_loss_coef=0.0))
    grads = {f"experts.{first + j}.{name}": p.grad.detach().cpu().clone()
             for j, e in enumerate(layer.deepspeed_moe.experts.deepspeed_experts)
             for name, p in e.named_parameters()}
    return {"out": out[0].detach().cpu(), "dx": x.grad.cpu(), "aux": float(aux),
            "our_aux": float(ours.aux_loss), "grads": grads}


def deepspeed_moe_check(cfgs: list[MoEConfig]) -> dict[str, Any]:
    """One rank (the world one ep group): DeepSpeed's MoE on this rank's tokens of
    the layer checks, forward and backward of ``sum(out * dout)``, per config.

    Returns:
        ``{"ran", "error", "checks"}``; ``checks[i]`` for ``cfgs[i]``: this rank's
        output rows, input gradient, DeepSpeed's load-balancing loss (``aux``,
        unweighted) and ours on the same tokens (``our_aux``), and its local
        experts' gradients by one-process name. ``error`` ("Type: message") when
        DeepSpeed could not run.
    """
    try:
        return {"ran": True, "error": None, "checks": [_one_check(c) for c in cfgs]}
    except ImportError as exc:  # the finding is the exception itself
        return {"ran": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
