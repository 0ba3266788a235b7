"""Chapter 11's layouts as one :class:`~dtlib.models.run.Parallelism` each.

``parallelism(layout, ...)`` is the package's one factory: the rank grid or device
mesh, how the model is split and wrapped, which rows of the global batch this rank
trains on, and how the full parameters are gathered back, for each layout:

- ``"tp_dp"``: our Megatron layers on the grid's tp groups inside our DataParallel on
  its dp groups (:func:`~dtlib.parallel_nd.compose.tp_inside_dp`);
- ``"fsdp_tp"``: torch's DTensor TP on ``mesh["tp"]``, FSDP2 on ``mesh["dp"]``
  (:func:`~dtlib.parallel_nd.compose.fsdp_tp`); the capstone's ``--tp``;
- ``"hsdp"``: FSDP2 on a ("replicate", "shard") mesh; every rank its own rows;
- ``"pp_dp"``: our pipeline (Chapter 6) on the grid's pp groups, each stage's
  gradients averaged over its dp group; with a "tp" dimension in the grid, our
  Megatron layers inside each stage (three dimensions);
- ``"fsdp_pp"``: torch's schedule over FSDP2-sharded stages on a ("dp", "pp") mesh.

Taught in: Chapter 11, "Two dimensions, ours and torch's".
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.data_parallel.parallelism import rows_of_rank
from dtlib.models.gpt import GPT
from dtlib.models.run import Batch, Parallelism, clip_by_global_norm, unwrap
from dtlib.parallel_nd.compose import (average_across_replicas, fsdp_tp,
                                       hsdp, tp_inside_dp)
from dtlib.parallel_nd.grid import GridGroups
from dtlib.pipeline_parallel.parallelism import PipelineParallel
from dtlib.tensor_parallel.gpt import full_tensors, tensor_parallelize
from dtlib.zero.fsdp import fully_shard, gradient_sync

__all__ = ["LAYOUTS", "parallelism", "TpDp", "FsdpTp", "Hsdp", "PpDp", "FsdpPp"]

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


class TpDp(Parallelism):
    """Our TP inside our DataParallel on a hand-built ("dp", "tp") grid."""

    def __init__(self, grid: GridGroups) -> None:
        self.grid = _grid(grid, ("dp", "tp"), ("dp", "tp"))
        self.dp_group, self.tp_group = grid.groups["dp"], grid.groups["tp"]
        self.dp_size = grid.sizes[grid.names.index("dp")]
        self.name = f"dp{self.dp_size}xtp{grid.sizes[grid.names.index('tp')]}"

    def apply(self, model: nn.Module) -> nn.Module:
        return tp_inside_dp(model, self.grid)

    def local_batch(self, batch: Batch) -> Batch:
        return rows_of_rank(batch, self.grid.coords["dp"], self.dp_size)

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        return full_tensors(unwrap(wrapped), group=self.tp_group, grads=grads)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return contextlib.nullcontext() if on else wrapped.no_sync()



class FsdpTp(Parallelism):
    """FSDP2 across ``mesh["dp"]`` over DTensor tensor parallelism on ``mesh["tp"]``.

    The tp ranks of one dp row train on the same rows (this dp rank's) and hold the
    same loss; gradients are reduce-scattered over ``mesh["dp"]`` by FSDP2.
    """

    def __init__(self, mesh: Any, mp_policy: Any = None) -> None:
        self.mesh, self.mp_policy = _mesh(mesh, ("dp", "tp")), mp_policy
        self.dp_group = mesh["dp"].get_group()
        self.dp_size = mesh["dp"].size()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.name = f"fsdp{self.dp_size}xtp{mesh['tp'].size()}"

    def apply(self, model: nn.Module) -> nn.Module:
        return fsdp_tp(model, self.mesh, mp_policy=self.mp_policy)

    def local_batch(self, batch: Batch) -> Batch:
        return rows_of_rank(batch, self.dp_rank, self.dp_size)

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        return full_tensors(unwrap(wrapped), grads=grads)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return gradient_sync(wrapped, on)

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_by_global_norm(list(wrapped.parameters()), max_norm)



class Hsdp(Parallelism):
    """FSDP2 on a ("replicate", "shard") mesh: every rank trains on its own rows."""

    def __init__(self, mesh: Any, mp_policy: Any = None) -> None:
        self.mesh, self.mp_policy = _mesh(mesh, ("replicate", "shard")), mp_policy
        self.dp_size = mesh.size()  # every rank is a data-parallel rank
        self.rank = dist.get_rank()
        self.name = f"hsdp{mesh['replicate'].size()}x{mesh['shard'].size()}"

    def apply(self, model: nn.Module) -> nn.Module:
        return hsdp(model, self.mesh, mp_policy=self.mp_policy)

    def local_batch(self, batch: Batch) -> Batch:
        return rows_of_rank(batch, self.rank, self.dp_size)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return gradient_sync(wrapped, on)

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_by_global_norm(list(wrapped.parameters()), max_norm)



class PpDp(PipelineParallel):
    """Our pipeline inside our data parallel, on a hand-built grid ("dp", "pp") or
    ("dp", "pp", "tp"): Megatron layers inside each stage when there is a tp
    dimension; after the schedule each stage's gradients are averaged over its dp
    group (skipped inside ``grad_sync(on=False)``: gradient accumulation)."""

    def __init__(self, grid: GridGroups, schedule: str, n_micro: int) -> None:
        self.grid = _grid(grid, ("dp", "pp"), ("dp", "pp", "tp"))
        super().__init__(schedule, n_micro, group=grid.groups["pp"])
        self.dp_group = grid.groups["dp"]
        self.dp_size = grid.sizes[grid.names.index("dp")]
        self.tp_group = grid.groups.get("tp")
        self.name = "x".join(f"{n}{s}" for n, s in zip(grid.names, grid.sizes))
        self.sync = True

    def prepare(self, model: GPT) -> GPT:
        if self.tp_group is not None:
            tensor_parallelize(model, self.tp_group)
        return model

    def stage_state(self, stage: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        if self.tp_group is None:
            return super().stage_state(stage, grads)
        # a stage names its tensors as the model does; its tp peers hold the same
        # stage, so they gather the same slices in the same order
        return full_tensors(stage, group=self.tp_group, grads=grads)

    def local_batch(self, batch: Batch) -> Batch:
        return rows_of_rank(batch, self.grid.coords["dp"], self.dp_size)

    @contextlib.contextmanager
    def grad_sync(self, wrapped: nn.Module, on: bool) -> Iterator[None]:
        before, self.sync = self.sync, on
        try:
            yield
        finally:
            self.sync = before

    def forward_backward(self, wrapped: nn.Module, batch: Batch, loss_fn: Any,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        loss = super().forward_backward(wrapped, batch, loss_fn, scale, scaler)
        if self.sync and self.dp_size > 1:
            average_across_replicas(wrapped, self.grid)
        return loss

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        if self.tp_group is not None:
            raise ValueError("max_grad_norm: clipping is not implemented for "
                             "layout='pp_dp' with a tp dimension (the norm of a "
                             "split layer needs its tp group)")
        return super().clip_grad_norm(wrapped, max_norm)



class FsdpPp(PipelineParallel):
    """torch's schedule over FSDP2-sharded stages: each stage ``fully_shard``-ed on
    ``mesh["dp"]`` and wrapped in a ``PipelineStage`` on ``mesh["pp"]`` (as
    torchtitan composes them); FSDP2 reduce-scatters the stage's gradients after
    the last micro-batch."""

    def __init__(self, mesh: Any, schedule: str, n_micro: int,
                 mp_policy: Any = None) -> None:
        self.mesh, self.mp_policy = _mesh(mesh, ("dp", "pp")), mp_policy
        super().__init__(schedule, n_micro, variant="torch",
                         group=mesh["pp"].get_group())
        self.dp_group = mesh["dp"].get_group()
        self.dp_size = mesh["dp"].size()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.name = f"fsdp{self.dp_size}xpp{mesh['pp'].size()}"

    def wrap_stage(self, stage: nn.Module) -> nn.Module:
        kwargs = {"mesh": self.mesh["dp"]}
        if self.mp_policy is not None:
            kwargs["mp_policy"] = self.mp_policy
        for block in stage.blocks.values():
            fully_shard(block, **kwargs)
        fully_shard(stage, **kwargs)
        return stage

    def local_batch(self, batch: Batch) -> Batch:
        return rows_of_rank(batch, self.dp_rank, self.dp_size)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return gradient_sync(wrapped, on)



def parallelism(layout: str, *, mesh: Any = None, grid: Any = None,
                mp_policy: Any = None, schedule: str = "1f1b", n_micro: int = 1
                ) -> Parallelism:
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
    if layout == "tp_dp":
        return TpDp(grid)
    if layout == "pp_dp":
        return PpDp(grid, schedule, n_micro)
    if layout in ("fsdp_tp", "hsdp", "fsdp_pp") and mesh is None:
        raise ValueError(f"layout={layout!r} needs mesh= (a 2-D DeviceMesh)")
    if layout == "fsdp_tp":
        return FsdpTp(mesh, mp_policy)
    if layout == "hsdp":
        return Hsdp(mesh, mp_policy)
    if layout == "fsdp_pp":
        return FsdpPp(mesh, schedule, n_micro, mp_policy)
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
