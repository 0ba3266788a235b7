"""A padded flat view of a group of parameters, cut into one equal shard per rank.

ZeRO and FSDP both shard "a flat parameter": the group's tensors laid end to end in one
1-D buffer. The buffer is padded with zeros up to a multiple of the world size, so a
model of any size splits into ``world_size`` equal shards (collectives such as
reduce-scatter and all-gather need equal pieces). Rank ``r`` owns elements
``[r * shard_numel, (r + 1) * shard_numel)``. Padding is at most ``world_size - 1``
elements per group, and stays zero through AdamW (zero gradient, zero weight).

Taught in: Chapter 4, "The three stages", the padded flat view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class FlatLayout:
    """Where each parameter of a group sits in the padded flat buffer.

    params: the group's parameters, in layout order.
    names: their qualified names (for error messages and full state dicts).
    world_size: number of shards.
    shapes: each parameter's shape when the layout was made (stage 3 later points
        the parameters at 1-D pieces; the layout keeps the full shapes).
    offsets: start of each parameter in the flat buffer.
    numel: elements of the group without padding (the group's share of Psi).
    padded_numel: ``numel`` rounded up to a multiple of ``world_size``.
    shard_numel: ``padded_numel // world_size``, the elements each rank owns.
    """

    params: list[nn.Parameter]
    names: list[str]
    world_size: int
    shapes: list[torch.Size] = field(init=False)
    offsets: list[int] = field(init=False)
    numel: int = field(init=False)
    padded_numel: int = field(init=False)
    shard_numel: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be a positive int")
        if len(self.names) != len(self.params):
            raise ValueError(f"names has {len(self.names)} entries for "
                             f"{len(self.params)} params")
        self.shapes = [p.shape for p in self.params]
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.padded_numel = math.ceil(total / self.world_size) * self.world_size
        self.shard_numel = self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        """Zero elements appended so the buffer divides the world."""
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of rank ``rank``'s shard in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} must be in [0, {self.world_size})")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def flatten(self, tensors: list[torch.Tensor | None],
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """Lay ``tensors`` (one per parameter, ``None`` = zeros) in a padded buffer.

        Returns:
            A new 1-D tensor of ``padded_numel`` elements.
        """
        if len(tensors) != len(self.params):
            raise ValueError(f"got {len(tensors)} tensors for "
                             f"{len(self.params)} params")
        ref = self.params[0]
        flat = torch.zeros(self.padded_numel, dtype=dtype or ref.dtype,
                           device=ref.device)
        for t, off, shape in zip(tensors, self.offsets, self.shapes):
            if t is not None:
                flat[off:off + shape.numel()].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter (they share its storage)."""
        if flat.numel() != self.padded_numel:
            raise ValueError(f"flat has {flat.numel()} elements, the layout needs "
                             f"{self.padded_numel}")
        return [flat[off:off + shape.numel()].view(shape)
                for off, shape in zip(self.offsets, self.shapes)]


def assign_units(module: nn.Module, unit_modules: list[nn.Module]
                 ) -> list[tuple[nn.Module, list[str], list[nn.Parameter]]]:
    """Split ``module``'s parameters into units, FSDP-style.

    A parameter belongs to the unit module that alone uses it; parameters used by no
    unit, or shared by several (tied embeddings), go to a root unit for ``module``
    itself, listed first when it has any parameter. Frozen parameters
    (``requires_grad=False``) are in no unit: they are neither sharded nor optimized.

    Args:
        module: the whole model.
        unit_modules: submodules to shard separately (e.g. each transformer block).
    Returns:
        ``[(owner_module, names, params), ...]``, every trainable parameter exactly
        once.

    Taught in: Chapter 4, ZeRO-3 (which parameters to gather together).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    users: dict[int, list[int]] = {}
    for i, m in enumerate(unit_modules):
        for p in m.parameters():
            if id(p) not in names:
                raise ValueError(f"unit_modules[{i}] has a parameter outside module")
            users.setdefault(id(p), []).append(i)
    groups: list[list[nn.Parameter]] = [[] for _ in unit_modules]
    root: list[nn.Parameter] = []
    for _, p in module.named_parameters():
        if not p.requires_grad:
            continue
        owners = users.get(id(p), [])
        (groups[owners[0]] if len(owners) == 1 else root).append(p)
    out = [(module, [names[id(p)] for p in root], root)] if root else []
    out += [(m, [names[id(p)] for p in g], g)
            for m, g in zip(unit_modules, groups) if g]
    return out


def default_unit_modules(module: nn.Module) -> list[nn.Module]:
    """The elements of every outermost ``nn.ModuleList`` (blocks, layers).

    This is the usual FSDP wrapping: one unit per transformer block.
    """
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside:
            continue
        if isinstance(m, nn.ModuleList):
            for child in m:
                found.append(child)
                inside.update(id(d) for d in child.modules())
    return found
