"""Two kinds of parallelism at once: ours on hand-built groups, torch's on a mesh.

- :func:`tp_inside_dp`: our Megatron layers (Chapter 5) split each block across the
  tp group; our DataParallel (Chapter 3) averages gradients across the dp group.
  A gradient is all-reduced only with the ranks holding the same shard: the dp
  group of this tp coordinate.
- :func:`fsdp_tp`: torch's ``parallelize_module`` on ``mesh["tp"]`` (DTensor), then
  FSDP2's ``fully_shard(mesh=mesh["dp"])``: parameters become DTensors on the 2-D
  mesh, sharded on dim 0 across dp and split across tp.
- :func:`hsdp`: FSDP2 on a 2-D mesh ("replicate", "shard"): shard within a group,
  all-reduce the gradient shards across the replicas (ZeRO-3 inside, DDP across).

Taught in: Chapter 11, "Two dimensions, ours and torch's".
"""

from __future__ import annotations

from typing import Any

import torch

from dtlib.data_parallel.ddp import DataParallel
from dtlib.models.gpt import GPT
from dtlib.parallel_nd.grid import GridGroups
from dtlib.tensor_parallel.gpt import dtensor_parallelize, tensor_parallelize
from dtlib.zero.fsdp import fully_shard


def tp_inside_dp(model: GPT, grid: GridGroups) -> DataParallel:
    """Tensor parallel inside each replica, data parallel across replicas (ours).

    Args:
        model: a full GPT, built identically on every rank.
        grid: from :func:`~dtlib.parallel_nd.grid.build_grid_groups` with dims
            ``("dp", "tp")``.
    Returns:
        A :class:`~dtlib.data_parallel.ddp.DataParallel` over the dp group wrapping
        the tensor-parallel model (``.module``).

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    if set(grid.groups) != {"dp", "tp"}:
        raise ValueError(f"grid dims {grid.names} must be ('dp', 'tp')")
    tensor_parallelize(model, grid.groups["tp"])
    return DataParallel(model, mode="bucketed", group=grid.groups["dp"])


def fsdp_tp(model: GPT, mesh: Any) -> GPT:
    """FSDP2 across ``mesh["dp"]`` over DTensor tensor parallelism on ``mesh["tp"]``.

    Args:
        model: a full GPT, identical on every rank.
        mesh: a 2-D ``DeviceMesh`` with ``mesh_dim_names=("dp", "tp")``.
    Returns:
        ``model``, sharded in place (each block its own FSDP unit, then the root).

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    dtensor_parallelize(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def hsdp(model: GPT, mesh: Any) -> GPT:
    """Hybrid sharded data parallel: FSDP2 on a ("replicate", "shard") mesh.

    Args:
        model: a full GPT, identical on every rank.
        mesh: a 2-D ``DeviceMesh``; dim 0 replicates, dim 1 shards.
    Returns:
        ``model``, sharded in place.

    Taught in: Chapter 11, "HSDP: shard inside, replicate across".
    """
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data_shard(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Rows ``[index * n/parts, (index + 1) * n/parts)`` of ``x`` (n = len(x)).

    Equal shards, so the mean of the per-shard mean losses is the global mean.

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    if x.shape[0] % parts or not 0 <= index < parts:
        raise ValueError(f"batch {x.shape[0]} must split into parts={parts} "
                         f"and index={index} be in [0, {parts})")
    n = x.shape[0] // parts
    return x[index * n:(index + 1) * n]
