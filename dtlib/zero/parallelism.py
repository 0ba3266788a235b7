"""ZeRO 1-3 and FSDP2 as the one loop's :class:`~dtlib.models.run.Parallelism`.

``parallelism(stage)`` is what every chapter-4 run hands to
:func:`dtlib.models.run.run_steps`: each rank takes its rows of the global batch;
stages 1 and 2 keep the model whole and shard the optimizer
(:class:`ShardedOptimizer`), stage 3 wraps the model (:class:`FullyShardedModule`, or
torch's ``fully_shard`` with ``variant="fsdp2"``) and any torch optimizer steps its
shards.

Taught in: Chapter 4, "Does it train the same model?".
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, ContextManager

import torch
import torch.nn as nn

from dtlib.data_parallel.parallelism import DataParallelRows, rows_of_rank
from dtlib.models.run import Callback, Parallelism, full_tensor, tensors_by_name
from dtlib.runtime.dist import world
from dtlib.zero.fsdp import (MixedPrecisionPolicy, fsdp_state_bytes, gradient_sync,
                             shard_fsdp2)
from dtlib.zero.optimizer import ShardedOptimizer
from dtlib.zero.stage3 import FullyShardedModule

__all__ = ["parallelism", "ZeroParallelism", "FSDP2Parallelism", "VARIANTS",
           "rows_of_rank", "StateAfterStep"]

VARIANTS = ("ours", "fsdp2")


class ZeroParallelism(DataParallelRows):
    """The book's ZeRO at ``stage`` 1, 2 (:class:`ShardedOptimizer`) or 3
    (:class:`FullyShardedModule` and the caller's optimizer class).

    Taught in: Chapter 4, "The three stages".
    """

    def __init__(self, stage: int, group: Any = None,
                 unit_modules: list[nn.Module] | None = None,
                 mp_policy: MixedPrecisionPolicy | None = None) -> None:
        super().__init__(group)
        if mp_policy is not None and stage != 3:
            raise ValueError(f"mp_policy needs stage=3, got stage={stage!r}")
        self.stage, self.group, self.unit_modules = stage, group, unit_modules
        self.mp_policy = mp_policy
        self.name = f"zero-{stage}"
        # stages 1-2 keep gradients and clip in the optimizer: the one built for
        # each model, found by the model (a second model gets its own)
        self._optimizers: weakref.WeakKeyDictionary[nn.Module, ShardedOptimizer] = \
            weakref.WeakKeyDictionary()

    def optimizer_of(self, wrapped: nn.Module) -> ShardedOptimizer:
        """Stages 1-2: the :class:`ShardedOptimizer` ``make_optimizer`` built for
        ``wrapped`` (it holds the reduced gradient shards)."""
        try:
            return self._optimizers[wrapped]
        except KeyError:
            raise ValueError(
                f"wrapped={type(wrapped).__name__}: no ShardedOptimizer was made for "
                f"it by this zero-{self.stage} Parallelism (call make_optimizer "
                "first; its gradients live there)") from None

    def apply(self, model: nn.Module) -> nn.Module:
        if self.stage < 3:
            return model  # the optimizer shards itself
        return FullyShardedModule(model, self.group, self.unit_modules,
                                  self.mp_policy)

    def make_optimizer(self, wrapped: nn.Module, optimizer_class: type,
                       params: Any = None, **kwargs: Any) -> torch.optim.Optimizer:
        """Stages 1-2: a :class:`ShardedOptimizer`; stage 3: ``optimizer_class`` on
        the wrapper's shards. ``params``: parameter groups of ``wrapped`` (default:
        all its parameters)."""
        params = wrapped.parameters() if params is None else params
        if self.stage == 3:
            return optimizer_class(params, **kwargs)
        opt = ShardedOptimizer(params, optimizer_class, stage=self.stage,
                               group=self.group, module=wrapped,
                               unit_modules=self.unit_modules, **kwargs)
        self._optimizers[wrapped] = opt
        return opt

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        if self.stage == 3:
            out = wrapped.full_gradients() if grads else wrapped.full_parameters()
        elif grads:
            out = self.optimizer_of(wrapped).full_gradients()
        else:
            return tensors_by_name(wrapped)
        return {n: t.cpu() for n, t in out.items()}

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        # Stages 2 and 3 reduce-scatter in every backward and add up the shards
        # (accumulation is correct either way); stage 1 reduces at the step only.
        return contextlib.nullcontext()

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        clipper = wrapped if self.stage == 3 else self.optimizer_of(wrapped)
        return clipper.clip_grad_norm_(max_norm)

    def state_bytes(self, wrapped: nn.Module, optimizer: Any) -> dict[str, int]:
        """Bytes of model states this rank holds (``{"params", "grads", ...}``)."""
        if self.stage == 3:
            return wrapped.state_bytes(optimizer)
        return optimizer.state_bytes()


class FSDP2Parallelism(DataParallelRows):
    """torch's FSDP2 (``fully_shard`` on each unit, then the root): stage 3.

    Taught in: Chapter 4, "FSDP2".
    """

    def __init__(self, group: Any = None, mesh: Any = None,
                 mp_policy: MixedPrecisionPolicy | None = None,
                 unit_modules: list[nn.Module] | None = None,
                 reshard_after_forward: bool = True) -> None:
        if mesh is None and group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(group, world().device.type)
        super().__init__(mesh.get_group() if mesh is not None else group)
        self.mesh, self.mp_policy = mesh, mp_policy
        self.unit_modules = unit_modules
        self.reshard_after_forward = reshard_after_forward
        self.name = "fsdp2"

    def apply(self, model: nn.Module) -> nn.Module:
        return shard_fsdp2(model, self.unit_modules, self.mp_policy,
                           self.reshard_after_forward, self.mesh)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return gradient_sync(wrapped, on)

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        # torch's clip works on DTensors; the norm it returns may be one
        norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_norm)
        return full_tensor(norm)

    def state_bytes(self, wrapped: nn.Module, optimizer: Any) -> dict[str, int]:
        """Bytes of model states this rank holds (``{"params", "grads", ...}``)."""
        return fsdp_state_bytes(wrapped, optimizer)


def parallelism(stage: int, *, variant: str = "ours", group: Any = None,
                mesh: Any = None, mp_policy: MixedPrecisionPolicy | None = None,
                unit_modules: list[nn.Module] | None = None,
                reshard_after_forward: bool = True) -> Parallelism:
    """ZeRO ``stage`` as a :class:`~dtlib.models.run.Parallelism` for ``run_steps``.

    Args:
        stage: 1, 2 or 3 (``variant="fsdp2"``: 3 only).
        variant: ``"ours"`` (:class:`ShardedOptimizer`, :class:`FullyShardedModule`)
            or ``"fsdp2"`` (torch's ``fully_shard``).
        group: the data-parallel process group (default: the world).
        mesh: FSDP2 only: the 1-D ``DeviceMesh`` to shard over (e.g. ``mesh["dp"]``).
        mp_policy: stage 3: e.g. :func:`dtlib.zero.fsdp.bf16_policy` (the same
            ``MixedPrecisionPolicy`` for both variants).
        unit_modules: the submodules sharded as separate units (default: each
            block).
        reshard_after_forward: FSDP2 only: False keeps the gathered parameters from
            forward to backward.
    Returns:
        The Parallelism; its ``state_bytes(wrapped, optimizer)`` counts the model
        states a rank holds.

    Taught in: Chapter 4, "Does it train the same model?".
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} not allowed; allowed: {VARIANTS}")
    allowed = (3,) if variant == "fsdp2" else (1, 2, 3)
    if stage not in allowed:
        raise ValueError(f"stage={stage!r} not allowed for variant={variant!r}; "
                         f"allowed: {allowed}")
    if variant == "fsdp2":
        return FSDP2Parallelism(group, mesh, mp_policy, unit_modules,
                                reshard_after_forward)
    if mesh is not None or not reshard_after_forward:
        raise ValueError("mesh and reshard_after_forward=False need "
                         "variant='fsdp2'")
    if mp_policy is not None and stage != 3:
        raise ValueError(f"mp_policy needs stage=3 (or variant='fsdp2'), got "
                         f"stage={stage!r}")
    return ZeroParallelism(stage, group, unit_modules, mp_policy)


