"""One owner of the parallel degrees: :class:`ParallelDims` validates them once and
builds the rank layout from them, a ``DeviceMesh`` (torch's) or a
:class:`~dtlib.parallel_nd.grid.GridGroups` (ours, by hand), in the order the
caller names the dimensions (outermost first).

As torchtitan's ``ParallelDims``: the product of the degrees is the world size, and
every degree above 1 has a dimension in the layout (none is silently dropped).
Chapter 11's layouts, chapter 14's experts and the capstone's ``--tp`` build their
mesh or grid here.

Taught in: Chapter 11, "One owner of the degrees".
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtlib.parallel_nd.grid import GridGroups, build_grid_groups
from dtlib.runtime.dist import world

__all__ = ["ParallelDims", "DIM_NAMES"]

#: A layout's dimension names and the degrees they stand for: ``"dp"`` is every
#: data-parallel rank (replicas x shards), ``"edp"`` the data-parallel ranks beside
#: an expert group (``dp / ep``).
DIM_NAMES = ("dp", "replicate", "shard", "edp", "ep", "cp", "tp", "pp")


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one job; see the module docstring.

    dp_replicate, dp_shard: data-parallel replicas and the shards within each (HSDP);
        their product is the data-parallel degree ``dp``.
    tp, pp, cp: tensor, pipeline and context parallel degrees.
    ep: expert-parallel degree, carved out of the data-parallel ranks (divides
        ``dp``).
    world_size: the ranks the degrees must fill (default: the initialised world).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    world_size: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "world_size" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name}={v!r} must be an integer >= 1")
        if self.world_size is None:
            n = dist.get_world_size() if dist.is_available() and \
                dist.is_initialized() else 1
            object.__setattr__(self, "world_size", n)
        product = self.dp * self.tp * self.pp * self.cp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x "
                f"tp={self.tp} x pp={self.pp} x cp={self.cp} = {product}, not the "
                f"world size {self.world_size}: the degrees must fill the world")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide the data-parallel degree "
                             f"dp={self.dp} (experts are spread over dp ranks)")

    @property
    def dp(self) -> int:
        """The data-parallel degree: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    def size(self, name: str) -> int:
        """The degree a layout's dimension ``name`` (one of :data:`DIM_NAMES`)
        stands for."""
        sizes = {"dp": self.dp, "replicate": self.dp_replicate,
                 "shard": self.dp_shard, "edp": self.dp // self.ep, "ep": self.ep,
                 "cp": self.cp, "tp": self.tp, "pp": self.pp}
        if name not in sizes:
            raise ValueError(f"dimension {name!r} is not one of {DIM_NAMES}")
        return sizes[name]

    def sizes(self, names: tuple[str, ...]) -> tuple[int, ...]:
        """The sizes of a layout with dimensions ``names`` (outermost first),
        checked: they fill the world and leave no degree above 1 out."""
        if len(set(names)) != len(names):
            raise ValueError(f"names={names!r}: each dimension once")
        sizes = tuple(self.size(n) for n in names)
        covered = {"dp_replicate": {"dp", "replicate", "edp"},
                   "dp_shard": {"dp", "shard", "edp"}, "tp": {"tp"}, "pp": {"pp"},
                   "cp": {"cp"}, "ep": {"ep"}}
        for degree, dims in covered.items():
            if getattr(self, degree) > 1 and not dims & set(names):
                raise ValueError(f"names={names!r} leave {degree}="
                                 f"{getattr(self, degree)} out of the layout")
        total = 1
        for s in sizes:
            total *= s
        if total != self.world_size:
            raise ValueError(f"names={names!r} have sizes {sizes} ({total} ranks), "
                             f"not the world size {self.world_size}")
        return sizes

    def mesh(self, names: tuple[str, ...], device_type: str | None = None) -> Any:
        """torch's ``DeviceMesh`` with ``mesh_dim_names=names`` (collective)."""
        return init_device_mesh(device_type or world().device.type, self.sizes(names),
                                mesh_dim_names=names)

    def grid(self, names: tuple[str, ...]) -> GridGroups:
        """Our hand-built :class:`GridGroups` with dimensions ``names``
        (collective: every rank creates every line's group)."""
        return build_grid_groups(names, self.sizes(names))
