"""Data parallelism as the one loop's :class:`~dtlib.models.run.Parallelism`.

``parallelism(variant)`` answers the loop's four questions for every DDP of the
chapter, ours and torch's:

- ``apply``: wrap the replica (moved to this rank's device) in :class:`DataParallel`
  (``"naive"``, ``"bucketed"``, ``"overlapped"``) or torch's
  ``DistributedDataParallel`` (``"torch"``);
- ``local_batch``: rank ``r`` of the data-parallel group takes rows
  ``r*b .. (r+1)*b - 1`` of every tensor of the global batch (``b`` rows each);
- ``full_state``: a replica already holds everything (the base class's);
- ``grad_sync``: ``no_sync()`` when backward must not synchronise.

With ``comm_hook``, ``apply`` also registers a communication hook on either DDP
(Chapter 15's gradient compression).

Taught in: Chapter 3, "Equal to one process".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from dtlib.data_parallel.ddp import TEACHING_VARIANTS, DataParallel
from dtlib.models.run import Batch, Parallelism, logits_of
from dtlib.runtime import dist as ddist

__all__ = ["VARIANTS", "DataParallelRows", "DataParallelism", "parallelism",
           "rows_of_rank",
           "settle_ddp_buckets"]

#: Every DDP of Chapter 3: the three teaching ones and torch's.
VARIANTS = (*TEACHING_VARIANTS, "torch")


def rows_of_rank(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rows ``rank*b .. (rank+1)*b - 1`` of every tensor of ``batch``, ``b`` equal
    shares of its rows; anything that is not a tensor is passed through.

    Args:
        batch: the global batch, a tuple of tensors with the same number of rows.
        rank: this rank's index in the data-parallel group.
        world_size: ranks in the group (must divide the number of rows).
    Returns:
        The tuple of this rank's rows (views of the global tensors): equal shares,
        so the mean of the ranks' mean losses is the global mean. The one row cut
        of every data-parallel technique (DDP, ZeRO, the layouts of Chapter 11,
        expert parallelism's ranks, the simulated ranks).

    Taught in: Chapter 3, "Equal to one process".
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    out = []
    for t in batch:
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        if t.shape[0] % world_size:
            raise ValueError(f"batch has {t.shape[0]} rows; world_size={world_size} "
                             "must divide it (every rank trains on as many rows)")
        b = t.shape[0] // world_size
        out.append(t[rank * b:(rank + 1) * b])
    return tuple(out)


class DataParallelRows(Parallelism):
    """What every data-parallel technique shares: the ranks of ``group`` (default:
    the world; one process when none is initialised) each take their rows of the
    global batch, on this rank's device, and the logged loss is averaged over them
    (the base class's ``global_loss`` over ``dp_group``).

    Taught in: Chapter 3, "Equal to one process"; subclassed by ZeRO, FSDP2 and
    DiLoCo.
    """

    def __init__(self, group: Any = None) -> None:
        on = dist.is_available() and dist.is_initialized()
        self.dp_group = group
        self.dp_size = dist.get_world_size(group) if on else 1
        self.dp_rank = dist.get_rank(group) if on else 0

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's rows of every tensor, on this rank's device."""
        device = ddist.world().device
        mine = rows_of_rank(batch, self.dp_rank, self.dp_size)
        return tuple(t.to(device) if isinstance(t, torch.Tensor) else t
                     for t in mine)


class DataParallelism(DataParallelRows):
    """Replicas that average their gradients: one DDP variant, ours or torch's.

    Args:
        variant: one of :data:`VARIANTS`.
        group: the data-parallel process group (default: the whole world).
        bucket_cap_mb: bucket size cap (MiB) of every bucketed variant, torch's too.
        timeline: record :class:`DataParallel`'s event timeline (teaching variants).
        comm_hook, comm_state: ``wrapped.register_comm_hook(comm_state, comm_hook)``
            after wrapping (``"bucketed"``, ``"overlapped"`` or ``"torch"``), e.g.
            PowerSGD (Chapter 15); None: plain all-reduces.

    Taught in: Chapter 3, "Equal to one process".
    """

    def __init__(self, variant: str = "torch", *, group: Any = None,
                 bucket_cap_mb: float = 25.0, timeline: bool = False,
                 comm_hook: Callable[[Any, Any], Any] | None = None,
                 comm_state: Any = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} is not allowed; allowed: "
                             f"{VARIANTS}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb,
                                                             (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number > 0 "
                             "(MiB)")
        if timeline and variant == "torch":
            raise ValueError("timeline=True records DataParallel's events; "
                             f"variant must be one of {TEACHING_VARIANTS}")
        if comm_hook is not None and not callable(comm_hook):
            raise ValueError(f"comm_hook={comm_hook!r} must be callable as "
                             "hook(state, bucket) -> Future, or None")
        if comm_hook is not None and variant == "naive":
            raise ValueError(f"variant={variant!r} has no buckets to hand a "
                             "communication hook; use 'bucketed', 'overlapped' or "
                             "'torch'")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("data parallelism needs an initialised process group: "
                             "call dtlib.runtime.dist.init() first (or launch with "
                             "dtlib.runtime.launch)")
        self.variant = variant
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.timeline = timeline
        self.comm_hook, self.comm_state = comm_hook, comm_state
        self.name = f"ddp/{variant}"
        if comm_hook is not None:
            self.name += f"+{getattr(comm_hook, '__name__', 'hook')}"
        super().__init__(group)

    def apply(self, model: nn.Module) -> nn.Module:
        """The replica on this rank's device, wrapped in the chosen DDP."""
        device = ddist.world().device
        model = model.to(device)
        wrapped: DistributedDataParallel | DataParallel
        if self.variant == "torch":
            ids = [device.index] if device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=ids,
                                              process_group=self.dp_group,
                                              bucket_cap_mb=self.bucket_cap_mb)
        else:
            wrapped = DataParallel(model, variant=self.variant, group=self.dp_group,
                                   bucket_cap_mb=self.bucket_cap_mb,
                                   timeline=self.timeline)
        if self.comm_hook is not None:
            wrapped.register_comm_hook(self.comm_state, self.comm_hook)
        return wrapped

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        """``no_sync()`` of either DDP when ``on`` is False."""
        return contextlib.nullcontext() if on else wrapped.no_sync()


def parallelism(variant: str = "torch", *, group: Any = None,
                bucket_cap_mb: float = 25.0, timeline: bool = False,
                comm_hook: Callable[[Any, Any], Any] | None = None,
                comm_state: Any = None) -> DataParallelism:
    """The :class:`~dtlib.models.run.Parallelism` of one DDP variant.

    Args:
        variant: ``"naive"``, ``"bucketed"``, ``"overlapped"`` (Chapter 3's
            :class:`DataParallel`) or ``"torch"`` (``DistributedDataParallel``).
        group: the data-parallel process group (default: the whole world).
        bucket_cap_mb: bucket size cap in MiB (> 0) for every bucketed variant.
        timeline: record the overlapped DDP's event timeline (teaching variants).
        comm_hook, comm_state: a communication hook and its state (Chapter 15),
            registered on the DDP; None: plain all-reduces.
    Returns:
        A :class:`DataParallelism`; ``dp_group``/``dp_size`` are ``group`` and its
        size.

    Taught in: Chapter 3, "Equal to one process".
    """
    return DataParallelism(variant, group=group, bucket_cap_mb=bucket_cap_mb,
                           timeline=timeline, comm_hook=comm_hook,
                           comm_state=comm_state)


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
