"""Context parallelism as a :class:`~dtlib.models.run.Parallelism`: the one loop's view.

- ``apply``: every block attends through the ring (:func:`context_parallelize`), and
  the model is fed this rank's tokens at their global positions
  (:class:`ContextParallelGPT`);
- ``local_batch``: this rank's load-balanced share of every tensor's tokens
  (:func:`cp_shard` along the sequence, dim 1);
- ``grad_sync``: at the end of a synchronised backward, the gradients are averaged
  over the group (:func:`average_cp_grads`), as data parallelism averages them:
  every rank holds the same number of tokens, so the mean of the ranks' mean losses
  is the mean over all tokens. Hence the loop's averaging group (``dp_group``,
  ``dp_size``) is the CP group (``cp_group``, ``cp_size``);
- ``global_loss``: the mean of the ranks' losses.

Taught in: Chapter 12, "A GPT trained with context parallelism".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.nn as nn

from dtlib.context_parallel.gpt import (ContextParallelGPT, average_cp_grads,
                                        context_parallelize)
from dtlib.context_parallel.sharding import cp_shard, cp_world
from dtlib.models.run import Batch, Parallelism, unwrap

__all__ = ["ContextParallel", "parallelism"]


class ContextParallel(Parallelism):
    """The sequence split over ``group``, attention exact through the ring.

    Args:
        group: the context-parallel process group (None: all ranks).

    Taught in: Chapter 12, "A GPT trained with context parallelism".
    """

    name = "cp"

    def __init__(self, *, group: Any = None) -> None:
        self.cp_group, self.cp_size = group, cp_world(group)[1]
        self.group = group
        # The loop's dp_group / dp_size are "the ranks whose mean loss is the
        # global batch's, averaging gradients": under CP, the CP ranks (no DP here).
        self.dp_group, self.dp_size = self.cp_group, self.cp_size

    def apply(self, model: nn.Module) -> nn.Module:
        """Ring attention in every block; returns a :class:`ContextParallelGPT`."""
        return ContextParallelGPT(context_parallelize(model, self.group), self.group)

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's load-balanced tokens of every ``(batch, seq)`` tensor."""
        return tuple(cp_shard(t, 1, self.group) for t in batch)

    @contextlib.contextmanager
    def grad_sync(self, wrapped: nn.Module, on: bool) -> Iterator[None]:
        """Backward inside; on leaving with ``on``, gradients averaged over cp."""
        yield
        if on:
            average_cp_grads(unwrap(wrapped), self.group)


def parallelism(*, group: Any = None) -> ContextParallel:
    """Context parallelism for :func:`~dtlib.models.run.run_steps`.

    Args:
        group: the context-parallel process group (None: all ranks). The model must
            be a ``dtlib.models.GPT`` without dropout, its sequence divisible by
            ``2 * cp``.
    Returns:
        A :class:`ContextParallel`.

    Taught in: Chapter 12, "A GPT trained with context parallelism".
    """
    return ContextParallel(group=group)
