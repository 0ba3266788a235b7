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

The loop, read once (``run_steps(par, model, batch_fn, config, state, callbacks)``;
a :class:`RunConfig` says what to train, a :class:`TrainState` hands in what a resume
restored, each :class:`Callback` hooks named points)::

    wrapped = par.apply(model)
    opt = par.make_optimizer(wrapped, config.optimizer_class, **optimizer_kwargs)
    for step in range(config.start + 1, config.steps + 1):
        loss = step_fn(par, wrapped, par.local_batch(batch_fn(step - 1)), loss_fn)
        (unscale, record the first step's gradients, clip)
        opt.step(); callbacks.on_optimizer_step; opt.zero_grad(); scheduler.step()
        losses.append(par.global_loss(loss))
        callbacks: on_save, on_eval (when due), on_step_end, should_stop

Taught in: Chapter 3, "Equal to one process" (the loop every chapter reuses).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.runtime import dist as ddist

__all__ = ["Parallelism", "RunConfig", "TrainState", "Every", "StepEnd", "Callback",
           "OnStepEnd", "AfterOptimizerStep", "RunResult", "run_steps",
           "default_step", "gpt_loss", "logits_of",
           "tensors_by_name", "unwrap", "local_tensor", "full_tensor", "is_dtensor",
           "clip_by_global_norm"]

Batch = Sequence[Any]  # (idx, targets), or any argument tuple of loss_fn
LossFn = Callable[..., torch.Tensor]
StepFn = Callable[..., torch.Tensor]  # step_fn(par, wrapped, batch, loss_fn, scaler=)


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor
             ) -> torch.Tensor:
    """The GPT's own mean cross-entropy (``model(idx, targets)[1]``)."""
    return model(idx, targets)[1]


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a forward: the GPT returns them, a HF model a ``ModelOutput``."""
    return output if torch.is_tensor(output) else output.logits


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
    comms: a communication log of one step (``dtlib.collectives.CountComms``), or
        None.
    step_times: seconds per step (device-synchronised), the first included.
    grad_norms: the global gradient norm of every step before clipping (with
        ``RunConfig.max_grad_norm``).
    extra: anything the callbacks kept.
    """

    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    comms: Any = None
    step_times: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:  # result["losses"], as the pages read it
        if key in self.extra:
            return self.extra[key]
        return getattr(self, key)

    def __contains__(self, key: str) -> bool:
        return key in self.extra or key in self.__dataclass_fields__


