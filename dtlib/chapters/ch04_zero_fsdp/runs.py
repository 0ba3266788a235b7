"""What chapter 4 runs: a toy mixture of experts under ZeRO (parameters some ranks
skip).

In a mixture-of-experts layer each sample goes to a few experts, so on a given step an
expert may get tokens on one rank and none on another, or none anywhere. Its parameters
then get a gradient on some ranks only (or on none). :func:`moe_rank` trains
:class:`TinyMoE` with :func:`dtlib.zero.parallelism` under such a routing and compares
it with a torch optimizer on one process (:func:`moe_reference`); both are
:func:`dtlib.models.run.run_steps`.

Also here: :data:`OPTIMIZERS`, the optimizers chapter 4's runs choose from.

Taught in: Chapter 4, "Parameters some ranks do not use".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.collectives.accounting import count_comms
from dtlib.models import optimizers
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.run import (OnStepEnd, Parallelism, RunConfig, StepEnd, TrainState,
                              run_steps)
from dtlib.runtime.dist import world
from dtlib.zero import no_decay_groups, parallelism, zero_comm_elements

__all__ = ["TinyMoE", "ROUTINGS", "WEIGHT_DECAY", "optimizer_of",
           "route", "moe_batch", "moe_reference", "moe_rank", "moe_demo_rank",
           "fsdp2_reshard_traffic"]

WIDTH, N_OUT, PER_RANK = 6, 3, 4

#: Chapter 4's runs decay weights, so a parameter the optimizer skips shows.
WEIGHT_DECAY = 0.1


def optimizer_of(optimizer: str, lr: float) -> tuple[type, dict[str, Any]]:
    """:func:`dtlib.models.optimizers.optimizer_of` with the chapter's
    :data:`WEIGHT_DECAY`.

    Taught in: Chapter 4, "Does it train the same model?".
    """
    return optimizers.optimizer_of(optimizer, lr, WEIGHT_DECAY)


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
    """The global batch: ``PER_RANK`` samples per rank, inputs (N, WIDTH), labels
    (N,)."""
    g = torch.Generator().manual_seed(seed)
    n = PER_RANK * world_size
    return (torch.randn(n, WIDTH, generator=g),
            torch.randint(0, N_OUT, (n,), generator=g))


def _prepare(freeze: bool) -> TinyMoE:
    net = TinyMoE()
    if freeze:  # fine-tuning style: the input layer is frozen
        for p in net.inp.parameters():
            p.requires_grad_(False)
    return net


def _groups(model: nn.Module, no_decay: bool) -> list[dict[str, Any]]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return no_decay_groups(model, 0.1) if no_decay else [{"params": trainable}]


def moe_reference(world_size: int, steps: int = 4, lr: float = 1e-2,
                  freeze: bool = False, no_decay: bool = False,
                  clip: float = 0.5, routing: str = "ranks", optimizer: str = "adamw"
                  ) -> dict[str, torch.Tensor]:
    """One process, a torch optimizer: the loss is the mean of the ranks' losses.

    Returns:
        Every parameter after ``steps`` steps, by name.

    Taught in: Chapter 4, "Parameters some ranks do not use".
    """
    net = _prepare(freeze)
    cls, kwargs = optimizer_of(optimizer, lr)

    def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int
                ) -> torch.Tensor:
        return sum(F.cross_entropy(model(xr, route(r, step, routing)), yr)
                   for r, (xr, yr) in enumerate(zip(x.chunk(world_size),
                                                    y.chunk(world_size)))
                   ) / world_size

    x, y = moe_batch(world_size)
    # zero_grad sets the gradients to None: a parameter nobody used is skipped
    config = RunConfig(steps, loss_fn=loss_fn, max_grad_norm=clip,
                       record_grads=False)
    return run_steps(Parallelism(), net, lambda step: (x, y, step), config,
                     TrainState(optimizer=cls(_groups(net, no_decay), **kwargs))
                     ).params


def moe_rank(stage: int, steps: int = 4, lr: float = 1e-2, freeze: bool = False,
             no_decay: bool = False, clip: float = 0.5, routing: str = "ranks",
             optimizer: str = "adamw", compare: bool = True) -> dict[str, Any]:
    """On every rank: train :class:`TinyMoE` with ZeRO ``stage`` under :func:`route`.

    Args:
        stage: ZeRO stage 1-3.
        freeze: freeze the input layer (``requires_grad=False``).
        no_decay: parameter groups without weight decay on biases and norms.
        routing: ``"ranks"`` (expert 1 on rank 0 only) or ``"steps"`` (on every rank
            at even steps only).
        optimizer: a key of :data:`OPTIMIZERS`.
        compare: train :func:`moe_reference` here and compare.

    Returns:
        ``params`` (full, by name), ``init``, the unit orders of the first backward:
        ``hook_order`` (as gradients completed on this rank) and ``reduce_order``
        (as reduce-scattered), and with ``compare`` ``max_abs_err`` against
        :func:`moe_reference`, ``moved`` (how far the reference moved the
        parameters) and ``missing`` (names the run did not return).

    Taught in: Chapter 4, "Parameters some ranks do not use".
    """
    here = world()  # a lone process is a world of one
    world_size, rank = here.world_size, here.rank
    net = _prepare(freeze)
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    par = parallelism(stage)
    wrapped = par.apply(net)
    cls, kwargs = optimizer_of(optimizer, lr)
    opt = par.make_optimizer(wrapped, cls, params=_groups(wrapped, no_decay), **kwargs)
    orders: dict[str, list[int]] = {}

    def first_backward(end: StepEnd) -> None:
        if end.step == 1:  # rank 0 used expert 1, the others did not
            units = (wrapped if stage == 3 else opt).units  # dtlib.zero.ShardedUnits
            orders.update(hook_order=list(units.hook_order),
                          reduce_order=list(units.reduce_order))

    def loss_fn(model: nn.Module, xr: torch.Tensor, yr: torch.Tensor, step: int
                ) -> torch.Tensor:
        return F.cross_entropy(model(xr, route(rank, step, routing)), yr)

    x, y = moe_batch(world_size)
    config = RunConfig(steps, loss_fn=loss_fn, max_grad_norm=clip,
                       record_grads=False)
    got = run_steps(par, None, lambda step: (x, y, step), config,
                    TrainState(wrapped=wrapped, optimizer=opt),
                    [OnStepEnd(first_backward)]).params
    out: dict[str, Any] = {"params": got, "init": init, **orders}
    if compare:
        ref = moe_reference(world_size, steps, lr, freeze, no_decay, clip, routing,
                            optimizer)
        out.update(
            max_abs_err=max(float((got[n] - r).abs().max()) for n, r in ref.items()),
            moved=max(float((r - init[n]).abs().max()) for n, r in ref.items()),
            missing=sorted(set(ref) - set(got)))
    return out


def moe_demo_rank() -> dict[str, Any]:
    """On every rank: the toy MoE (expert 1 on rank 0 only) under stages 1 and 2, and
    stage 3's refusal.

    Returns:
        ``{"stage1": moe_rank(1), "stage2": moe_rank(2), "stage3_error": message}``.

    Taught in: Chapter 4, "Parameters some ranks do not use".
    """
    out: dict[str, Any] = {"stage1": moe_rank(1), "stage2": moe_rank(2)}
    try:
        moe_rank(3, steps=1, compare=False)
        out["stage3_error"] = "no error"
    except RuntimeError as exc:
        out["stage3_error"] = str(exc)
    return out


def fsdp2_reshard_traffic(gpt: dict[str, int], micro_batch: int = 2
                          ) -> dict[str, dict[str, float]]:
    """On each rank: one forward and backward of the GPT under FSDP2, blocks then root,
    with ``fully_shard``'s default ``reshard_after_forward`` and with ``True``.

    With the default (``None``) torch reshards every block after forward but not the
    root (``_fully_shard.py``: "``True`` for non-root modules and ``False`` for root
    modules"), so backward re-gathers the blocks only.

    Args:
        gpt: ``GPTConfig`` fields.
        micro_batch: sequences per rank.
    Returns:
        ``{"default": {...}, "True": {...}}``, each with ``all_gather`` and
        ``reduce_scatter`` in elements per rank over Psi (the ZeRO paper's count).

    Taught in: Chapter 4, "FSDP2".
    """
    from torch.distributed.fsdp import fully_shard

    cfg, w = GPTConfig(**gpt), world()
    out: dict[str, dict[str, float]] = {}
    for name, kwargs in (("default", {}), ("True", {"reshard_after_forward": True})):
        model = build_gpt(cfg).to(w.device)
        psi = sum(p.numel() for p in model.parameters())
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        idx, targets = token_batch(cfg, micro_batch, seed=w.rank, device=w.device)
        with count_comms() as log:
            model(idx, targets)[1].backward()
        out[name] = {op: zero_comm_elements(log, (op,)) / psi
                     for op in ("all_gather", "reduce_scatter")}
    return out
