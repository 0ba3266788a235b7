"""Pipeline parallelism, part 3: a schedule plugged into the one training loop.

:func:`parallelism` returns a :class:`PipelineParallel`, the
:class:`~dtlib.models.run.Parallelism` that :func:`~dtlib.models.run.run_steps`
trains with. Each rank of the pipeline's group keeps one stage:

- ``apply(model)`` cuts the GPT into balanced stages (:func:`split_gpt`) and keeps
  this rank's; ``variant="torch"`` wraps it in ``torch.distributed.pipelining``'s
  ``PipelineStage``, ``variant="tracer"`` lets ``pipeline()`` trace and cut the model;
- ``forward_backward`` runs one batch through the schedule (``"gpipe"`` or
  ``"1f1b"``) in ``n_micro`` micro-batches, the loss of each divided by ``n_micro``;
- ``full_state`` sends every stage's tensors to every rank of the pipeline, so that
  the result compares name by name with one process.

Taught in: Chapter 6, "Is it the same training?".
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models.gpt import GPT
from dtlib.models.run import (Batch, Parallelism, clip_by_global_norm, gpt_loss,
                              tensors_by_name)
from dtlib.pipeline_parallel.schedules import SCHEDULES, StepResult, pipeline_step
from dtlib.pipeline_parallel.split import split_gpt
from dtlib.runtime.dist import world

__all__ = ["VARIANTS", "lm_loss", "PipelineParallel", "parallelism"]

VARIANTS = ("ours", "torch", "tracer")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits ``(b, s, V)``, targets ``(b, s)``.

    The GPT's own loss, computed on the last stage's output.

    Taught in: Chapter 6, "The schedules, for real".
    """
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _in_group(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class PipelineParallel(Parallelism):
    """One stage per rank of ``group``, trained by a schedule; see :func:`parallelism`.

    Subclasses (Chapter 11) change what happens around the split through three
    hooks: :meth:`prepare` (the whole model, before the split), :meth:`wrap_stage`
    (this rank's stage, after it) and :meth:`stage_state` (this stage's full
    tensors).
    """

    def __init__(self, schedule: str = "1f1b", n_micro: int = 1, *,
                 variant: str = "ours", group: Any = None,
                 layers_per_stage: Sequence[int] | None = None,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
                 micro_batch: int | None = None,
                 act_dtype: torch.dtype = torch.float32) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
        if isinstance(n_micro, bool) or not isinstance(n_micro, int) or n_micro < 1:
            raise ValueError(f"n_micro={n_micro!r} must be a positive integer")
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
        if variant == "tracer" and (micro_batch is None or micro_batch < 1):
            raise ValueError(f"variant='tracer' needs micro_batch >= 1 (rows of its "
                             f"example micro-batch), not {micro_batch!r}")
        self.schedule, self.n_micro, self.variant = schedule, n_micro, variant
        self.group, self.layers_per_stage, self.loss = group, layers_per_stage, loss
        self.micro_batch, self.act_dtype = micro_batch, act_dtype
        self.name = f"pp/{variant}-{schedule}"
        self.scale = 1.0
        #: the teaching schedule's last :class:`StepResult` (events, peak in flight)
        self.last_step: StepResult | None = None

    # ---- hooks -------------------------------------------------------------------

    def prepare(self, model: GPT) -> GPT:
        """The whole model before it is cut (identity; Chapter 11 splits layers)."""
        return model

    def wrap_stage(self, stage: nn.Module) -> nn.Module:
        """This rank's stage after the cut (identity; Chapter 11 shards it)."""
        return stage

    def stage_state(self, stage: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        """This stage's full parameters (or gradients) by name, CPU copies."""
        return tensors_by_name(stage, grads=grads)

    # ---- the Parallelism ---------------------------------------------------------

    def peer(self, s: int) -> int:
        """The global rank of stage ``s``."""
        return dist.get_global_rank(self.group, s) if self.group is not None else s

    def apply(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, GPT):
            raise ValueError(f"model={type(model).__name__} must be a dtlib GPT")
        self.cfg = model.cfg
        self.shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
        self.rank, self.n_stages = _in_group(self.group)
        model = self.prepare(model)
        stages = split_gpt(model, self.n_stages, self.layers_per_stage)
        self.stage_names = [[n for n, _ in s.named_parameters()] for s in stages]
        if self.variant == "ours":
            return self.wrap_stage(stages[self.rank])
        return self._torch_stage(model, stages)

    def _torch_stage(self, model: GPT, stages: list[nn.Module]) -> nn.Module:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                                   ScheduleGPipe, SplitPoint, pipeline)

        device = world().device
        if self.variant == "torch":
            stage = self.wrap_stage(stages[self.rank])
            pstage = PipelineStage(stage, self.rank, self.n_stages, device,
                                   group=self.group)
        else:  # the tracer cuts before the blocks where our split starts a stage
            example = torch.zeros(self.micro_batch, self.cfg.seq_len,
                                  dtype=torch.long, device=device)
            spec = {f"blocks.{s.block_range[0]}": SplitPoint.BEGINNING
                    for s in stages[1:]}
            pstage = pipeline(model, mb_args=(example,), split_spec=spec
                              ).build_stage(self.rank, device, group=self.group)
            stage = pstage.submod

        def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            # our 1/m on the loss; torch's own 1/m (scale_grads, torch >= 2.7) off
            return self.loss(out, tgt) * (self.scale / self.n_micro)

        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule]
        kwargs = {"scale_grads": False} if "scale_grads" in \
            inspect.signature(cls.__init__).parameters else {}
        self.torch_schedule = cls(pstage, self.n_micro, loss_fn=loss_fn, **kwargs)
        return stage

    def check_accumulation(self, micro_batches: int) -> None:
        """A pipeline's schedule already splits each batch into ``n_micro``
        micro-batches and accumulates their gradients: Chapter 8's accumulation
        on top would run the schedule, bubble and all, once per micro-batch."""
        raise ValueError(
            f"gradient accumulation over {micro_batches} micro-batch(es) with "
            f"{self.name}: a pipeline splits its batch into n_micro={self.n_micro} "
            "micro-batches itself; allowed: the default step, with n_micro = "
            f"{self.n_micro} x {micro_batches} for the same accumulated batch")

    def forward_backward(self, wrapped: nn.Module, batch: Batch, loss_fn: Any,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        if loss_fn is not gpt_loss:
            raise ValueError("loss_fn: a pipeline computes its loss on the last "
                             "stage's logits; pass loss= to pipeline_parallel."
                             "parallelism instead")
        if scaler is not None:
            raise ValueError("scaler: the pipeline here takes no GradScaler")
        idx, targets = batch
        self.scale = scale
        last = self.rank == self.n_stages - 1
        if self.variant == "ours":
            shape = (idx.shape[0] // self.n_micro, idx.shape[1], self.cfg.hidden)
            res = pipeline_step(wrapped, idx, targets, n_microbatches=self.n_micro,
                                act_shape=shape, loss_fn=self._scaled,
                                schedule=self.schedule, group=self.group,
                                act_dtype=self.act_dtype)
            self.last_step = res
            return torch.tensor(res.loss / scale, device=idx.device)
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.torch_schedule.step(idx)
        elif last:
            self.torch_schedule.step(target=targets, losses=losses)
        else:
            self.torch_schedule.step()
        loss = torch.stack(losses).sum().detach() / scale if last else \
            torch.zeros((), device=idx.device)
        if self.n_stages > 1:  # every stage reports the loss the last one computed
            dist.broadcast(loss, src=self.peer(self.n_stages - 1), group=self.group)
        return loss

    def _scaled(self, out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        loss = self.loss(out, tgt)
        return loss * self.scale if self.scale != 1.0 else loss

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        """Every stage's tensors on every rank of the pipeline, by the model's names:
        each stage broadcasts its own, one tensor at a time (a name without a
        gradient on its stage is left out)."""
        own = self.stage_state(wrapped, grads)
        if self.n_stages == 1:
            return own
        device = world().device
        out: dict[str, torch.Tensor] = {}
        for s, names in enumerate(self.stage_names):
            src, mine = self.peer(s), s == self.rank
            present = torch.tensor([mine and n in own for n in names],
                                   dtype=torch.uint8, device=device)
            dist.broadcast(present, src=src, group=self.group)
            for n, here in zip(names, present.tolist()):
                if not here:
                    continue
                shape, dtype = self.shapes[n]
                buf = own[n].to(device, dtype) if mine else \
                    torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(buf, src=src, group=self.group)
                out[n] = buf.cpu().clone()
        return out

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage: each stage's sum of squares, summed
        over the pipeline's group."""
        if self.n_stages == 1:
            return clip_by_global_norm(list(wrapped.parameters()), max_norm)
        stages = self.group if self.group is not None else dist.group.WORLD
        return clip_by_global_norm(list(wrapped.parameters()), max_norm, stages)


def parallelism(schedule: str = "1f1b", n_micro: int = 1, *, variant: str = "ours",
                group: Any = None, layers_per_stage: Sequence[int] | None = None,
                loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
                micro_batch: int | None = None,
                act_dtype: torch.dtype = torch.float32) -> PipelineParallel:
    """Pipeline parallelism for :func:`~dtlib.models.run.run_steps`.

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"``.
        n_micro: micro-batches per step ``m`` (must divide the batch).
        variant: ``"ours"`` (:func:`pipeline_step`), ``"torch"`` (our stage in
            ``torch.distributed.pipelining``'s ``PipelineStage`` and its schedule)
            or ``"tracer"`` (``pipeline()`` traces the model and cuts it where our
            balanced split does).
        group: the pipeline's process group; the stage index is the rank in it
            (None: the whole world).
        layers_per_stage: blocks per stage (default: balanced).
        loss: ``loss(logits, targets)`` on the last stage (default: mean
            cross-entropy, the GPT's own loss).
        micro_batch: rows of one micro-batch (``"tracer"`` only: its example).
        act_dtype: dtype of the activations sent between stages (``"ours"``).
    Returns:
        A :class:`PipelineParallel`; ``run_steps(par, build_gpt(cfg), ...)`` trains
        this rank's stage on the whole batch (every stage gets the batch: the first
        uses the inputs, the last the targets).

    Taught in: Chapter 6, "Is it the same training?".
    """
    return PipelineParallel(schedule, n_micro, variant=variant, group=group,
                            layers_per_stage=layers_per_stage, loss=loss,
                            micro_batch=micro_batch, act_dtype=act_dtype)
