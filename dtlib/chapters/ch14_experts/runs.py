"""Rank functions and single-process references for Chapter 14 (and its tests).

- :func:`layer_reference` / :func:`layer_check`: one MoE layer, forward and backward,
  on one process (``groups = ep``) and with its experts over ``ep`` ranks;
- :func:`train_moe` / :func:`reference_moe_run`: the MoE GPT trained with expert
  (and data) parallelism through the one loop, and on one process;
- :func:`ep_checks`: every variant of a world size in one launch, the page's and
  the tests' (layer checks, trainings, bytes counted); ``page.page_run`` adds
  DeepSpeed's layer to the page's launch.

Taught in: Chapter 14, mixture of experts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from dtlib.collectives.accounting import CountComms, count_comms
from dtlib.expert_parallel import (ExpertParallelMoE, MoE, MoEConfig, moe_gpt,
                                   moe_layers, moe_loss)
from dtlib.expert_parallel import parallelism as ep_parallelism
from dtlib.models.gpt import GPTConfig
from dtlib.models.reference import gpt_batches
from dtlib.models.run import (Callback, Parallelism, RunConfig, RunResult, StepEnd,
                              run_steps)
from dtlib.runtime import dist as ddist

#: hidden size and tokens per rank of the layer checks
HIDDEN, TOKENS = 16, 8


def build_moe(cfg: MoEConfig, hidden: int = HIDDEN, seed: int = 0,
              starved: bool = False) -> MoE:
    """The layer of the checks, drawn from ``seed``. ``starved``: the router prefers
    experts 0 and 1 so strongly (inputs shifted positive, see :func:`layer_inputs`)
    that every other expert, and every rank holding none of those two, gets no
    token."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        moe = MoE(hidden, cfg)
    if starved:
        with torch.no_grad():
            w = moe.router.weight
            w.abs_().mul_(0.1)
            w[:2] += 0.5
            w[2:] -= 0.5
    return moe


def layer_inputs(n: int, hidden: int = HIDDEN, seed: int = 0, starved: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``n`` tokens) and an output gradient ``dout``, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, hidden, generator=gen) + (2.0 if starved else 0.0)
    return x, torch.randn(n, hidden, generator=gen)


def _grads(moe: torch.nn.Module, first: int = 0) -> dict[str, torch.Tensor]:
    """Router and expert gradients by one-process name (local expert j is
    ``first + j``)."""
    out = {"router.weight": moe.router.weight.grad.detach().cpu().clone()}
    for j, expert in enumerate(moe.experts):
        for name, p in expert.named_parameters():
            out[f"experts.{first + j}.{name}"] = p.grad.detach().cpu().clone()
    return out


def layer_reference(cfg: MoEConfig, ep: int, starved: bool = False
                    ) -> dict[str, Any]:
    """One process: the layer over ``ep * TOKENS`` tokens in ``ep`` routing groups;
    loss ``sum(out * dout) + aux_loss``.

    Returns:
        ``{"out", "dx", "grads", "loss", "counts"}`` (CPU tensors).
    """
    moe = build_moe(replace(cfg, groups=ep), starved=starved)
    x, dout = layer_inputs(ep * TOKENS, starved=starved)
    x.requires_grad_()
    out = moe(x)
    loss = (out * dout).sum() + moe.aux_loss
    loss.backward()
    return {"out": out.detach(), "dx": x.grad, "grads": _grads(moe),
            "loss": loss.item(), "counts": moe.counts}


def layer_check(cfg: MoEConfig, starved: bool = False) -> dict[str, Any]:
    """One rank: its ``TOKENS`` tokens through the expert-parallel layer (all ranks
    one ep group), forward and backward, all-to-all bytes counted.

    Returns:
        This rank's ``out`` and ``dx`` rows, its share of the loss (``loss``: its
        ``sum(out * dout)`` plus ``aux_loss / ep``, summing to the one-process loss),
        ``grads`` (router: this rank's part, summing over ranks to the truth; its
        experts: whole), ``received`` (rows its experts got), ``kept`` (its
        assignments kept), the bytes of all-to-all (``a2a_bytes``, ``a2a_calls``).
    """
    world = ddist.world()
    ep, rank = world.world_size, world.rank
    layer = ExpertParallelMoE(build_moe(cfg, starved=starved).to(world.device))
    x, dout = (t.chunk(ep)[rank].to(world.device)
               for t in layer_inputs(ep * TOKENS, starved=starved))
    x.requires_grad_()
    with count_comms() as log:
        out = layer(x)
        loss = (out * dout).sum() + layer.aux_loss / ep
        loss.backward()
    return {"out": out.detach().cpu(), "dx": x.grad.cpu(), "loss": loss.item(),
            "grads": _grads(layer, layer.first), "received": layer.received,
            "kept": int(layer.counts.sum()), "a2a_bytes": log.total_bytes("all_to_all"),
            "a2a_calls": log.calls("all_to_all")}


