"""Seeded initialisation of a model that was built on the ``meta`` device and then
sharded: every rank writes only its own piece, yet the values are those of the model
built whole from the same seed.

A sharded start-up (torchtitan's) builds the model on ``meta`` (shapes, no memory),
applies tensor parallelism and FSDP2 there, allocates each rank's shards with
``model.to_empty(device=...)`` and only then initialises. The values must not depend
on the sharding: :func:`replay_init` draws each parameter's *full* values on the CPU,
one module at a time, with the generator calls the whole-model build makes and in the
same order, and keeps this rank's piece of each (:func:`write_full`). At any moment a
rank holds its shards plus one module's full parameters.

Taught in: Chapter 10, "Refuse what cannot fit".
"""

from __future__ import annotations

import copy
import inspect
from typing import Callable, Iterable

import torch
import torch.nn as nn

__all__ = ["write_full", "replay_init", "storage_bytes"]

#: A module's full values -> the layout its (sharded) parameter stores them in,
#: kept as ``module.init_layout`` (e.g. tensor parallelism's interleaved qkv rows).
Layout = Callable[[torch.Tensor], torch.Tensor]


def _local_kwargs() -> dict[str, object]:
    """``distribute_tensor(..., src_data_rank=None)``: every rank slices its own piece
    of the full tensor it holds, no communication (torch >= 2.7; before, rank 0's
    tensor is scattered, which gives the same pieces)."""
    from torch.distributed.tensor import distribute_tensor

    params = inspect.signature(distribute_tensor).parameters
    return {"src_data_rank": None} if "src_data_rank" in params else {}


def write_full(param: torch.Tensor, full: torch.Tensor,
               layout: Layout | None = None) -> None:
    """Write the full values ``full`` into ``param``: all of them into a plain tensor,
    this rank's piece into a DTensor (FSDP2's shard, a tensor-parallel split, both).

    Args:
        param: the model's parameter or buffer (on its device, possibly a DTensor).
        full: the full-size values (any device).
        layout: applied to ``full`` first (see :data:`Layout`).

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if layout is not None:
            full = layout(full)
        if isinstance(param, DTensor):
            piece = distribute_tensor(full.to(param.device), param.device_mesh,
                                      param.placements, **_local_kwargs())
            param.to_local().copy_(piece.to_local())
        else:
            param.copy_(full)


def replay_init(model: nn.Module, recipe: nn.Module,
                phases: Iterable[Callable[[nn.Module], bool]],
                probe: Callable[[nn.Module], None] | None = None) -> None:
    """Initialise ``model`` from the current generator as building ``recipe`` did.

    ``recipe`` is the unsharded model on ``meta`` (its module order is the order of
    the whole-model build's generator calls). For each phase, for each module of
    ``recipe`` that owns parameters, in order: a CPU twin of that module alone is
    made, ``phase(twin)`` initialises it (returning whether it wrote its values), and
    its parameters are written into ``model``'s parameters of the same names. The
    twin draws exactly what the module drew in the whole build (the same shapes,
    calls and order), so the generator's stream, hence every value, is the same.

    Args:
        model: the model to initialise, on its devices (``to_empty``), possibly
            sharded; its parameter names are ``recipe``'s.
        recipe: the same model's unsharded meta-device build.
        phases: each ``phase(module) -> bool``, e.g. the constructor's
            ``reset_parameters`` then a model-wide re-initialisation.
        probe: called with each twin once its values are written.

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    owners = [(name, m) for name, m in recipe.named_modules()
              if any(True for _ in m.parameters(recurse=False))]
    for phase in phases:
        for name, module in owners:
            twin = _cpu_twin(module)
            if not phase(twin):
                continue
            target = model.get_submodule(name)
            for pname, value in twin.named_parameters(recurse=False):
                write_full(getattr(target, pname), value,
                           getattr(target, "init_layout", None))
            if probe is not None:
                probe(twin)
            del twin  # one module's full values at a time


def _cpu_twin(module: nn.Module) -> nn.Module:
    """``module`` alone, its own parameters fresh full-size CPU tensors (a shallow
    copy: its attributes, children and buffers are shared, not copied)."""
    twin = copy.copy(module)
    twin._parameters = {
        name: None if p is None else nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="cpu"),
            requires_grad=p.requires_grad)
        for name, p in module._parameters.items()}
    return twin


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local
    piece's; meta tensors: none): what a rank really holds for them.

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    from torch.distributed.tensor import DTensor

    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        seen[(str(local.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())
