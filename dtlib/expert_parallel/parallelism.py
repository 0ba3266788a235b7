"""Expert parallelism with data parallelism, a :class:`~dtlib.models.run.Parallelism`.

The world of ``ep * edp`` ranks is a grid ``(edp, ep)`` (:mod:`dtlib.parallel_nd.grid`):
each row is an expert-parallel group (adjacent ranks, the experts split among them),
each column an *expert-data-parallel* group (the ranks holding the same experts).

- ``apply``: every MoE layer keeps this rank's ``E/ep`` experts
  (:class:`~dtlib.expert_parallel.layer.ExpertParallelMoE`);
- ``local_batch``: rank ``r`` of the world trains on rows ``r`` of the global batch
  cut in ``ep * edp`` equal parts (every rank has its own tokens: the dense part is
  data parallel over the whole world);
- ``grad_sync``: after a synchronised backward, the dense gradients are summed over
  the world and the expert gradients over their expert-data-parallel group, both
  divided by the world size (each expert already received the gradient of every
  token its ep group routed to it, through the all-to-all's backward);
- ``full_state``: experts gathered over the ep group, named as on one process.

Taught in: Chapter 14, "Expert and data parallelism together".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.collectives.algorithms import all_gather_into
from dtlib.data_parallel.parallelism import rows_of_rank
from dtlib.expert_parallel.gpt import MoEBlock
from dtlib.expert_parallel.layer import ExpertParallelMoE
from dtlib.models.run import Batch, Parallelism, tensors_by_name, unwrap
from dtlib.parallel_nd.dims import ParallelDims

__all__ = ["ExpertParallel", "parallelism", "expert_params", "dense_params"]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts this rank holds (every ExpertParallelMoE)."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE)
            for p in m.experts.parameters()]


def dense_params(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter: attention, norms, embeddings, routers (replicated)."""
    experts = {id(p) for p in expert_params(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def _sum_grads(params: list[nn.Parameter], group: Any, size: int,
               world_size: int) -> None:
    """Sum the gradients over ``group`` as one flat message, divide by the world."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if size > 1:
        dist.all_reduce(flat, group=group)
    flat /= world_size
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


class ExpertParallel(Parallelism):
    """Experts split over ``ep`` ranks, everything replicated ``edp`` times.

    Args:
        ep: expert-parallel group size (divides the number of experts).
        edp: expert-data-parallel size, the replicas of each expert; ``ep * edp``
            is the world size. The batch's rows are split over all ``ep * edp``
            ranks, so the one loop's ``dp_size`` (the ranks that average the
            non-expert gradients) is the world size.

    Taught in: Chapter 14, "Expert and data parallelism together".
    """

    name = "ep"

    def __init__(self, *, ep: int, edp: int = 1) -> None:
        for field_name, value in (("ep", ep), ("edp", edp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field_name}={value!r} must be a positive integer")
        self.ep, self.world_size = ep, ep * edp
        self.grid = ParallelDims(dp_shard=ep * edp, ep=ep).grid(("edp", "ep"))
        self.ep_group, self.edp_group = self.grid.groups["ep"], self.grid.groups["edp"]
        self.dp_group, self.dp_size, self.edp = None, self.world_size, edp
        self.rank = dist.get_rank()

    def apply(self, model: nn.Module) -> nn.Module:
        """Every MoE block keeps this rank's experts (in place); returns ``model``."""
        for block in model.modules():
            if isinstance(block, MoEBlock):
                block.moe = ExpertParallelMoE(block.moe, self.ep_group)
        return model

    def local_batch(self, batch: Batch) -> Batch:
        """Rows ``rank`` of every tensor cut in ``world_size`` equal parts."""
        if batch[0].size(0) % self.world_size:
            raise ValueError(f"batch of {batch[0].size(0)} rows must divide by "
                             f"ep * edp = {self.world_size}")
        return rows_of_rank(batch, self.rank, self.world_size)

    @contextlib.contextmanager
    def grad_sync(self, wrapped: nn.Module, on: bool) -> Iterator[None]:
        """Backward inside; on leaving with ``on``: dense over the world, experts
        over their expert-data-parallel group, both divided by the world size."""
        yield
        if on:
            model = unwrap(wrapped)
            _sum_grads(dense_params(model), None, self.world_size, self.world_size)
            _sum_grads(expert_params(model), self.edp_group, self.edp,
                       self.world_size)

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        """Full parameters (or gradients) by one-process name; experts gathered."""
        model = unwrap(wrapped)
        out = tensors_by_name(model, grads=grads)
        for prefix, m in model.named_modules():
            if not isinstance(m, ExpertParallelMoE):
                continue
            named = list(m.experts.named_parameters())
            for name, _ in named:
                out.pop(f"{prefix}.experts.{name}", None)
            local = [p.grad if grads else p for _, p in named]
            if any(t is None for t in local):
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in local])
            every = flat.new_empty(self.ep * flat.numel())
            all_gather_into(every, flat, group=self.ep_group)
            for q, chunk in enumerate(every.view(self.ep, -1)):
                pieces = chunk.split([t.numel() for t in local])
                for (name, p), piece in zip(named, pieces):
                    j, rest = name.split(".", 1)
                    key = f"{prefix}.experts.{q * m.local + int(j)}.{rest}"
                    out[key] = piece.view_as(p).cpu().clone()
        return out


def parallelism(*, ep: int, edp: int = 1) -> ExpertParallel:
    """Expert parallelism for :func:`~dtlib.models.run.run_steps`.

    Args:
        ep: expert-parallel group size; edp: expert-data-parallel size, the
            replicas of each expert (``ep * edp`` = world size). Collective:
            creates the groups.
    Returns:
        An :class:`ExpertParallel`.

    Taught in: Chapter 14, "Expert and data parallelism together".
    """
    return ExpertParallel(ep=ep, edp=edp)
