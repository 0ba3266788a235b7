"""A layout is its dimensions, applied in order.

Each dimension of a layout is a :class:`Part`: what it does to the model
(:meth:`Part.apply`) and, where it has one, the role the one loop asks of a
Parallelism:

- a *data* part (:class:`DataPart`) decides which rows of the global batch this rank
  trains on and how gradients are synchronised across its ranks: our DataParallel
  (:class:`OurDataParallel`), FSDP2 (:class:`Fsdp2`), or our average after a
  pipeline's schedule (:class:`AverageAfterBackward`);
- a *tensor* part (:class:`TensorPart`) splits layers and gathers the slices back
  to full size: :class:`OurTensorParallel` (Chapter 5's Megatron layers on a group) or
  :class:`TorchTensorParallel` (DTensor on a mesh dimension);
- a :class:`Pipeline` part cuts the model: the parts before it apply to the whole
  model, the parts after it to this rank's stage, and its schedule runs forward and
  backward.

:class:`Composed` is the one Parallelism built from a list of parts, applied in the
order given, as torchtitan's ``parallelize_*`` applies tensor parallel first and
FSDP2 on what it produced. Chapter 11's layouts are such lists
(:func:`~dtlib.parallel_nd.parallelism.parallelism`); a new combination is a new
list, not a new class.

Taught in: Chapter 11, "Two dimensions, ours and torch's".
"""

from __future__ import annotations

import abc

import contextlib
from typing import Any, ContextManager, Iterator, Sequence

import torch
import torch.nn as nn

from dtlib.data_parallel.buckets import allreduce_grads
from dtlib.data_parallel.ddp import DataParallel
from dtlib.data_parallel.parallelism import rows_of_rank
from dtlib.models.run import (Batch, Parallelism, clip_by_global_norm,
                              tensors_by_name, unwrap)
from dtlib.pipeline_parallel.parallelism import PipelineParallel, StagePlan
from dtlib.tensor_parallel.gpt import (dtensor_parallelize, full_tensors,
                                       tensor_parallelize)
from dtlib.zero.fsdp import gradient_sync, shard_fsdp2

__all__ = ["Part", "DataPart", "TensorPart", "OurTensorParallel",
           "TorchTensorParallel",
           "OurDataParallel", "Fsdp2", "AverageAfterBackward", "Pipeline",
           "Composed"]


class Part:
    """One dimension of a :class:`Composed` layout (identity: changes nothing)."""

    #: How the layout's name shows this dimension ("tp2", "fsdp2", ...).
    label: str = ""
    #: Why the global gradient norm cannot be taken with this part, or None.
    clip_refusal: str | None = None
    #: The part's parameters are DTensors: the norm is taken over every shard.
    dtensor_params: bool = False

    def apply(self, model: nn.Module) -> nn.Module:
        """Split, wrap or shard ``model`` (what the parts before it produced)."""
        return model


