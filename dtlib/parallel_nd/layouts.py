"""Chapter 11's layouts as one :class:`~dtlib.models.run.Parallelism` each.

``parallelism(layout, ...)`` is the package's one factory: the rank grid or device
mesh, how the model is split and wrapped, which rows of the global batch this rank
trains on, and how the full parameters are gathered back, for each layout:

- ``"fsdp_tp"``: torch's DTensor TP on ``mesh["tp"]``, FSDP2 on ``mesh["dp"]``
  (:func:`~dtlib.parallel_nd.compose.fsdp_tp`); the capstone's ``--tp``.

Taught in: Chapter 11, "Two dimensions, ours and torch's".
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.models.run import Batch, Parallelism, full_tensor, unwrap
from dtlib.parallel_nd.compose import data_shard, fsdp_tp
from dtlib.tensor_parallel.gpt import full_tensors

__all__ = ["LAYOUTS", "parallelism", "FsdpTp", "clip_grad_norm_nd"]

LAYOUTS = ("fsdp_tp",)


def clip_grad_norm_nd(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which fails
    when they are DTensors on different meshes: under FSDP2 x TP the blocks' weights
    live on the 2-D (dp, tp) mesh, the embeddings and head on ``mesh["dp"]`` alone.
    Here each parameter's norm is made full (replicated) first: one small collective
    per parameter, on its own mesh; then the global norm is taken over plain tensors.

    Args:
        params: every parameter of the model (those without a gradient are skipped).
        max_norm: the largest allowed global norm (> 0).
    Returns:
        The total norm before clipping (a plain scalar tensor).

    Taught in: Chapter 11, "Two dimensions, ours and torch's" (the capstone's
    ``--grad-clip`` with ``--tp``).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0")
    grads = [p.grad for p in params if p.grad is not None]
    norms = [full_tensor(torch.linalg.vector_norm(g)) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def _rows(batch: Batch, index: int, parts: int) -> Batch:
    return tuple(data_shard(t, index, parts) for t in batch)


class FsdpTp(Parallelism):
    """FSDP2 across ``mesh["dp"]`` over DTensor tensor parallelism on ``mesh["tp"]``.

    The tp ranks of one dp row train on the same rows (this dp rank's) and hold the
    same loss; gradients are reduce-scattered over ``mesh["dp"]`` by FSDP2.
    """

    def __init__(self, mesh: Any, mp_policy: Any = None) -> None:
        names = getattr(mesh, "mesh_dim_names", None)
        if names is None or tuple(names) != ("dp", "tp"):
            raise ValueError(f"mesh must be a 2-D DeviceMesh with mesh_dim_names "
                             f"('dp', 'tp'), not {names!r}")
        self.mesh, self.mp_policy = mesh, mp_policy
        self.dp_group = mesh["dp"].get_group()
        self.dp_size = mesh["dp"].size()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.name = f"fsdp{self.dp_size}xtp{mesh['tp'].size()}"

    def apply(self, model: nn.Module) -> nn.Module:
        return fsdp_tp(model, self.mesh, mp_policy=self.mp_policy)

    def local_batch(self, batch: Batch) -> Batch:
        return _rows(batch, self.dp_rank, self.dp_size)

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        return full_tensors(unwrap(wrapped), grads=grads)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        setter = getattr(wrapped, "set_requires_gradient_sync", None)
        if setter is None:  # pragma: no cover - not an FSDP2 module
            return contextlib.nullcontext()
        setter(on)
        return contextlib.nullcontext()

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_nd(list(wrapped.parameters()), max_norm)

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        mean = full_tensor(loss).detach().float().clone()
        if self.dp_size > 1:
            dist.all_reduce(mean, group=self.dp_group)  # tp ranks agree: dp only
        return mean / self.dp_size


def parallelism(layout: str, *, mesh: Any = None, mp_policy: Any = None
                ) -> Parallelism:
    """The :class:`~dtlib.models.run.Parallelism` of one Chapter 11 layout.

    Args:
        layout: one of :data:`LAYOUTS`: ``"fsdp_tp"`` (torch's DTensor TP on
            ``mesh["tp"]`` inside FSDP2 on ``mesh["dp"]``).
        mesh: ``"fsdp_tp"``: a 2-D ``DeviceMesh`` with ``mesh_dim_names=("dp",
            "tp")`` (``init_device_mesh(world().device.type, (dp, tp), ...)``).
        mp_policy: ``"fsdp_tp"``: FSDP2's ``MixedPrecisionPolicy`` or None (fp32).
    Returns:
        The Parallelism; ``dp_group``/``dp_size`` are the data-parallel dimension,
        ``local_batch`` cuts this dp rank's rows, ``full_state`` gathers.

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    if layout == "fsdp_tp":
        if mesh is None:
            raise ValueError("layout='fsdp_tp' needs mesh= (a ('dp', 'tp') DeviceMesh)")
        return FsdpTp(mesh, mp_policy)
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
