"""Chapter 11's layouts, each a list of parts applied in order.

``parallelism(layout, ...)`` is the package's one factory. Each layout is a
:class:`~dtlib.parallel_nd.parts.Composed` of one part per dimension (the rank grid
or device mesh gives each part its group): how the model is split and wrapped, which
rows of the global batch this rank trains on, and how the full parameters are
gathered back follow from the parts:

- ``"tp_dp"``: [our Megatron layers on the grid's tp group, our DataParallel on its
  dp group];
- ``"fsdp_tp"``: [torch's DTensor TP on ``mesh["tp"]``, FSDP2 on ``mesh["dp"]``];
  the capstone's ``--tp``;
- ``"hsdp"``: [FSDP2 on a ("replicate", "shard") mesh]; every rank its own rows;
- ``"pp_dp"``: [our Megatron layers on the tp group if the grid has one, our
  pipeline (Chapter 6) on the pp group, each stage's gradients averaged over the dp
  group] (three dimensions with tp);
- ``"fsdp_pp"``: [torch's schedule on ``mesh["pp"]``, FSDP2 on ``mesh["dp"]`` for
  each stage], as torchtitan composes them.

Taught in: Chapter 11, "Two dimensions, ours and torch's".
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dtlib.parallel_nd.grid import GridGroups
from dtlib.parallel_nd.parts import (AverageAfterBackward, Composed, DataPart, Fsdp2,
                                     OurDataParallel, OurTensorParallel, Part,
                                     Pipeline, TorchTensorParallel)

__all__ = ["LAYOUTS", "parallelism", "layout_parts"]

LAYOUTS = ("tp_dp", "fsdp_tp", "hsdp", "pp_dp", "fsdp_pp")


def _grid(grid: Any, need: tuple[str, ...], allowed: tuple[str, ...]) -> GridGroups:
    names = getattr(grid, "names", None)
    if not isinstance(grid, GridGroups) or not set(need) <= set(names) \
            or not set(names) <= set(allowed):
        raise ValueError(f"grid must be a GridGroups with dims {need} (allowed "
                         f"{allowed}), not {names!r}")
    return grid


def _mesh(mesh: Any, names: tuple[str, ...]) -> Any:
    got = getattr(mesh, "mesh_dim_names", None)
    if got is None or tuple(got) != names:
        raise ValueError(f"mesh must be a 2-D DeviceMesh with mesh_dim_names "
                         f"{names}, not {got!r}")
    return mesh


def _size(grid: GridGroups, name: str) -> int:
    return grid.sizes[grid.names.index(name)]


def layout_parts(layout: str, *, mesh: Any = None, grid: Any = None,
                 mp_policy: Any = None, schedule: str = "1f1b", n_micro: int = 1
                 ) -> list[Part]:
    """The parts of one layout, in the order they apply (see :func:`parallelism`
    for the arguments)."""
    if layout == "tp_dp":
        grid = _grid(grid, ("dp", "tp"), ("dp", "tp"))
        dp = _size(grid, "dp")
        return [OurTensorParallel(grid.groups["tp"], _size(grid, "tp")),
                OurDataParallel(grid.groups["dp"], grid.coords["dp"], dp, f"dp{dp}")]
    if layout == "pp_dp":
        grid = _grid(grid, ("dp", "pp"), ("dp", "pp", "tp"))
        dp = _size(grid, "dp")
        tp = [OurTensorParallel(grid.groups["tp"], _size(grid, "tp"))] \
            if "tp" in grid.names else []
        return tp + [Pipeline(grid.groups["pp"], _size(grid, "pp"), schedule,
                              n_micro),
                     AverageAfterBackward(grid.groups["dp"], grid.coords["dp"], dp,
                                          f"dp{dp}")]
    if layout in ("fsdp_tp", "hsdp", "fsdp_pp") and mesh is None:
        raise ValueError(f"layout={layout!r} needs mesh= (a 2-D DeviceMesh)")
    if layout == "fsdp_tp":
        mesh = _mesh(mesh, ("dp", "tp"))
        dp = mesh["dp"]
        return [TorchTensorParallel(mesh["tp"]),
                Fsdp2(dp, dp.get_local_rank(), dp.size(), f"fsdp{dp.size()}",
                      mp_policy)]
    if layout == "hsdp":
        mesh = _mesh(mesh, ("replicate", "shard"))
        label = f"hsdp{mesh['replicate'].size()}x{mesh['shard'].size()}"
        # every rank is a data-parallel rank: its own rows
        return [Fsdp2(mesh, dist.get_rank(), mesh.size(), label, mp_policy)]
    if layout == "fsdp_pp":
        mesh = _mesh(mesh, ("dp", "pp"))
        dp, pp = mesh["dp"], mesh["pp"]
        return [Pipeline(pp.get_group(), pp.size(), schedule, n_micro, "torch"),
                Fsdp2(dp, dp.get_local_rank(), dp.size(), f"fsdp{dp.size()}",
                      mp_policy)]
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")


def parallelism(layout: str, *, mesh: Any = None, grid: Any = None,
                mp_policy: Any = None, schedule: str = "1f1b", n_micro: int = 1
                ) -> Composed:
    """The :class:`~dtlib.models.run.Parallelism` of one Chapter 11 layout.

    Args:
        layout: one of :data:`LAYOUTS`: ``"tp_dp"``, ``"pp_dp"`` (ours, on ``grid``),
            ``"fsdp_tp"``, ``"hsdp"``, ``"fsdp_pp"`` (torch's, on ``mesh``).
        mesh: a 2-D ``DeviceMesh``
            (``init_device_mesh(world().device.type, sizes, mesh_dim_names=...)``)
            with dims ``("dp", "tp")`` (fsdp_tp), ``("replicate", "shard")`` (hsdp)
            or ``("dp", "pp")`` (fsdp_pp).
        grid: a :class:`~dtlib.parallel_nd.grid.GridGroups` with dims ``("dp",
            "tp")`` (tp_dp), ``("dp", "pp")`` or ``("dp", "pp", "tp")`` (pp_dp).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` or None (fp32); the FSDP2
            layouts only.
        schedule, n_micro: the pipeline layouts' schedule (``"gpipe"``, ``"1f1b"``)
            and micro-batches per step (dividing each replica's rows).
    Returns:
        The Parallelism; ``dp_group``/``dp_size`` are the data-parallel dimension,
        ``local_batch`` cuts this dp rank's rows, ``full_state`` gathers every
        parameter (every stage's, every shard) to full size on every rank.

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    parts = layout_parts(layout, mesh=mesh, grid=grid, mp_policy=mp_policy,
                         schedule=schedule, n_micro=n_micro)
    # the data dimension first in the name, as the grid and mesh list their dims
    order = sorted(parts, key=lambda p: not isinstance(p, DataPart))
    return Composed(parts, name="x".join(p.label for p in order))
