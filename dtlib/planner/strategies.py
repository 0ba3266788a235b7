"""The book's one strategy table: a name -> the technique package that runs it.

Chapter 13 and ``python -m dtlib.bench time`` time the strategies the step-time model
prices (:data:`~dtlib.planner.step_time.MODELLED`), and the capstone's ``--strategy``
offers the rows marked ``capstone``: all of them build their
:class:`~dtlib.models.run.Parallelism` here, from the technique's own factory, and
read the facts they ask about a strategy from its row. Adding a strategy is adding a
row; nothing else branches on its name.

==============  =============================================  ======================
name            runs                                           used by
==============  =============================================  ======================
ddp             torch's ``DistributedDataParallel``            the capstone
ddp/naive,      Chapter 3's DataParallel, one all-reduce per   Chapter 13, bench
ddp/bucketed,   tensor, per bucket, buckets overlapped with
ddp/overlapped  backward
zero-1..3       Chapter 4's ZeRO stages                        Chapter 13, bench
fsdp            torch's FSDP2 (``fully_shard``); ``tp > 1``:   the capstone,
                FSDP2 x DTensor TP on a (dp, tp) mesh          Chapter 13, bench
tp              Chapter 5's Megatron TP (the book's f and g)   Chapter 13, bench
gpipe, 1f1b,    Chapter 6's schedules (zb-h1: the backward      Chapter 13, bench
zb-h1, zb-v     split into B and W; zb-v: two stages a rank,
                in a V)
==============  =============================================  ======================

Taught in: Chapter 10, "The script's structure" (the capstone's rows), and Chapter
13, "Predicted against measured".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from dtlib import data_parallel, parallel_nd, pipeline_parallel, tensor_parallel, zero
from dtlib.models.run import Parallelism
from dtlib.parallel_nd.dims import ParallelDims
from dtlib.runtime import dist as ddist

__all__ = ["Options", "Strategy", "STRATEGIES", "capstone_names", "one_rank_names"]


@dataclass(frozen=True)
class Options:
    """What a caller may choose about a strategy; a row refuses what it cannot honour.

    bucket_cap_mb: the DDP variants' bucket cap in MiB (torch's default 25).
    n_micro: the pipelines' micro-batches per step.
    mp_policy: FSDP2's ``MixedPrecisionPolicy`` (e.g. ``zero.fsdp.bf16_policy()``).
    tp: the tensor-parallel degree inside FSDP2 (a (world / tp, tp) mesh).
    """

    bucket_cap_mb: float = 25.0
    n_micro: int = 4
    mp_policy: Any = None
    tp: int = 1


def _ddp(variant: str) -> Callable[[Options], Parallelism]:
    def build(o: Options) -> Parallelism:
        return data_parallel.parallelism(variant, bucket_cap_mb=o.bucket_cap_mb)
    return build


def _zero(stage: int) -> Callable[[Options], Parallelism]:
    def build(o: Options) -> Parallelism:
        return zero.parallelism(stage, variant="ours")
    return build


def _fsdp(o: Options) -> Parallelism:
    if o.tp == 1:
        return zero.parallelism(3, variant="fsdp2", mp_policy=o.mp_policy)
    # a (dp, tp) mesh: DTensor TP inside each row, FSDP2 across (Chapter 11)
    world = ddist.world()
    dims = ParallelDims(dp_shard=world.world_size // o.tp, tp=o.tp,
                        world_size=world.world_size)
    mesh = dims.mesh(("dp", "tp"), world.device.type)
    return parallel_nd.parallelism("fsdp_tp", mesh=mesh, mp_policy=o.mp_policy)


def _tp(o: Options) -> Parallelism:
    return tensor_parallel.parallelism("ours")


def _pipe(schedule: str, chunks: int = 1) -> Callable[[Options], Parallelism]:
    def build(o: Options) -> Parallelism:
        return pipeline_parallel.parallelism(schedule, o.n_micro, chunks=chunks)
    return build


@dataclass(frozen=True)
class Strategy:
    """One row of :data:`STRATEGIES`.

    build: ``build(options)`` -> the technique's Parallelism, from its package's
        factory (call :meth:`parallelism`, which checks the options first).
    zero_stage: what a rank keeps of the model states (0: all of them; 3: a 1/dp
        shard of parameters, gradients and optimizer state), for Chapter 1's formula.
    options: the fields of :class:`Options` this row reads (others must keep their
        defaults).
    capstone: offered by the capstone's ``--strategy``.
    one_rank: its machinery runs on a one-rank world as on N ranks, less the bytes
        (a pipeline or a TP plan needs its peers): Chapter 13 times it there.
    autocast: the capstone runs the forward under ``torch.autocast`` for bf16/fp16
        (else the wrapper's own mixed-precision policy computes in 16 bits).
    warm_up: ``warm_up(wrapped, x)`` before the first step, fresh or resumed, on
        one micro-batch of inputs ``x``, when there are several data-parallel ranks.
    shards_on_meta: ``apply`` runs on the meta-device model, before any memory is
        allocated (FSDP2, TP: a rank then allocates its shards only); else the model
        is allocated and initialised first (DDP broadcasts rank 0's values when it
        wraps, and every rank holds them all anyway).
    stages_per_rank: a pipeline's stages on each rank (0: not a pipeline); every
        stage holds a block at least, see :meth:`fits`.
    """

    build: Callable[[Options], Parallelism]
    zero_stage: int
    options: tuple[str, ...] = ()
    capstone: bool = False
    one_rank: bool = False
    autocast: bool = False
    warm_up: Callable[[nn.Module, torch.Tensor], None] | None = None
    shards_on_meta: bool = False
    stages_per_rank: int = 0

    def fits(self, n_layers: int, world_size: int) -> str | None:
        """Why this row cannot run a model of ``n_layers`` blocks on ``world_size``
        ranks (a pipeline needs a block per stage), or None when it can."""
        stages = self.stages_per_rank * world_size
        if stages > n_layers:
            return (f"{n_layers} blocks cannot make {stages} stages "
                    f"({self.stages_per_rank} a rank on {world_size} ranks)")
        return None

    def parallelism(self, options: Options | None = None) -> Parallelism:
        """The row's Parallelism under ``options``.

        Raises:
            ValueError: an option this row does not read was changed from its
                default (naming it and what the row reads), or ``tp`` < 1.
        """
        o = options or Options()
        default = Options()
        for name in ("bucket_cap_mb", "n_micro", "mp_policy", "tp"):
            if name not in self.options and getattr(o, name) != getattr(default, name):
                raise ValueError(f"{name}={getattr(o, name)!r}: this strategy does not "
                                 f"read it; it reads: {list(self.options) or 'none'}")
        if isinstance(o.tp, bool) or not isinstance(o.tp, int) or o.tp < 1:
            raise ValueError(f"tp={o.tp!r} must be an integer >= 1")
        return self.build(o)


_DDP = ("bucket_cap_mb",)

#: Every strategy the book runs by name.
STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy(_ddp("torch"), 0, _DDP, capstone=True, one_rank=False,
                    autocast=True, warm_up=data_parallel.settle_ddp_buckets),
    "ddp/naive": Strategy(_ddp("naive"), 0, _DDP, one_rank=True),
    "ddp/bucketed": Strategy(_ddp("bucketed"), 0, _DDP, one_rank=True),
    "ddp/overlapped": Strategy(_ddp("overlapped"), 0, _DDP, one_rank=True),
    "zero-1": Strategy(_zero(1), 1, one_rank=True),
    "zero-2": Strategy(_zero(2), 2, one_rank=True),
    "zero-3": Strategy(_zero(3), 3, one_rank=True),
    "fsdp": Strategy(_fsdp, 3, ("mp_policy", "tp"), capstone=True, one_rank=True,
                     shards_on_meta=True),
    "tp": Strategy(_tp, 0),
    "gpipe": Strategy(_pipe("gpipe"), 0, ("n_micro",), stages_per_rank=1),
    "1f1b": Strategy(_pipe("1f1b"), 0, ("n_micro",), stages_per_rank=1),
    "zb-h1": Strategy(_pipe("zb-h1"), 0, ("n_micro",), stages_per_rank=1),
    "zb-v": Strategy(_pipe("zb-v", chunks=2), 0, ("n_micro",), stages_per_rank=2),
}


def capstone_names() -> tuple[str, ...]:
    """The rows the capstone's ``--strategy`` offers, in table order."""
    return tuple(n for n, s in STRATEGIES.items() if s.capstone)


def one_rank_names() -> tuple[str, ...]:
    """The rows whose machinery Chapter 13 times on a one-rank world."""
    return tuple(n for n, s in STRATEGIES.items() if s.one_rank)
