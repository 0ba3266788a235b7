"""A rank grid with named dimensions, and one process group per line of it.

The teaching version of a device mesh, as picotron builds it: lay the ranks out as
``torch.arange(world).view(dp, tp)`` (the last dimension varies fastest, so tp
neighbours are adjacent ranks: the same GPU node). A "line" along a dimension fixes
every other coordinate; its ranks form one group of that dimension. For 4 ranks as
2 x 2::

    grid = [[0, 1],      tp groups (rows):    [0, 1], [2, 3]
            [2, 3]]      dp groups (columns): [0, 2], [1, 3]

Every rank must create every group, in the same order (``new_group`` is collective
over the world), and keeps the ones it belongs to.

Taught in: Chapter 11, "A rank grid by hand".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def rank_grid(sizes: tuple[int, ...]) -> torch.Tensor:
    """``torch.arange(prod(sizes)).view(sizes)``: rank of each grid coordinate.

    Args:
        sizes: the size of each dimension, outermost first, e.g. ``(dp, tp)``.
    Returns:
        An integer tensor of shape ``sizes``.

    Taught in: Chapter 11, "A rank grid by hand".
    """
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                        for s in sizes):
        raise ValueError(f"sizes={sizes!r} must be a non-empty tuple of ints >= 1")
    return torch.arange(int(torch.tensor(sizes).prod())).view(*sizes)


def lines_along(grid: torch.Tensor, dim: int) -> list[list[int]]:
    """The groups of dimension ``dim``: each list holds the ranks that differ only
    in their ``dim`` coordinate.

    Args:
        grid: from :func:`rank_grid`.
        dim: which dimension (0 = outermost).
    Returns:
        ``world / grid.shape[dim]`` lists of ``grid.shape[dim]`` ranks, ascending.

    Taught in: Chapter 11, "A rank grid by hand".
    """
    if not -grid.dim() <= dim < grid.dim():
        raise ValueError(f"dim={dim} must index one of the {grid.dim()} dimensions")
    moved = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
    return [row.tolist() for row in moved]


@dataclass
class GridGroups:
    """This rank's place in the grid and its group along each named dimension.

    names: dimension names, outermost first, e.g. ("dp", "tp").
    sizes: their sizes.
    coords: this rank's coordinate along each name.
    groups: name -> the process group of this rank's line along it.
    ranks: name -> the global ranks in that group.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    coords: dict[str, int] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)


def build_grid_groups(names: tuple[str, ...], sizes: tuple[int, ...]) -> GridGroups:
    """Create one process group per line of the grid; keep this rank's.

    Collective: every rank of the default group calls it with the same arguments.

    Args:
        names: a name per dimension, e.g. ``("dp", "tp")``.
        sizes: their sizes; the product must equal the world size.
    Returns:
        A :class:`GridGroups` for this rank.

    Taught in: Chapter 11, "A rank grid by hand".
    """
    if len(names) != len(sizes) or len(set(names)) != len(names):
        raise ValueError(f"names={names!r} must be distinct, one per size in {sizes!r}")
    grid = rank_grid(tuple(sizes))
    world, rank = dist.get_world_size(), dist.get_rank()
    if grid.numel() != world:
        raise ValueError(f"sizes={sizes!r} multiply to {grid.numel()}, "
                         f"not the world size {world}")
    out = GridGroups(tuple(names), tuple(sizes))
    where = (grid == rank).nonzero()[0].tolist()
    for dim, name in enumerate(names):
        out.coords[name] = where[dim]
        for line in lines_along(grid, dim):
            group = dist.new_group(line)  # collective: every rank, every line
            if rank in line:
                out.groups[name], out.ranks[name] = group, line
    return out