class StateAfterStep(Callback):
    """The one loop's callback that measures this rank's model states
    (``par.state_bytes``) after optimizer step ``step``, before ``zero_grad``: the
    moment the ZeRO paper's formula describes, the gradients still held (FSDP2
    frees them at ``zero_grad``). DeepSpeed's ``engine.step()`` frees its own, so
    for a Parallelism with ``gradients_held`` they are noted just before the step.
    ``state`` holds the bytes once that step is done.

    Taught in: Chapter 4, "Memory, measured".
    """

    def __init__(self, par: Parallelism, step: int) -> None:
        if not hasattr(par, "state_bytes"):
            raise ValueError(f"par={par.name!r} does not measure its model states; "
                             "allowed: a ZeRO, FSDP2 or DeepSpeed Parallelism")
        self.par, self.step, self.state = par, step, {}
        self.grads: Any = None

    def before_optimizer_step(self, step: int, wrapped: nn.Module, optimizer: Any
                              ) -> None:
        if step == self.step and hasattr(self.par, "gradients_held"):
            self.grads = self.par.gradients_held(wrapped)

    def on_optimizer_step(self, step: int, wrapped: nn.Module, optimizer: Any
                          ) -> None:
        if step == self.step:
            held = {} if self.grads is None else {"grads": self.grads}
            self.state = self.par.state_bytes(wrapped, optimizer, **held)
