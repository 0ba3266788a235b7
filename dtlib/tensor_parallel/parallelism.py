"""Tensor parallelism as a :class:`~dtlib.models.run.Parallelism`: the one loop's view.

What the loop asks, and what tensor parallelism answers:

- ``apply``: split the model (the GPT: :func:`tensor_parallelize` or
  :func:`dtensor_parallelize`; a Hugging Face Llama: the same plans in
  :mod:`~dtlib.tensor_parallel.hf_llama`);
- ``local_batch``: the whole batch (tensor parallelism splits the model, not the
  data);
- ``full_state``: :func:`full_tensors` (slices gathered, DTensors made full, qkv
  rows back in ``[q | k | v]`` order);
- ``grad_sync``: nothing to switch off: f's all-reduce *is* part of backward, and
  every rank's gradients are already those of the whole batch (``dp_size == 1``).

Taught in: Chapter 5, "Equal to one process".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from dtlib.models.run import Parallelism, unwrap
from dtlib.runtime import dist as ddist
from dtlib.tensor_parallel.gpt import (dtensor_parallelize, full_tensors,
                                       tensor_parallelize)
from dtlib.tensor_parallel.hf_llama import (dtensor_parallelize_llama,
                                            tensor_parallelize_llama)

__all__ = ["VARIANTS", "TensorParallel", "parallelism"]

#: "ours": the book's f, g and column/row layers; "dtensor": torch's DTensor plan.
VARIANTS = ("ours", "dtensor")


def _mesh_of(group: Any) -> Any:
    """A 1-D DeviceMesh over ``group``'s ranks (torch >= 2.4's ``from_group``)."""
    from torch.distributed.device_mesh import DeviceMesh

    from_group = getattr(DeviceMesh, "from_group", None)
    if from_group is None:
        raise ValueError("group= with variant='dtensor' needs DeviceMesh.from_group "
                         "(torch >= 2.4); pass mesh= instead")
    return from_group(group, ddist.world().device.type)


class TensorParallel(Parallelism):
    """Megatron tensor parallelism over one group, ours or DTensor's.

    Args:
        variant: ``"ours"`` or ``"dtensor"``.
        group: the tensor-parallel process group (None: all ranks).
        mesh: a 1-D ``DeviceMesh`` for ``"dtensor"`` (None: built from ``group``,
            or over all ranks).

    Taught in: Chapter 5, "Equal to one process".
    """

    def __init__(self, variant: str = "ours", *, group: Any = None,
                 mesh: Any = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} is not allowed; allowed: "
                             f"{VARIANTS}")
        if variant == "ours" and mesh is not None:
            raise ValueError("mesh= is for variant='dtensor'; variant='ours' takes "
                             "group=")
        self.variant, self.group, self.mesh = variant, group, mesh
        self.name = f"tp/{variant}"

    def apply(self, model: nn.Module) -> nn.Module:
        """Split ``model`` in place (a ``dtlib.models.GPT`` or an HF Llama)."""
        llama = hasattr(model, "get_decoder")
        if self.variant == "ours":
            split = tensor_parallelize_llama if llama else tensor_parallelize
            return split(model, self.group)
        if self.mesh is None and self.group is not None:
            self.mesh = _mesh_of(self.group)
        split = dtensor_parallelize_llama if llama else dtensor_parallelize
        return split(model, self.mesh)

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        """Full parameters (or gradients) by name: :func:`full_tensors`."""
        return full_tensors(unwrap(wrapped), group=self.group, grads=grads)


def parallelism(variant: str = "ours", *, group: Any = None,
                mesh: Any = None) -> TensorParallel:
    """Tensor parallelism for :func:`~dtlib.models.run.run_steps`.

    Args:
        variant: ``"ours"`` (:func:`tensor_parallelize`: the book's f and g) or
            ``"dtensor"`` (:func:`dtensor_parallelize`: torch's plan).
        group: the tensor-parallel process group (None: all ranks).
        mesh: a 1-D ``DeviceMesh`` (``"dtensor"`` only).
    Returns:
        A :class:`TensorParallel`.

    Taught in: Chapter 5, "Equal to one process".
    """
    return TensorParallel(variant, group=group, mesh=mesh)
