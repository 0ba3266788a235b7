"""A unit of ZeRO sharding: parameters flattened into one buffer, split across ranks.

Stage 1 and 2 shard a unit's optimizer state and gradients; stage 3 also frees the full
buffer between uses (:func:`free_flat`) and refills it on demand.

Taught in: Chapter 4, ZeRO.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dtlib.zero.flat_params import FlatLayout

__all__ = ["Unit", "free_flat"]


class Unit:
    """One group of parameters sharded together: a bucket (stage 2), a module (3)."""

    def __init__(self, owner: nn.Module, names: list[str], params: list[nn.Parameter],
                 world_size: int, rank: int) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"unit {names} mixes dtypes {dtypes}; use one dtype")
        self.owner = owner
        self.layout = FlatLayout(params, names, world_size)
        self.lo, self.hi = self.layout.shard_range(rank)
        self.flat_param: torch.Tensor = torch.empty(0)  # full buffer (freed in stage 3)
        self.shard: nn.Parameter | None = None  # what the optimizer updates
        self.flat_grad: torch.Tensor | None = None  # stage 1: full gradient buffer
        self.grad_shard: torch.Tensor = torch.empty(0)  # this rank's averaged gradient
        self.ready = 0  # parameters whose gradient arrived in this backward
        self.reduced = False
        self.gathered = True

    @property
    def params(self) -> list[nn.Parameter]:
        return self.layout.params


def free_flat(unit: Unit) -> None:
    """Release the storage of a unit's full buffer; its views keep their shapes."""
    unit.flat_param.untyped_storage().resize_(0)
    unit.gathered = False