def _count(owner: str, name: str, value: Any, note: str = "") -> None:
    """Refuse ``value`` unless it is an integer >= 0 (a bool is not), naming
    ``owner(name=value)`` and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}({name}={value!r}): must be an integer >= 0"
                         + (f" {note}" if note else ""))


@dataclass(frozen=True)
class Every:
    """A schedule over optimizer steps: every ``n``-th step (``n == 0``: none), and
    with ``last`` the run's last step too. ``Every(5, last=True)`` over 12 steps is
    steps 5, 10 and 12."""

    n: int = 0
    last: bool = False

    def __post_init__(self) -> None:
        _count("Every", "n", self.n, "(0: no step but, with last=True, the last)")

    def due(self, step: int, steps: int) -> bool:
        """Whether optimizer step ``step`` (1-based) of a run to ``steps`` is in."""
        return bool(self.n and step % self.n == 0) or (self.last and step == steps)


@dataclass(frozen=True)
class RunConfig:
    """What one run of the loop trains; checked when built.

    steps: the optimizer step to stop after (steps are counted from 1: a run to
        ``steps=3`` takes steps 1, 2 and 3); start: steps already done (a resume
        takes ``start + 1`` .. ``steps``).
    optimizer_class, optimizer_kwargs: what ``par.make_optimizer`` builds (AdamW at
        torch's defaults) when no optimizer is handed in (:class:`TrainState`).
    loss_fn: ``loss_fn(model, *batch)`` -> scalar loss (the GPT's own by default).
    step_fn: ``step_fn(par, wrapped, batch, loss_fn, scaler=...)`` -> the detached
        loss of one optimizer step's gradients (:func:`default_step`: one
        forward and backward; Chapter 8's ``accumulation_step(k)``: k micro-batches).
    max_grad_norm: clip the global gradient norm to this (``par.clip_grad_norm``;
        ``math.inf`` measures it without clipping), or None.
    autocast_dtype: run ``step_fn`` under ``torch.autocast`` in this dtype, or None.
    local_batches: ``batch_fn`` already returns this rank's part (a per-rank
        sampler, as in the capstone): ``par.local_batch`` is not applied.
    record_grads, record_params: return the first step's full gradients and the
        last step's full parameters (``par.full_state``: collectives on every rank).
    save, evaluate: when :meth:`Callback.on_save` and :meth:`Callback.on_eval` are
        called (:class:`Every`; default: never).
    """

    steps: int
    start: int = 0
    optimizer_class: type = torch.optim.AdamW
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    loss_fn: LossFn = gpt_loss
    step_fn: StepFn | None = None
    max_grad_norm: float | None = None
    autocast_dtype: torch.dtype | None = None
    local_batches: bool = False
    record_grads: bool = True
    record_params: bool = True
    save: Every = Every()
    evaluate: Every = Every()

    def __post_init__(self) -> None:
        for name in ("steps", "start"):
            _count("RunConfig", name, getattr(self, name))
        if self.steps < self.start:
            raise ValueError(f"RunConfig(steps={self.steps}) must be >= "
                             f"start={self.start} (steps is the step to stop after)")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"RunConfig(max_grad_norm={self.max_grad_norm!r}): must "
                             "be > 0 (math.inf: measure the norm, clip nothing), or "
                             "None")
        if not isinstance(self.optimizer_class, type):
            raise ValueError(f"RunConfig(optimizer_class={self.optimizer_class!r}): "
                             "must be an optimizer class, e.g. torch.optim.AdamW")
        for name in ("save", "evaluate"):
            if not isinstance(getattr(self, name), Every):
                raise ValueError(f"RunConfig({name}={getattr(self, name)!r}): must be "
                                 "an Every(n, last=...)")


@dataclass
class TrainState:
    """What the loop would otherwise build or go without, handed in.

    wrapped, optimizer: an applied model (``par.apply``) and its optimizer: a
        resumed run restores both before the loop; left None, the loop builds them.
    scheduler: an LR scheduler stepped after each optimizer step, or None.
    scaler: a ``torch.amp.GradScaler`` (fp16), or None.
    """

    wrapped: nn.Module | None = None
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None


@dataclass
class StepEnd:
    """What a callback is told when optimizer step ``step`` (1-based) has ended.

    loss: the global-batch loss (``par.global_loss``); seconds: the step's time,
    device-synchronised, callbacks excluded; grad_norm: the norm before clipping
    (with ``max_grad_norm``), else None; wrapped, optimizer: the live model and
    optimizer; result: the :class:`RunResult` so far (a callback keeps what it
    measures in ``result.extra``).
    """

    step: int
    loss: float
    seconds: float
    grad_norm: float | None
    wrapped: nn.Module
    optimizer: Any
    result: RunResult


class Callback:
    """Named points of the loop; subclass and override what you need. Within a
    step the loop calls, in order: :meth:`step_context` (entered around the
    step's forward, backward and optimizer step), :meth:`before_optimizer_step`,
    :meth:`on_optimizer_step`, then :meth:`on_save` and :meth:`on_eval` when the
    run's schedules say so, :meth:`on_step_end`, and :meth:`should_stop`. Every
    rank calls them alike.
    """

    def step_context(self, step: int) -> ContextManager[Any]:
        """A context around step ``step``'s work (a measurement), or a null one."""
        return contextlib.nullcontext()

    def before_optimizer_step(self, step: int, wrapped: nn.Module, optimizer: Any
                              ) -> None:
        """The gradients are complete (unscaled, clipped); the optimizer has not
        stepped."""

    def on_optimizer_step(self, step: int, wrapped: nn.Module, optimizer: Any
                          ) -> None:
        """After ``optimizer.step()``, before ``zero_grad``: the moment the
        gradients and the updated optimizer state are both held."""

    def on_save(self, end: StepEnd) -> None:
        """When ``RunConfig.save`` is due: save a checkpoint."""

    def on_eval(self, end: StepEnd) -> None:
        """When ``RunConfig.evaluate`` is due: evaluate."""

    def on_step_end(self, end: StepEnd) -> None:
        """After every step (logging)."""

    def should_stop(self, end: StepEnd) -> bool:
        """Whether to leave the loop after this step (a crash rehearsal, a signal)."""
        return False


class OnStepEnd(Callback):
    """A callback from one function: ``fn(end)`` after every step; ``fn``
    returning True stops the loop (a crash rehearsal)."""

    def __init__(self, fn: Callable[[StepEnd], bool | None]) -> None:
        self.fn, self.stop = fn, False

    def on_step_end(self, end: StepEnd) -> None:
        self.stop = bool(self.fn(end))

    def should_stop(self, end: StepEnd) -> bool:
        return self.stop


class AfterOptimizerStep(Callback):
    """A callback from one function: ``fn(step, wrapped, optimizer)`` after every
    optimizer step, before ``zero_grad`` (what a memory measurement needs)."""

    def __init__(self, fn: Callable[[int, nn.Module, Any], None]) -> None:
        self.fn = fn

    def on_optimizer_step(self, step: int, wrapped: nn.Module, optimizer: Any
                          ) -> None:
        self.fn(step, wrapped, optimizer)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_step(par: Parallelism, wrapped: nn.Module, batch: Batch,
                 loss_fn: LossFn, scaler: Any = None) -> torch.Tensor:
    """One optimizer step's gradients: one forward and backward with sync on."""
    with par.grad_sync(wrapped, True):
        return par.forward_backward(wrapped, batch, loss_fn, scaler=scaler)


def run_steps(par: Parallelism, model: nn.Module | None,
              batch_fn: Callable[[int], Batch], config: RunConfig,
              state: TrainState | None = None,
              callbacks: Sequence[Callback] = ()) -> RunResult:
    """Train ``model`` under ``par`` from step ``config.start + 1`` to
    ``config.steps``: the one loop.

    Args:
        par: the technique (``Parallelism()`` for one process).
        model: the unwrapped model, built identically on every rank (None when
            ``state.wrapped`` is given).
        batch_fn: ``batch_fn(i)`` -> the *global* batch of the step that follows
            ``i`` steps done (every rank computes the same); ``par.local_batch``
            cuts this rank's part (``config.local_batches``: it already is).
        config: what to train (:class:`RunConfig`).
        state: a model, optimizer, scheduler or scaler built before the loop
            (:class:`TrainState`; a resume), or None.
        callbacks: :class:`Callback` objects, called in their order.
    Returns:
        A :class:`RunResult`.

    Taught in: Chapter 3, "Equal to one process".
    """
    if not isinstance(config, RunConfig):
        raise ValueError(f"config={config!r}: must be a RunConfig (steps=..., "
                         "optimizer_class=..., ...)")
    state = state or TrainState()
    device = ddist.world().device
    if state.wrapped is None and model is None:
        raise ValueError("model=None and state.wrapped=None: give the model to "
                         "apply, or an applied one in TrainState(wrapped=...)")
    wrapped = state.wrapped if state.wrapped is not None else par.apply(model)
    optimizer = state.optimizer if state.optimizer is not None else \
        par.make_optimizer(wrapped, config.optimizer_class,
                           **dict(config.optimizer_kwargs))
    scaler = state.scaler
    step_fn = config.step_fn or default_step
    out = RunResult()
    for done in range(config.start, config.steps):
        step = done + 1
        _sync(device)
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for cb in callbacks:
                stack.enter_context(cb.step_context(step))
            batch = batch_fn(done)
            if not config.local_batches:
                batch = par.local_batch(batch)
            amp = torch.autocast(device.type, dtype=config.autocast_dtype) \
                if config.autocast_dtype is not None else contextlib.nullcontext()
            with amp:
                loss = step_fn(par, wrapped, batch, config.loss_fn, scaler=scaler)
            if scaler is not None:
                scaler.unscale_(optimizer)
            if done == config.start and config.record_grads:
                out.grads = par.full_state(wrapped, grads=True)
            norm = None if config.max_grad_norm is None else \
                par.clip_grad_norm(wrapped, config.max_grad_norm)
            for cb in callbacks:
                cb.before_optimizer_step(step, wrapped, optimizer)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            for cb in callbacks:
                cb.on_optimizer_step(step, wrapped, optimizer)
            optimizer.zero_grad(set_to_none=True)
            if state.scheduler is not None:
                state.scheduler.step()
        value = float(par.global_loss(loss))  # the step's one host sync
        _sync(device)
        seconds = time.perf_counter() - t0
        out.step_times.append(seconds)
        out.losses.append(value)
        if norm is not None:
            out.grad_norms.append(float(norm))
        end = StepEnd(step, value, seconds, None if norm is None else float(norm),
                      wrapped, optimizer, out)
        if config.save.due(step, config.steps):
            for cb in callbacks:
                cb.on_save(end)
        if config.evaluate.due(step, config.steps):
            for cb in callbacks:
                cb.on_eval(end)
        for cb in callbacks:
            cb.on_step_end(end)
        if any([cb.should_stop(end) for cb in callbacks]):  # every one is asked
            break
    if config.record_params:
        out.params = par.full_state(wrapped)
    return out
