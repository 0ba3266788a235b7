"""The communication operators of tensor parallelism (Megatron-LM's f and g).

Each is an ``autograd.Function`` that takes the process group explicitly and does
nothing when the group has one rank, as in Megatron-LM
``core/tensor_parallel/mappings.py`` and picotron ``tp_communications.py`` (Shoeybi
et al. 2019, §3):

- **f** (:class:`CopyToParallelRegion`): forward identity, backward all-reduce. It sits
  before a column-parallel layer, whose input gradient is only this rank's share.
- **g** (:class:`ReduceFromParallelRegion`): forward all-reduce, backward identity. It
  sits after a row-parallel layer, whose outputs are partial sums.
- gather / scatter along the last dimension, for a column layer whose full output is
  needed (the LM head).

Taught in: Chapter 5, "Tensor parallel".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["tp_size", "tp_rank", "copy_to_tp", "reduce_from_tp", "gather_from_tp",
           "scatter_to_tp", "CopyToParallelRegion", "ReduceFromParallelRegion",
           "GatherFromParallelRegion", "ScatterToParallelRegion"]


def tp_size(group: Any = None) -> int:
    """Ranks in the tensor-parallel ``group`` (1 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def tp_rank(group: Any = None) -> int:
    """This rank's index inside ``group`` (0 when torch.distributed is not set up)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous().clone()  # never modify a tensor autograd may have saved
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    n, r = tp_size(group), tp_rank(group)
    if x.size(-1) % n:
        raise ValueError(f"last dimension {x.size(-1)} not divisible by tp={n}")
    return x.chunk(n, dim=-1)[r].contiguous()


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tp_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class CopyToParallelRegion(torch.autograd.Function):
    """Megatron's **f**. forward: identity (copy), backward: all-reduce (sum).

    Sits before a column-parallel layer whose input is replicated: each rank's input
    gradient holds only its columns' contribution; the sum over ranks is the full one.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if tp_size(ctx.group) == 1:
            return grad, None
        return _all_reduce(grad, ctx.group), None


class ReduceFromParallelRegion(torch.autograd.Function):
    """Megatron's **g**. forward: all-reduce (sum), backward: identity.

    Sits after a row-parallel layer: sums the ranks' partial products. The sum's
    gradient with respect to each summand is the output gradient itself.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        if tp_size(group) == 1:
            return x
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherFromParallelRegion(torch.autograd.Function):
    """forward: all-gather along the last dim, backward: split (keep this rank's slice).

    Only for a column-parallel layer whose full output is wanted
    (``gather_output=True``); a column -> row pair never needs it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        if tp_size(group) == 1:
            return x
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if tp_size(ctx.group) == 1:
            return grad, None
        return _split_last(grad, ctx.group), None


class ScatterToParallelRegion(torch.autograd.Function):
    """forward: split along the last dim (keep this rank's slice), backward: all-gather.

    Only for a row-parallel layer fed a replicated input (``input_is_parallel=False``).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        if tp_size(group) == 1:
            return x
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if tp_size(ctx.group) == 1:
            return grad, None
        return _gather_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Apply f (identity forward, all-reduce backward). Taught in: Chapter 5."""
    return CopyToParallelRegion.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Apply g (all-reduce forward, identity backward). Taught in: Chapter 5."""
    return ReduceFromParallelRegion.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather the last dim forward, split backward. Taught in: Chapter 5."""
    return GatherFromParallelRegion.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Split the last dim forward, all-gather backward. Taught in: Chapter 5."""
    return ScatterToParallelRegion.apply(x, group)
