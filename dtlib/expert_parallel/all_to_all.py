"""The all-to-all of expert parallelism, uneven splits, as autograd sees it.

A rank sends a different number of tokens to every other rank, so two exchanges make
one dispatch: first the *counts* (each rank learns how many rows it will receive from
each peer, and sizes its buffer), then the rows themselves. The combine sends the
expert outputs back along the same splits, reversed. Backward of an all-to-all is the
all-to-all with the splits swapped: the gradient of a row goes back to where the row
came from.

gloo and NCCL both implement ``all_to_all_single`` with uneven ``input_split_sizes``
and ``output_split_sizes``, zero-sized pieces included (checked on gloo by the tests),
so nothing here is built from send and receive.

Taught in: Chapter 14, "Expert parallelism on all-to-alls".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["exchange_counts", "AllToAll", "all_to_all"]


def exchange_counts(counts: torch.Tensor, group: Any = None) -> torch.Tensor:
    """One all-to-all of counts: ``counts[d]`` (``(ep, ...)``) go to rank ``d``.

    Args:
        counts: integer tensor whose first dimension is the group size; row ``d`` is
            what this rank will send to rank ``d`` (e.g. tokens per expert of ``d``).
        group: the expert-parallel process group.
    Returns:
        The same shape: row ``s`` is what rank ``s`` will send to this rank.

    Taught in: Chapter 14, "Expert parallelism on all-to-alls".
    """
    if counts.size(0) == 1:  # a group of one: the counts stay here
        return counts.clone()
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts.contiguous(), group=group)
    return got


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: Any) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """forward: all-to-all, backward: all-to-all (splits swapped).

    Rows ``in_splits[0]`` of ``x`` go to rank 0, the next ``in_splits[1]`` to rank 1,
    ...; the output holds ``out_splits[s]`` rows from each rank ``s``, in rank order.
    The gradient of the output travels back the same way reversed.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int],
                in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: Any = None) -> torch.Tensor:
    """:class:`AllToAll` (differentiable); the identity on a group of one rank.

    Args:
        x: rows to send, grouped by destination rank.
        out_splits, in_splits: rows received from / sent to each rank.
        group: the expert-parallel process group.
    Returns:
        The received rows, grouped by source rank.

    Taught in: Chapter 14, "Expert parallelism on all-to-alls".
    """
    if len(in_splits) == 1:
        return x
    return AllToAll.apply(x, list(out_splits), list(in_splits), group)
