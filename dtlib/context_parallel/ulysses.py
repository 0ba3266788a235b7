"""DeepSpeed-Ulysses: the all-to-all alternative to ring attention (Jacobs et al. 2023).

Each rank holds ``s/cp`` tokens of every head. One all-to-all per tensor re-shards q, k
and v to *all* tokens of ``a/cp`` heads; attention then runs locally (any kernel, here
``scaled_dot_product_attention``), and one all-to-all brings the output back to
``s/cp`` tokens of every head. The heads must divide by ``cp``.

With the load-balanced layout of :func:`~dtlib.context_parallel.cp_shard`, the tokens
arrive in shard order (rank 0's two chunks, rank 1's, ...), so they are put back in
sequence order before the causal attention and in shard order after it.

Taught in: Chapter 12, "Ring or all-to-all?".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.context_parallel.sharding import cp_world, positions


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    # x (cp, ...) contiguous: piece i goes to rank i, piece i of the result came from i
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    b, a, n, d = x.shape  # this rank's n = s/cp tokens of all a heads
    pieces = x.reshape(b, cp, a // cp, n, d).transpose(0, 1).contiguous()
    got = _all_to_all(pieces, group)  # (cp, b, a/cp, n, d): rank i's tokens, my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, a // cp, cp * n, d)


def _heads_to_seq(y: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    b, h, s, d = y.shape  # all s tokens of this rank's h = a/cp heads
    pieces = y.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(pieces, group)  # (cp, b, h, s/cp, d): my tokens, rank i's heads
    return got.transpose(0, 1).reshape(b, cp * h, s // cp, d)


class SeqToHeads(torch.autograd.Function):
    """forward: all-to-all from sequence-split to head-split; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        return _seq_to_heads(x, group, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        return _heads_to_seq(grad, ctx.group, ctx.cp), None, None


class HeadsToSeq(torch.autograd.Function):
    """forward: all-to-all from head-split to sequence-split; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        return _heads_to_seq(y, group, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        return _seq_to_heads(grad, ctx.group, ctx.cp), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      causal: bool = True, group: Any = None) -> torch.Tensor:
    """Exact attention over a sharded sequence by re-sharding heads (all-to-all).

    Args:
        q, k, v: this rank's chunks ``[batch, heads, local_seq, head_dim]`` in the
            load-balanced layout of :func:`~dtlib.context_parallel.cp_shard`; heads
            divisible by the group size.
        causal: mask by global position.
        group: the context-parallel process group.
    Returns:
        This rank's output chunk, same shape: equal to :func:`ring_attention`'s.

    Taught in: Chapter 12, "Ring or all-to-all?".
    """
    rank, cp = cp_world(group)
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be equal 4-d [batch, heads, local_seq, "
                         f"head_dim] tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.size(1) % cp:
        raise ValueError(f"q has {q.size(1)} heads; Ulysses needs them divisible by "
                         f"cp={cp}")
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    n = q.size(2)
    # global position of each token after the all-to-all (shard order), and the
    # permutation that sorts them into sequence order
    pos = torch.cat([positions(n, r, cp, q.device) for r in range(cp)])
    order = torch.argsort(pos)
    qh, kh, vh = (SeqToHeads.apply(t, group, cp).index_select(2, order)
                  for t in (q, k, v))
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    back = torch.argsort(order)  # sequence order -> shard order
    return HeadsToSeq.apply(y.index_select(2, back), group, cp)
