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
- :func:`pipeline_stage_of` and :func:`average_across_replicas`: pipeline inside,
  data parallel across (ours): each rank runs its stage with Chapter 6's schedule on
  its pp group, then averages its stage's gradients with the same stage of the
  other replicas (its dp group).
- :func:`fsdp_pipeline_stage`: torch's pairing (as torchtitan composes them): the
  stage sharded by ``fully_shard(mesh=mesh["dp"])``, wrapped in a ``PipelineStage``
  on ``mesh["pp"]``; the schedule reduce-scatters gradients after the last
  micro-batch.

Taught in: Chapter 11, "Two dimensions, ours and torch's".
"""

from __future__ import annotations

from typing import Any

import torch

from dtlib.data_parallel.buckets import allreduce_grads
from dtlib.data_parallel.ddp import DataParallel
from dtlib.models.gpt import GPT
from dtlib.parallel_nd.grid import GridGroups
from dtlib.pipeline_parallel.split import GPTStage, split_gpt
from dtlib.tensor_parallel.gpt import dtensor_parallelize, tensor_parallelize
from dtlib.zero.fsdp import fully_shard, shard_fsdp2


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
    return DataParallel(model, variant="bucketed", group=grid.groups["dp"])


def pipeline_stage_of(model: GPT, grid: GridGroups) -> GPTStage:
    """This rank's pipeline stage: the model cut into ``pp`` balanced stages, the
    one at this rank's pp coordinate (Chapter 6's :func:`split_gpt`).

    Args:
        model: a full GPT, built identically on every rank.
        grid: a grid with a "pp" dimension (and usually "dp").
    Returns:
        The :class:`~dtlib.pipeline_parallel.split.GPTStage`; run it with
        ``pipeline_step(..., group=grid.groups["pp"])``.

    Taught in: Chapter 11, "Pipeline inside, data parallel across".
    """
    if "pp" not in grid.groups:
        raise ValueError(f"grid dims {grid.names} must include 'pp'")
    pp = grid.sizes[grid.names.index("pp")]
    return split_gpt(model, pp)[grid.coords["pp"]]


def average_across_replicas(stage: torch.nn.Module, grid: GridGroups) -> int:
    """Average this stage's gradients over the dp group: the same stage of every
    replica (Chapter 3's naive all-reduce, one call per tensor).

    Returns:
        The number of all-reduce calls.

    Taught in: Chapter 11, "Pipeline inside, data parallel across".
    """
    return allreduce_grads(list(stage.parameters()), group=grid.groups["dp"])


def fsdp_pipeline_stage(model: GPT, mesh: Any) -> tuple[GPTStage, Any]:
    """This rank's pipeline stage, FSDP2-sharded across dp, as a ``PipelineStage``.

    Args:
        model: a full GPT (untied), identical on every rank.
        mesh: a 2-D ``DeviceMesh`` with ``mesh_dim_names=("dp", "pp")``.
    Returns:
        ``(stage, pipeline_stage)``: the sharded :class:`GPTStage` (for the
        optimizer) and the ``torch.distributed.pipelining.PipelineStage`` for a
        schedule such as ``Schedule1F1B``.

    Taught in: Chapter 11, "Pipeline inside, data parallel across".
    """
    from torch.distributed.pipelining import PipelineStage

    pp, index = mesh["pp"].size(), mesh["pp"].get_local_rank()
    stage = split_gpt(model, pp)[index]
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    device = next(stage.parameters()).device
    return stage, PipelineStage(stage, index, pp, device,
                                group=mesh["pp"].get_group())


def fsdp_tp(model: GPT, mesh: Any, mp_policy: Any = None) -> GPT:
    """FSDP2 across ``mesh["dp"]`` over DTensor tensor parallelism on ``mesh["tp"]``.

    Args:
        model: a full GPT, identical on every rank.
        mesh: a 2-D ``DeviceMesh`` with ``mesh_dim_names=("dp", "tp")``.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (e.g. ``bf16_policy()``) or
            None (fp32 everywhere).
    Returns:
        ``model``, sharded in place (each block its own FSDP unit, then the root).

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    dtensor_parallelize(model, mesh["tp"])
    return shard_fsdp2(model, list(model.blocks), mp_policy=mp_policy,
                       mesh=mesh["dp"])


def hsdp(model: GPT, mesh: Any, mp_policy: Any = None) -> GPT:
    """Hybrid sharded data parallel: FSDP2 on a ("replicate", "shard") mesh.

    Args:
        model: a full GPT, identical on every rank.
        mesh: a 2-D ``DeviceMesh``; dim 0 replicates, dim 1 shards.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` or None (fp32).
    Returns:
        ``model``, sharded in place.

    Taught in: Chapter 11, "HSDP: shard inside, replicate across".
    """
    return shard_fsdp2(model, list(model.blocks), mp_policy=mp_policy, mesh=mesh)
