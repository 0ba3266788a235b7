"""A unit of ZeRO sharding: parameters flattened into one buffer, split across ranks.

Stage 1 and 2 shard a unit's optimizer state and gradients; stage 3 also frees the full
buffer between uses (:func:`free_flat`) and refills it on demand.

The optimizer does not see the shard as one tensor but as *pieces*: the part of each
parameter that falls inside this rank's shard (a 1-D view of the shard). A piece
belongs to its parameter's group (its own learning rate, weight decay) and is
skipped, like a parameter whose ``.grad`` is ``None``, when its parameter got no
gradient on any rank: exactly what ``torch.optim.AdamW`` does on one process.

Taught in: Chapter 4, ZeRO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from dtlib.zero.flat_params import FlatLayout

__all__ = ["Unit", "Piece", "free_flat"]


@dataclass
class Piece:
    """The part of parameter ``index`` of a unit inside this rank's shard.

    param: what the optimizer updates (a view of the shard, 1-D).
    lo, hi: its range inside the shard (and inside the unit's gradient shard).
    """

    index: int
    param: nn.Parameter
    lo: int
    hi: int


class Unit:
    """One group of parameters sharded together: a bucket (stage 2), a module (3)."""

    def __init__(self, index: int, owner: nn.Module, names: list[str],
                 params: list[nn.Parameter], world_size: int, rank: int) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"unit {names} mixes dtypes {dtypes}; use one dtype")
        self.index = index
        self.owner = owner
        self.layout = FlatLayout(params, names, world_size)
        self.lo, self.hi = self.layout.shard_range(rank)
        self.flat_param: torch.Tensor = torch.empty(0)  # full buffer (freed in stage 3)
        self.shard: torch.Tensor = torch.empty(0)  # this rank's part of the parameters
        self.pieces: list[Piece] = []  # what the optimizer updates
        self.full_views: list[torch.Tensor] = []  # parameters as views of flat_param
        self.local_views: list[torch.Tensor] = []  # parameters as their piece (stage 3)
        self.flat_grad: torch.Tensor | None = None  # stage 1: full gradient buffer
        self.grad_shard: torch.Tensor = torch.empty(0)  # this rank's averaged gradient
        self.ready = 0  # parameters whose gradient arrived in this backward
        self.used = [False] * len(params)  # got a gradient on this rank this step
        self.gathered = True

    @property
    def params(self) -> list[nn.Parameter]:
        return self.layout.params

    @property
    def label(self) -> str:
        """``"unit 2 (experts.1.weight, experts.1.bias)"``: for error messages."""
        names = self.layout.names
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"unit {self.index} ({shown})"

    def make_pieces(self) -> None:
        """Cut the shard into one piece per parameter it overlaps (views, no copy)."""
        self.pieces, self.local_views = [], []
        for i, (shape, off) in enumerate(zip(self.layout.shapes, self.layout.offsets)):
            lo, hi = max(self.lo, off), min(self.hi, off + shape.numel())
            if lo < hi:
                piece = nn.Parameter(self.shard[lo - self.lo:hi - self.lo])
                self.pieces.append(Piece(i, piece, lo - self.lo, hi - self.lo))
                self.local_views.append(piece.detach())
            else:
                self.local_views.append(self.shard[:0])
        self.full_views = self.layout.views(self.flat_param)

    def point_at_full(self) -> None:
        """Module parameters read the full buffer (it must be gathered)."""
        for p, v in zip(self.params, self.full_views):
            p.data = v

    def point_at_shard(self) -> None:
        """Module parameters read this rank's pieces: real memory, safe to print."""
        for p, v in zip(self.params, self.local_views):
            p.data = v


def free_flat(unit: Unit) -> None:
    """Release the storage of a unit's full buffer; its views keep their shapes."""
    unit.flat_param.untyped_storage().resize_(0)
    unit.gathered = False
