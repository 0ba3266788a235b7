"""The capstone's table: a strategy name -> the technique package that runs it.

The script composes, it does not know: each row names the factory of a technique's
:class:`~dtlib.models.run.Parallelism` (Chapter 3's DDP, Chapter 4's FSDP2, Chapter
11's FSDP x TP for ``--tp N``) and the few facts the rest of the script asks about
a strategy (how much of the model states a rank keeps, how it
computes in 16 bits, what runs before the first step). Every strategy checkpoints in
one format (:mod:`dtlib.train.state`), so a run may change strategy when it resumes.
Adding a strategy is adding
a row; nothing else branches on its name.

Taught in: Chapter 10, "The script's structure".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from dtlib import data_parallel, parallel_nd, zero
from dtlib.models.run import Parallelism
from dtlib.parallel_nd.dims import ParallelDims
from dtlib.runtime import dist as ddist
from dtlib.train.config import TrainConfig
from dtlib.train.model import logits_of
from dtlib.zero.fsdp import bf16_policy

__all__ = ["Strategy", "STRATEGIES", "settle_ddp_buckets"]


def settle_ddp_buckets(model: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward whose gradients are thrown away, so that DDP has
    rebuilt its buckets before the first real step, in a fresh and a resumed run.

    DDP's first backward records the order gradients become ready and its next
    forward regroups the buckets by it. Bucket layout decides how gloo's ring cuts
    each buffer, hence the order in which the ranks' values are added: with 2 ranks
    a + b = b + a, with 4 the sums differ in the last bits. Without this, a resumed
    process runs its first step on the initial buckets where the uninterrupted run
    used rebuilt ones, and the 4-rank resume is not bit-exact. The generators are
    restored, so no random draw is consumed.

    Args:
        model: the DDP-wrapped model; x: one micro-batch of inputs on its device.

    Taught in: Chapter 9, "Exact resume under DDP".
    """
    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
    (logits_of(model(x)).float().sum() * 0.0).backward()
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, x.device)


def _ddp(cfg: TrainConfig, world: ddist.World) -> Parallelism:
    return data_parallel.parallelism("torch")


def _fsdp(cfg: TrainConfig, world: ddist.World) -> Parallelism:
    policy = bf16_policy() if cfg.precision == "bf16" else None
    if cfg.tp == 1:
        return zero.parallelism(3, variant="fsdp2", mp_policy=policy)
    # --tp: a (dp, tp) mesh, DTensor TP inside each row, FSDP2 across (Chapter 11).
    dims = ParallelDims(dp_shard=world.world_size // cfg.tp, tp=cfg.tp,
                        world_size=world.world_size)
    mesh = dims.mesh(("dp", "tp"), world.device.type)
    return parallel_nd.parallelism("fsdp_tp", mesh=mesh, mp_policy=policy)


@dataclass(frozen=True)
class Strategy:
    """One row of :data:`STRATEGIES`.

    parallelism: ``parallelism(cfg, world)`` -> the technique's Parallelism, built
        by its package's factory.
    zero_stage: what a rank keeps of the model states (0: all of them; 3: a 1/dp
        shard of parameters, gradients and optimizer state), for Chapter 1's formula.
    autocast: bf16/fp16 runs the forward under ``torch.autocast`` (else the
        wrapper's own mixed-precision policy computes in 16 bits).
    warm_up: ``warm_up(wrapped, x)`` before the first step, fresh or resumed, on
        one micro-batch of inputs ``x``, when there are several data-parallel ranks.
    shards_on_meta: ``apply`` runs on the meta-device model, before any memory is
        allocated (FSDP2, TP: a rank then allocates its shards only); else the model
        is allocated and initialised first (DDP broadcasts rank 0's values when it
        wraps, and every rank holds them all anyway).
    """

    parallelism: Callable[[TrainConfig, ddist.World], Parallelism]
    zero_stage: int
    autocast: bool
    warm_up: Callable[[nn.Module, torch.Tensor], None] | None = None
    shards_on_meta: bool = False


#: The strategies of ``--strategy`` (``config.STRATEGY_NAMES``, which the flag
#: checks): replicate (DDP) or shard (FSDP2, with --tp).
STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy(_ddp, zero_stage=0, autocast=True, warm_up=settle_ddp_buckets),
    "fsdp": Strategy(_fsdp, zero_stage=3, autocast=False, shards_on_meta=True),
}