class _RecordCounts(Callback):
    """After every step: tokens per expert of every MoE layer into
    ``result.extra["counts"]`` (and rows this rank's experts received, per layer,
    into ``extra["received"]``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def on_step_end(self, end: StepEnd) -> None:
        layers, extra = moe_layers(self.model), end.result.extra
        extra.setdefault("counts", []).append([m.counts.cpu().tolist() for m in layers])
        extra.setdefault("received", []).append(
            [getattr(m, "received", int(m.counts.sum())) for m in layers])


def train_moe(par: Parallelism, cfg: GPTConfig, moe: MoEConfig, batch: int,
              steps: int, lr: float = 0.05, momentum: float = 0.9,
              optimizer_class: type = torch.optim.SGD) -> RunResult:
    """One rank: the MoE GPT trained under ``par`` (the one loop), step 0's bytes
    counted.

    Returns:
        A :class:`~dtlib.models.run.RunResult` with ``extra["counts"]`` (tokens
        per expert of each layer per step, this rank's), ``extra["local_numel"]``
        (parameters this rank holds) and ``comms`` (step 0).

    Taught in: Chapter 14, "Expert parallelism, trained".
    """
    model = moe_gpt(cfg, moe).to(ddist.world().device)
    kwargs = {"lr": lr, **({"momentum": momentum}
                           if optimizer_class is torch.optim.SGD else {})}
    config = RunConfig(steps, optimizer_class=optimizer_class,
                       optimizer_kwargs=kwargs, loss_fn=moe_loss)
    out = run_steps(par, model, gpt_batches(cfg, batch, ddist.world().device), config,
                    callbacks=[CountComms(1), _RecordCounts(model)])
    out.extra["local_numel"] = sum(p.numel() for p in model.parameters())
    return out


def reference_moe_run(cfg: GPTConfig, moe: MoEConfig, batch: int, steps: int,
                      groups: int, **kwargs: Any) -> RunResult:
    """One process: :func:`train_moe` with ``Parallelism()`` and ``groups`` routing
    groups (the ranks of the parallel run)."""
    return train_moe(Parallelism(), cfg, replace(moe, groups=groups), batch, steps,
                     **kwargs)


#: the variants every world size proves: (top_k, capacity_factor)
VARIANTS = ((1, None), (2, None), (1, 1.0), (2, 1.0))


def ep_checks(cfg: GPTConfig, moe: MoEConfig, batch: int, steps: int,
              ep_dp: tuple[int, int] | None = None) -> dict[str, Any]:
    """One rank, one launch: every layer variant (also starved), the GPT trained
    with pure expert parallelism for every variant, and with ``ep_dp = (ep, dp)``
    expert and data parallelism when given.

    Returns:
        ``{"layer": {(k, cf, starved): layer_check}, "gpt": {(k, cf): RunResult},
        "ep_dp": RunResult or None}``.
    """
    out: dict[str, Any] = {"layer": {}, "gpt": {}, "ep_dp": None}
    world_size = dist.get_world_size()
    for k, cf in VARIANTS:
        variant = replace(moe, top_k=k, capacity_factor=cf)
        for starved in (False, True):
            out["layer"][k, cf, starved] = layer_check(variant, starved)
        out["gpt"][k, cf] = train_moe(ep_parallelism(ep=world_size), cfg, variant,
                                      batch, steps)
    if ep_dp is not None:
        ep, dp = ep_dp
        out["ep_dp"] = train_moe(ep_parallelism(ep=ep, edp=dp), cfg, moe, batch, steps)
    return out

