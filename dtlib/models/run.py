"""The one training loop of the package, and the seam every technique plugs into.

A technique is a small :class:`Parallelism`: four questions the loop asks it and
nothing else.

- ``apply(model)``: wrap, split or shard the model (DDP, ZeRO-3, a TP plan, a stage);
- ``local_batch(batch)``: this rank's part of the global batch (its rows, the stage
  input, the whole batch under tensor parallelism);
- ``full_state(wrapped, grads=...)``: the full parameters (or gradients) by name, as
  one process would hold them, whatever shards, DTensors or stages hide them;
- ``grad_sync(wrapped, on)``: a context in which backward does (``on=True``) or does
  not (``on=False``) synchronise gradients (DDP's ``no_sync``, FSDP2's
  ``set_requires_gradient_sync``, ZeRO's hooks): gradient accumulation asks it.

Backward runs in one place, ``forward_backward(wrapped, micro_batch, loss_fn,
scale)``: the default step calls it once (``scale`` 1), Chapter 8's accumulation once
per micro-batch (``scale``: the normaliser of the accumulated batch), so a technique
that changes how backward runs (mixed precision's 16-bit copy, a pipeline schedule, an
engine's ``backward``) does so under both. A technique that cannot accumulate this
way says so in ``check_accumulation`` (a pipeline splits its batch into micro-batches
itself) and the step raises, naming both. Every loss function has one signature,
``loss_fn(model, *batch)``.

The base class *is* the identity: ``Parallelism()`` is one process training on the
whole batch, the reference every parallel run is proven against. :func:`run_steps` is
the loop; a technique overrides only what it changes (``make_optimizer`` for a sharded
optimizer, ``forward_backward`` for a pipeline schedule, ``global_loss`` where the
logged loss is not the mean over ``dp_size`` data-parallel ranks). Each technique
package exports one factory for its Parallelism (``data_parallel.parallelism``,
``zero.parallelism``, ...).

The loop, read once::

    wrapped = par.apply(model)
    opt = par.make_optimizer(wrapped, optimizer_class, **optimizer_kwargs)
    for step in range(start, steps):
        loss = step_fn(par, wrapped, par.local_batch(batch_fn(step)), loss_fn)
        (unscale, record step 0's gradients, clip)
        opt.step(); opt.zero_grad(set_to_none=True); scheduler.step()
        losses.append(par.global_loss(loss))

Taught in: Chapter 3, "Equal to one process" (the loop every chapter reuses).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.runtime import dist as ddist

__all__ = ["Parallelism", "RunResult", "run_steps", "default_step", "gpt_loss",
           "tensors_by_name", "unwrap", "local_tensor", "full_tensor", "is_dtensor",
           "clip_by_global_norm"]

Batch = Sequence[Any]  # (idx, targets), or any argument tuple of loss_fn
LossFn = Callable[..., torch.Tensor]


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor
             ) -> torch.Tensor:
    """The GPT's own mean cross-entropy (``model(idx, targets)[1]``)."""
    return model(idx, targets)[1]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's local piece of ``t``: a DTensor's ``to_local()``, else ``t``.

    Code over "this rank's storage" reads the same for both; :func:`is_dtensor` is
    the one place that tells them apart.
    """
    return t.to_local() if is_dtensor(t) else t


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a sharded or replicated view over a device mesh).

    Duck-typed, here only, so that code runs on torch versions whose DTensor lives
    under another module path."""
    return hasattr(t, "to_local") and hasattr(t, "full_tensor")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` as one process holds it: a DTensor's ``full_tensor()``
    (a collective over its mesh), else ``t``."""
    return t.full_tensor() if is_dtensor(t) else t


def clip_by_global_norm(params: Sequence[nn.Parameter], max_norm: float,
                        group: Any = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global L2 norm is at most
    ``max_norm``; return the norm before.

    ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which fails
    when they are DTensors on different meshes (under FSDP2 x TP the blocks' weights
    live on the 2-D (dp, tp) mesh, the embeddings and head on ``mesh["dp"]``
    alone), and it cannot know that a pipeline stage holds only part of the model.
    Here each parameter's norm is made full first (one small collective per
    DTensor, on its own mesh), the squares are summed in float32, and with
    ``group`` (a pipeline's stages) summed over its ranks.

    Args:
        params: this rank's parameters (those without a gradient are skipped).
        max_norm: the largest allowed global norm (> 0).
        group: ranks that each hold other parameters of the model (a pipeline's
            stages: ``dist.group.WORLD`` for all of them), or None: none.
    Returns:
        The total norm before clipping (a plain float32 scalar tensor).

    Taught in: Chapter 11, "Two dimensions, ours and torch's" (and Chapter 6's
    pipelines).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0")
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), device=ddist.world().device)
    for g in grads:
        sq = sq + full_tensor(torch.linalg.vector_norm(g)).float() ** 2
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a wrapper that keeps it in ``.module`` (DDP, ours)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def tensors_by_name(module: nn.Module, grads: bool = False
                    ) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter (or its gradient), by name; DTensors made full.

    A tied weight appears once (``named_parameters`` de-duplicates it); a parameter
    without a gradient is left out when ``grads=True``.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        out[name] = full_tensor(t.detach()).cpu().clone()
    return out


class Parallelism:
    """How a technique runs the one loop; the base class is one process (identity).

    Subclasses override only what their technique changes. Every method is called on
    every rank in the same order, so a method may run collectives.

    Taught in: Chapter 3, "Equal to one process"; each technique's chapter shows
    the file behind its ``apply``.
    """

    #: A short name for tables and logs ("single", "ddp/bucketed", "zero-2", ...).
    name: str = "single"
    #: The ranks over which backward *averages* gradients (data parallelism: DDP,
    #: ZeRO, FSDP) and their number; ``dp_size == 1``: no data parallelism. A loss
    #: normaliser over the global batch (Chapter 8) needs both; ``dp_group=None``
    #: with ``dp_size > 1`` means the whole world.
    dp_group: Any = None
    dp_size: int = 1

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap, split or shard ``model`` (built identically on every rank)."""
        return model

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's part of the global ``batch`` (identity: all of it)."""
        return batch

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        """Full parameters (or gradients) by name, CPU copies, on every rank."""
        return tensors_by_name(unwrap(wrapped), grads=grads)

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        """A context in which backward synchronises gradients (``on``) or not."""
        return contextlib.nullcontext()

    def make_optimizer(self, wrapped: nn.Module, optimizer_class: type,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer over what this rank steps (a sharded one overrides this)."""
        return optimizer_class(wrapped.parameters(), **kwargs)

    def forward_backward(self, wrapped: nn.Module, batch: Batch, loss_fn: LossFn,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        """Forward and backward of one (local) micro-batch: the only place backward
        runs. Gradients *add* to ``.grad`` (accumulation calls it once per
        micro-batch, inside ``grad_sync``). Returns the detached, unscaled loss.

        Args:
            batch: the arguments of ``loss_fn`` after the model (``(idx, targets)``).
            loss_fn: ``loss_fn(wrapped, *batch)`` -> a scalar loss.
            scale: multiplies the loss before backward (accumulation's normaliser).
            scaler: a ``torch.amp.GradScaler`` (fp16) or None.
        """
        loss = loss_fn(wrapped, *batch)
        scaled = loss * scale if scale != 1.0 else loss
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        return loss.detach()

    def check_accumulation(self, micro_batches: int) -> None:
        """Raise ValueError, naming this technique and accumulation, when the
        technique cannot take one step's gradients as ``micro_batches`` calls of
        :meth:`forward_backward` (identity: it can)."""

    def sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the data-parallel ranks, in place (accumulation's token
        count: every rank needs the global batch's)."""
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the (global) gradient norm to ``max_norm``; returns the norm before."""
        return torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_norm)

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of the whole global batch from this rank's ``loss`` (a tensor;
        the caller reads it once per step): the mean over the ``dp_size``
        data-parallel ranks of ``dp_group``, each holding an equal share (one
        process: the loss itself). Averaged in at least float32 (a 16-bit loss in
        float32), never narrower than the loss (a float64 run stays float64); a
        DTensor loss is made full first."""
        mean = full_tensor(loss).detach()
        mean = mean.to(torch.promote_types(mean.dtype, torch.float32)).clone()
        if self.dp_size > 1:
            dist.all_reduce(mean, group=self.dp_group)
        return mean / self.dp_size


@dataclass
class RunResult:
    """What :func:`run_steps` returns (picklable, so a rank can send it home).

    losses: the global-batch loss of every step (as one process computes it).
    grads: full gradients by name after the first step's backward (CPU copies).
    params: full parameters by name after the last step (CPU copies).
    comms: what the ``comms`` context yielded on ``comms_step`` (a log), or None.
    step_times: seconds per step (device-synchronised), step 0 included.
    extra: anything the caller's ``on_step`` put there.
    """

    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    comms: Any = None
    step_times: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:  # result["losses"], as the pages read it
        if key in self.extra:
            return self.extra[key]
        return getattr(self, key)

    def __contains__(self, key: str) -> bool:
        return key in self.extra or key in self.__dataclass_fields__


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_step(par: Parallelism, wrapped: nn.Module, batch: Batch,
                 loss_fn: LossFn, scaler: Any = None) -> torch.Tensor:
    """One optimizer step's gradients: one forward and backward with sync on."""
    with par.grad_sync(wrapped, True):
        return par.forward_backward(wrapped, batch, loss_fn, scaler=scaler)


def run_steps(par: Parallelism, model: nn.Module,
              batch_fn: Callable[[int], Batch], steps: int, *,
              optimizer_class: type = torch.optim.AdamW,
              optimizer_kwargs: dict[str, Any] | None = None,
              loss_fn: LossFn = gpt_loss,
              step_fn: Callable[..., torch.Tensor] | None = None,
              start: int = 0, local: bool = False, wrapped: nn.Module | None = None,
              optimizer: torch.optim.Optimizer | None = None,
              scheduler: Any = None, scaler: Any = None,
              autocast_dtype: torch.dtype | None = None,
              max_grad_norm: float | None = None,
              comms: Callable[[], ContextManager[Any]] | None = None,
              comms_step: int = 0, record_grads: bool = True,
              record_params: bool = True,
              on_step: Callable[[int, float, dict[str, Any]],
                                bool | None] | None = None,
              ) -> RunResult:
    """Train ``steps`` optimizer steps of ``model`` under ``par``: the one loop.

    Args:
        par: the technique (``Parallelism()`` for one process).
        model: the unwrapped model, built identically on every rank (ignored when
            ``wrapped`` is given).
        batch_fn: ``batch_fn(step)`` -> the *global* batch of that step (every rank
            computes the same); ``par.local_batch`` cuts this rank's part.
        steps: the step to stop at (exclusive); ``start`` the first (a resume).
        local: ``batch_fn`` already returns this rank's part (a per-rank sampler, as
            in the capstone): ``par.local_batch`` is not applied.
        optimizer_class, optimizer_kwargs: the optimizer ``par.make_optimizer``
            builds (default AdamW at torch's defaults).
        loss_fn: ``loss_fn(wrapped, *local_batch)`` -> scalar loss.
        step_fn: ``step_fn(par, wrapped, local_batch, loss_fn, scaler=...)`` -> the
            detached loss (default: one forward/backward; Chapter 8 passes gradient
            accumulation over micro-batches).
        wrapped, optimizer: an already-applied model and its optimizer (a resumed
            run restores them before the loop).
        scheduler: an LR scheduler stepped after each optimizer step.
        scaler: a ``torch.amp.GradScaler`` (fp16) or None.
        autocast_dtype: run ``step_fn`` under ``torch.autocast`` with this dtype.
        max_grad_norm: clip the gradient norm (``par.clip_grad_norm``) or None.
        comms: a context-manager factory (e.g. ``lambda: count_comms()``) entered
            around step ``comms_step``'s forward, backward and optimizer step; what
            it yields is returned as ``comms``.
        record_grads, record_params: collect the first step's gradients and the
            last step's parameters (``par.full_state``: collectives on every rank).
        on_step: ``on_step(step_done, loss, extra)`` after each step (logging,
            saving); returning True stops the loop.
    Returns:
        A :class:`RunResult`.

    Taught in: Chapter 3, "Equal to one process".
    """
    if steps < start:
        raise ValueError(f"steps={steps} must be >= start={start}")
    device = ddist.world().device
    if wrapped is None:
        wrapped = par.apply(model)
    if optimizer is None:
        optimizer = par.make_optimizer(wrapped, optimizer_class,
                                       **(optimizer_kwargs or {}))
    step_fn = step_fn or default_step
    out = RunResult()
    for step in range(start, steps):
        _sync(device)
        t0 = time.perf_counter()
        counting = comms() if comms is not None and step == comms_step \
            else contextlib.nullcontext()
        with counting as log:
            batch = batch_fn(step)
            if not local:
                batch = par.local_batch(batch)
            amp = torch.autocast(device.type, dtype=autocast_dtype) \
                if autocast_dtype is not None else contextlib.nullcontext()
            with amp:
                loss = step_fn(par, wrapped, batch, loss_fn, scaler=scaler)
            if scaler is not None:
                scaler.unscale_(optimizer)
            if step == start and record_grads:
                out.grads = par.full_state(wrapped, grads=True)
            if max_grad_norm is not None:
                out.extra.setdefault("grad_norms", []).append(
                    par.clip_grad_norm(wrapped, max_grad_norm))
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        if comms is not None and step == comms_step:
            out.comms = log
        value = float(par.global_loss(loss))  # the step's one host sync
        _sync(device)
        out.step_times.append(time.perf_counter() - t0)
        out.losses.append(value)
        if on_step is not None and on_step(step + 1, value, out.extra):
            break
    if "grad_norms" in out.extra:
        out.extra["grad_norms"] = [float(n) for n in out.extra["grad_norms"]]
    if record_params:
        out.params = par.full_state(wrapped)
    return out
