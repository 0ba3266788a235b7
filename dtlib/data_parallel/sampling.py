"""Which samples each rank sees: DistributedSampler shards, epochs and padding.

``torch.utils.data.DistributedSampler`` needs only a length, a world size and a rank, so
every question here is answered in one process, with real indices, by asking the sampler
what rank r would get (``num_replicas=world_size, rank=r``).

Taught in: Chapter 3, "Who reads which sample".
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch
from torch.utils.data import DistributedSampler


def _check(dataset_len: int, world_size: int) -> None:
    if not isinstance(dataset_len, int) or dataset_len < 1:
        raise ValueError(f"dataset_len={dataset_len!r} must be a positive integer")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")


def shards(dataset_len: int, world_size: int, *, epoch: int | None = 0,
           shuffle: bool = True, drop_last: bool = False, seed: int = 0
           ) -> list[list[int]]:
    """The indices each rank's DistributedSampler yields in one epoch.

    Args:
        dataset_len: samples in the dataset.
        world_size: ranks.
        epoch: passed to ``set_epoch``; ``None`` means set_epoch is never called.
        shuffle, drop_last, seed: as in ``DistributedSampler``.
    Returns:
        ``[indices of rank 0, indices of rank 1, ...]``.

    Taught in: Chapter 3, "Who reads which sample".
    """
    _check(dataset_len, world_size)
    out = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(dataset_len), num_replicas=world_size,
                                     rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
        if epoch is not None:
            sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def epoch_orders(dataset_len: int, world_size: int, rank: int, epochs: int,
                 set_epoch: bool = True, seed: int = 0) -> list[list[int]]:
    """What ``rank`` reads in each of ``epochs`` epochs, with or without ``set_epoch``.

    One sampler lives across epochs, as in a training loop. Without ``set_epoch`` its
    shuffle is seeded with ``seed + 0`` every epoch: the same order, every epoch.

    Taught in: Chapter 3, "set_epoch".
    """
    _check(dataset_len, world_size)
    sampler = DistributedSampler(range(dataset_len), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def duplicated(shard_lists: Sequence[Sequence[int]]) -> dict[int, int]:
    """Indices that appear more than once across all shards, with their count."""
    counts = Counter(i for shard in shard_lists for i in shard)
    return {i: c for i, c in sorted(counts.items()) if c > 1}


def sharded_mean(values: torch.Tensor, shard_lists: Sequence[Sequence[int]]) -> float:
    """The mean an evaluation computes when each rank sums its shard and counts it.

    This is what ``all_reduce(sum) / all_reduce(count)`` gives: exact only when every
    sample is counted once.
    """
    total = sum(float(values[list(s)].sum()) for s in shard_lists if len(s))
    count = sum(len(s) for s in shard_lists)
    return total / count


def eval_shards(dataset_len: int, world_size: int) -> list[list[int]]:
    """Evaluation shards without padding: rank r takes r, r + world_size, ...

    Ranks get sizes differing by at most one, no sample twice and none missing; each
    rank all-reduces its sum *and* its count, so the mean is exact.

    Taught in: Chapter 3, "The padding pitfall".
    """
    _check(dataset_len, world_size)
    return [list(range(rank, dataset_len, world_size)) for rank in range(world_size)]
