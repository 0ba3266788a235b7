"""Checkers for Chapter 0, "Hello, distributed"."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dtlib.runtime import launch
from dtlib.exercises import WrongAnswer, checker, passed


def _all_reduce_rank_plus_one() -> float:
    """On every rank: all-reduce (sum) a tensor holding rank + 1; return the result."""
    rank = dist.get_rank()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


@checker
def check_all_reduce_prediction(predict: Callable[[int, int], float],
                                world_sizes: tuple[int, ...] = (1, 2, 4)) -> None:
    """Check ``predict(world_size, rank)``: the value each rank holds after
    ``all_reduce(SUM)`` of ``tensor([rank + 1.0])``. The truth comes from real ranks."""
    for n in world_sizes:
        truth = launch.spawn(_all_reduce_rank_plus_one, n, stream=False)
        for rank, actual in enumerate(truth):
            got = predict(n, rank)
            if got != actual:
                raise WrongAnswer(
                    f"world_size={n}, rank={rank}: you predicted {got!r}, the rank "
                    f"holds {actual!r}. Hint: after an all-reduce every rank holds the "
                    "same value, the sum over all ranks of what each contributed.")
    passed(f"your prediction matches real all-reduces on {list(world_sizes)} ranks")