class TensorPart(Part, abc.ABC):
    """A dimension that splits layers across its ranks, and gathers them back. An
    abstract role: each tensor part says how its slices are gathered."""

    @abc.abstractmethod
    def gather(self, module: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        """Full tensors (or gradients) by name, CPU copies, on every rank."""


class DataPart(Part):
    """The data-parallel dimension: ``size`` ranks of ``group``, this one at
    coordinate ``coord``, each training on its own rows and averaging gradients."""

    def __init__(self, group: Any, coord: int, size: int, label: str) -> None:
        self.group, self.coord, self.size, self.label = group, coord, size, label

    def rows(self, batch: Batch) -> Batch:
        """This rank's rows of the global batch."""
        return rows_of_rank(batch, self.coord, self.size)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        """A context in which backward synchronises gradients (``on``) or not."""
        return contextlib.nullcontext()

    def after_backward(self, wrapped: nn.Module) -> None:
        """What runs after each forward and backward (nothing: the wrapper syncs)."""


class OurTensorParallel(TensorPart):
    """Chapter 5's Megatron layers on the tp ``group`` of ``size`` ranks."""

    clip_refusal = ("the norm of a split layer needs its tp group, and our "
                    "Megatron layers do not say which parameters are split")

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.label = group, f"tp{size}"

    def apply(self, model: nn.Module) -> nn.Module:
        tensor_parallelize(unwrap(model), self.group)
        return model

    def gather(self, module: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        return full_tensors(unwrap(module), group=self.group, grads=grads)


class TorchTensorParallel(TensorPart):
    """torch's DTensor tensor parallel (``parallelize_module``) on ``mesh``."""

    dtensor_params = True

    def __init__(self, mesh: Any) -> None:
        self.mesh, self.label = mesh, f"tp{mesh.size()}"

    def apply(self, model: nn.Module) -> nn.Module:
        dtensor_parallelize(unwrap(model), self.mesh)
        return model

    def gather(self, module: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        return full_tensors(unwrap(module), grads=grads)


class OurDataParallel(DataPart):
    """Chapter 3's bucketed DataParallel over ``group``."""

    def apply(self, model: nn.Module) -> nn.Module:
        return DataParallel(model, variant="bucketed", group=self.group)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return contextlib.nullcontext() if on else wrapped.no_sync()


class Fsdp2(DataPart):
    """FSDP2's ``fully_shard`` on ``mesh`` (one unit per block, then the root); the
    rows are those of data-parallel coordinate ``coord`` of ``size``."""

    dtensor_params = True

    def __init__(self, mesh: Any, coord: int, size: int, label: str,
                 mp_policy: Any = None) -> None:
        super().__init__(mesh.get_group() if mesh.ndim == 1 else None, coord, size,
                         label)
        self.mesh, self.mp_policy = mesh, mp_policy

    def apply(self, model: nn.Module) -> nn.Module:
        blocks = model.blocks
        units = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) \
            else list(blocks)
        return shard_fsdp2(model, units, mp_policy=self.mp_policy, mesh=self.mesh)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return gradient_sync(wrapped, on)


class AverageAfterBackward(DataPart):
    """Ours, for a pipeline's stages: after the schedule each stage's gradients are
    averaged over ``group`` (the same stage of every replica), one all-reduce per
    tensor; skipped inside ``grad_sync(on=False)`` (gradient accumulation)."""

    def __init__(self, group: Any, coord: int, size: int, label: str) -> None:
        super().__init__(group, coord, size, label)
        self.sync = True

    @contextlib.contextmanager
    def grad_sync(self, wrapped: nn.Module, on: bool) -> Iterator[None]:
        before, self.sync = self.sync, on
        try:
            yield
        finally:
            self.sync = before

    def after_backward(self, wrapped: nn.Module) -> None:
        if self.sync and self.size > 1:
            allreduce_grads(list(wrapped.parameters()), group=self.group)


class Pipeline(Part):
    """The cut: Chapter 6's pipeline (``variant="ours"``) or torch's schedule
    (``"torch"``) over the pp ``group`` of ``size`` ranks, ``n_micro``
    micro-batches per step."""

    def __init__(self, group: Any, size: int, schedule: str, n_micro: int,
                 variant: str = "ours") -> None:
        self.group, self.schedule, self.n_micro = group, schedule, n_micro
        self.variant, self.label = variant, f"pp{size}"


def _apply(parts: Sequence[Part], model: nn.Module) -> nn.Module:
    for part in parts:
        model = part.apply(model)
    return model


class Composed(Parallelism):
    """A Parallelism that is its ``parts``, applied to the model in order.

    At most one part of each role: one :class:`DataPart` (none: every rank trains on
    the whole batch), one :class:`TensorPart`, one :class:`Pipeline`
    (with the data part after it: the data part works on stages). A list that
    breaks these rules is refused, naming the parts.

    Args:
        parts: the dimensions, in the order they apply.
        name: the layout's name for tables and logs (default: the labels joined).
    """

    def __init__(self, parts: Sequence[Part], name: str | None = None) -> None:
        self.parts = tuple(parts)
        if not self.parts or not all(isinstance(p, Part) for p in self.parts):
            raise ValueError(f"parts={parts!r} must be a non-empty list of Part")
        kinds = [type(p).__name__ for p in self.parts]
        data = [p for p in self.parts if isinstance(p, DataPart)]
        pipes = [i for i, p in enumerate(self.parts) if isinstance(p, Pipeline)]
        gatherers = [p for p in self.parts if isinstance(p, TensorPart)]
        if len(data) > 1 or len(pipes) > 1 or len(gatherers) > 1:
            raise ValueError(f"parts={kinds}: at most one data part, one tensor "
                             "part and one Pipeline")
        self.data = data[0] if data else None
        self.gatherer = gatherers[0] if gatherers else None
        if self.data is not None:
            self.dp_group, self.dp_size = self.data.group, self.data.size
        self.name = name or "x".join(p.label for p in self.parts)
        self.pipeline: PipelineParallel | None = None
        if pipes:
            i = pipes[0]
            before, after = self.parts[:i], self.parts[i + 1:]
            if self.data is not None and self.data in before:
                raise ValueError(f"parts={kinds}: the data part must come after the "
                                 "Pipeline (it synchronises each stage)")
            pipe = self.parts[i]
            assert isinstance(pipe, Pipeline)
            self.pipeline = PipelineParallel(
                pipe.schedule, pipe.n_micro, variant=pipe.variant, group=pipe.group,
                prepare=lambda m: _apply(before, m),
                wrap_stage=lambda s: _apply(after, s),
                stage_state=self._gather)

    def _gather(self, module: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        if self.gatherer is not None:
            return self.gatherer.gather(module, grads)
        return tensors_by_name(unwrap(module), grads=grads)

    def plan(self, stage: nn.Module) -> StagePlan:
        """The pipeline's :class:`StagePlan` of ``stage`` (a layout with a cut)."""
        if self.pipeline is None:
            raise ValueError(f"{self.name} has no Pipeline part: no stage plan")
        return self.pipeline.plan(stage)

    def apply(self, model: nn.Module) -> nn.Module:
        if self.pipeline is not None:
            return self.pipeline.apply(model)
        return _apply(self.parts, model)

    def local_batch(self, batch: Batch) -> Batch:
        return self.data.rows(batch) if self.data is not None else batch

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        if self.pipeline is not None:
            return self.pipeline.full_state(wrapped, grads)
        return self._gather(wrapped, grads)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        if self.data is None:
            return contextlib.nullcontext()
        return self.data.grad_sync(wrapped, on)

    def check_accumulation(self, micro_batches: int) -> None:
        if self.pipeline is not None:
            self.pipeline.check_accumulation(micro_batches)

    def forward_backward(self, wrapped: nn.Module, batch: Batch, loss_fn: Any,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        inner = self.pipeline if self.pipeline is not None else super()
        loss = inner.forward_backward(wrapped, batch, loss_fn, scale, scaler)
        if self.data is not None:
            self.data.after_backward(wrapped)
        return loss

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        for part in self.parts:
            if part.clip_refusal is not None:
                raise ValueError(f"max_grad_norm: clipping is not implemented for "
                                 f"{self.name} ({type(part).__name__}: "
                                 f"{part.clip_refusal})")
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm(wrapped, max_norm)
        if any(p.dtensor_params for p in self.parts):
            return clip_by_global_norm(list(wrapped.parameters()), max_norm)
        return super().clip_grad_norm(wrapped, max_norm)
