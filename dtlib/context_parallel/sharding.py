"""Load-balanced sequence sharding for context parallelism.

With a causal mask, token t attends to tokens 0..t, so the last tokens of a sequence
do far more attention work than the first. Cutting the sequence into ``cp`` contiguous
pieces would leave rank 0 almost idle and rank ``cp - 1`` with most of the work. The
load-balanced ("zig-zag") layout cuts the sequence into ``2 * cp`` chunks and gives
rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``: one early, one late chunk, so every
rank has the same number of unmasked query-key pairs. (Llama 3 trains with this
layout; Liu et al. 2023 describe the ring; the balance is the Striped/zig-zag idea.)

Taught in: Chapter 12, "Context parallelism".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def cp_world(group: Any = None) -> tuple[int, int]:
    """``(rank, cp)`` of this process in the context-parallel group.

    Args:
        group: the process group (``None``: the default group, or a world of one when
            ``torch.distributed`` is not initialised).
    Returns:
        This rank's index in the group and the group's size.

    Taught in: Chapter 12, "Context parallelism".
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check(x: torch.Tensor, dim: int, cp: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for {name} with {x.dim()} dims")
    return dim % x.dim()


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) that rank ``rank`` holds: ``(rank, 2cp-1-rank)``.

    Args:
        rank: index in the context-parallel group, ``0 <= rank < cp``.
        cp: context-parallel group size.
    Returns:
        The early and the late chunk index.

    Taught in: Chapter 12, "Context parallelism".
    """
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in [0, cp={cp}) with cp >= 1")
    return rank, 2 * cp - 1 - rank


def shard_for(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """Rank ``rank``'s load-balanced shard of the full tensor ``x`` (no communication).

    Args:
        x: the full tensor; ``x.size(dim)`` must be divisible by ``2 * cp``.
        dim: the sequence dimension.
        rank: which rank's shard to return.
        cp: context-parallel group size.
    Returns:
        ``cat([chunk rank, chunk 2cp-1-rank], dim)``, ``x.size(dim) / cp`` long.

    Taught in: Chapter 12, "Context parallelism".
    """
    dim = _check(x, dim, cp, "x")
    early, late = chunk_ids(rank, cp)
    if x.size(dim) % (2 * cp):
        raise ValueError(f"x has {x.size(dim)} positions along dim={dim}; it must be "
                         f"divisible by 2 * cp = {2 * cp} (two chunks per rank)")
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[early], chunks[late]], dim).contiguous()


def unshard_from(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard_for`).

    Args:
        shards: ``[shard of rank 0, ..., shard of rank cp-1]``, equal shapes.
        dim: the sequence dimension.
    Returns:
        The full tensor, chunks in their original order.

    Taught in: Chapter 12, "Context parallelism".
    """
    cp = len(shards)
    if cp < 1:
        raise ValueError("shards must hold one tensor per rank, got an empty list")
    dim = _check(shards[0], dim, cp, "shards[0]")
    if shards[0].size(dim) % 2:
        raise ValueError(f"shards have {shards[0].size(dim)} positions along "
                         f"dim={dim}; each must be two equal chunks (an even length)")
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        early, late = chunk_ids(rank, cp)
        chunks[early], chunks[late] = shard.chunk(2, dim)
    return torch.cat(chunks, dim)  # type: ignore[arg-type]


def positions(local_len: int, rank: int, cp: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Global sequence positions of the tokens a rank holds, in its local order.

    Args:
        local_len: tokens on the rank (``seq_len / cp``, two chunks); must be even.
        rank: index in the context-parallel group.
        cp: context-parallel group size.
        device: where to create the index tensor (the data's device).
    Returns:
        A ``(local_len,)`` int64 tensor; cp=2, rank 0, local_len 4: ``[0, 1, 6, 7]``.

    Taught in: Chapter 12, "Context parallelism".
    """
    if local_len < 2 or local_len % 2:
        raise ValueError(f"local_len={local_len} must be even and >= 2 (two chunks)")
    c = local_len // 2
    early, late = chunk_ids(rank, cp)
    idx = torch.arange(c, device=device)
    return torch.cat([early * c + idx, late * c + idx])


def cp_shard(x: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """This rank's load-balanced share of a sequence every rank holds in full.

    The sequence is cut into ``2 * cp`` chunks; rank ``r`` keeps chunks ``r`` and
    ``2 * cp - 1 - r``, concatenated. No communication: every rank has ``x``.

    Args:
        x: the full tensor (same on every rank of ``group``).
        dim: the sequence dimension; ``x.size(dim)`` divisible by ``2 * cp``.
        group: the context-parallel process group (``None``: the default group).
    Returns:
        The local shard, ``x.size(dim) / cp`` long along ``dim``.

    Taught in: Chapter 12, "Context parallelism".
    """
    rank, cp = cp_world(group)
    return shard_for(x, dim, rank, cp)


def cp_unshard(y: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """The full sequence from every rank's load-balanced shard (all-gather, reorder).

    Not differentiable: it is for results and checks (the loss of a CP run is
    computed on local tokens and summed, as in the chapter).

    Args:
        y: this rank's shard (as returned by :func:`cp_shard` or a CP layer).
        dim: the sequence dimension.
        group: the context-parallel process group (``None``: the default group).
    Returns:
        The full tensor, in the original order, on every rank.

    Taught in: Chapter 12, "Context parallelism".
    """
    rank, cp = cp_world(group)
    _check(y, dim, cp, "y")
    if cp == 1:
        return y.detach().clone()
    y = y.detach().contiguous()
    shards = [torch.empty_like(y) for _ in range(cp)]
    dist.all_gather(shards, y, group=group)
    return unshard_from(shards, dim)


def causal_pairs_per_rank(seq_len: int, cp: int, balanced: bool = True) -> list[int]:
    """Unmasked (query, key) pairs each rank computes under a causal mask.

    Args:
        seq_len: full sequence length; divisible by ``2 * cp``.
        cp: context-parallel group size.
        balanced: the load-balanced layout (two chunks per rank) or contiguous pieces.
    Returns:
        ``[pairs of rank 0, ..., pairs of rank cp-1]``; they sum to ``s (s + 1) / 2``.

    Taught in: Chapter 12, "Context parallelism".
    """
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2 * cp = {2 * cp}")
    n = seq_len // cp
    if balanced:
        # query at position p sees p + 1 keys
        return [int((positions(n, r, cp) + 1).sum()) for r in range(cp)]
    return [sum(p + 1 for p in range(r * n, (r + 1) * n)) for r in range(cp)]
