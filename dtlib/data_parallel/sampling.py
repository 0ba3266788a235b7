"""Which samples each rank sees: DistributedSampler shards, epochs and padding.

``torch.utils.data.DistributedSampler`` needs only a length, a world size and a rank, so
every question here is answered in one process, with real indices, by asking the sampler
what rank r would get (``num_replicas=world_size, rank=r``).

:class:`ResumableSampler` is the same sharding with a position in the epoch, so that
a resumed job continues with the next sample instead of replaying the loader.

Taught in: Chapter 3, "Who reads which sample"; Chapter 9, "Resume without
replaying the loader" (:class:`ResumableSampler`).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler, Sampler


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


class ResumableSampler(Sampler[int]):
    """A shuffling, rank-sharding sampler that can start in the middle of an epoch.

    Like ``DistributedSampler`` (shuffle with ``seed + epoch``, rank r takes every
    world_size-th index, padded to equal length), plus a position: the number of this
    rank's samples already consumed in the epoch. Resuming skips them *arithmetically*
    (slicing the index list) instead of loading and throwing away the batches before.
    The position counts indices handed out, exact with ``num_workers=0``; with worker
    processes prefetching, set it from the batches the training loop really consumed.

    Taught in: Chapter 9, "Resume without replaying the loader".
    """

    def __init__(self, dataset_len: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(dataset_len, int) or dataset_len < 1:
            raise ValueError(f"dataset_len={dataset_len!r} must be a positive integer")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
        self.dataset_len, self.rank, self.world_size = dataset_len, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self.num_samples = -(-dataset_len // world_size)  # ceil: padded like DDP

    def indices(self) -> list[int]:
        """This rank's indices for the whole current epoch."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        total = self.num_samples * self.world_size
        # Pad by repeating the order as often as needed (1 sample on 4 ranks: 3
        # copies), as torch does.
        pad = total - len(order)
        order += (order * -(-pad // len(order)))[:pad]
        return order[self.rank:total:self.world_size]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[int]:
        for index in self.indices()[self.position:]:
            self.position += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples - self.position

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed"}``: enough to continue where we stopped."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state``'s epoch and position (the seed must agree)."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"state seed={state['seed']} differs from seed={self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
