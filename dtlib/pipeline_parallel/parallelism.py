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
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models.gpt import GPT
from dtlib.models.run import (Batch, Parallelism, clip_by_global_norm, gpt_loss,
                              tensors_by_name)
from dtlib.pipeline_parallel.schedules import (SCHEDULES, SPLIT_SCHEDULES, StepResult,
                                               pipeline_step)
from dtlib.pipeline_parallel.split import RankStages, split_gpt
from dtlib.pipeline_parallel.zero_bubble_v import pipeline_step_v
from dtlib.runtime.dist import world

__all__ = ["VARIANTS", "TORCH_SCHEDULES", "OUR_V_SCHEDULES", "lm_loss", "StagePlan",
           "PipelineParallel", "parallelism", "stages_of_rank"]

VARIANTS = ("ours", "torch", "tracer")

#: ``torch.distributed.pipelining``'s schedules by the book's name: the class, how
#: many stages a rank holds (``None``: any number, ``chunks``), and their placement.
TORCH_SCHEDULES: dict[str, tuple[str, int | None, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", None, "loop"),
    "interleaved-zero-bubble": ("ScheduleInterleavedZeroBubble", None, "loop"),
    "zb-v": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
#: Our schedules whose ranks hold two stages in a V (``pipeline_step_v``).
OUR_V_SCHEDULES = ("zb-v",)


def stages_of_rank(rank: int, n_ranks: int, chunks: int, placement: str) -> list[int]:
    """The (virtual) stages rank ``rank`` of ``n_ranks`` holds, ``chunks`` each:
    ``"loop"`` deals them round-robin (``r, r + p, ...``: interleaved), ``"v"`` goes
    down and back up (``r`` and ``2p - 1 - r``: the last stage is on rank 0).

    Taught in: Chapter 12, "Interleaving the pipeline".
    """
    if placement == "v":
        return [rank, 2 * n_ranks - 1 - rank]
    return [rank + k * n_ranks for k in range(chunks)]


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


@dataclass
class StagePlan:
    """What :meth:`PipelineParallel.apply` learned about one model's cut: kept per
    stage it returned, so that ``forward_backward`` and ``full_state`` read the
    plan of the stage they are given, never the last one applied."""

    cfg: Any
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    rank: int
    n_stages: int
    stage_names: list[list[str]]
    torch_schedule: Any = None
    first: bool = False  # this rank holds the first stage (it feeds the inputs)
    last_rank: int = 0  # the rank whose stage computes the loss


class PipelineParallel(Parallelism):
    """One stage per rank of ``group``, trained by a schedule; see :func:`parallelism`.

    Chapter 11's layouts change what happens around the cut through three
    functions given to the constructor: ``prepare`` (the whole model, before the
    cut: e.g. our tensor parallel), ``wrap_stage`` (this rank's stage, after it:
    e.g. FSDP2) and ``stage_state`` (this stage's full tensors by name); see
    :class:`~dtlib.parallel_nd.parts.Composed`.
    """

    def __init__(self, schedule: str = "1f1b", n_micro: int = 1, *,
                 variant: str = "ours", group: Any = None,
                 layers_per_stage: Sequence[int] | None = None,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
                 micro_batch: int | None = None,
                 act_dtype: torch.dtype = torch.float32, chunks: int = 1,
                 prepare: Callable[[GPT], GPT] | None = None,
                 wrap_stage: Callable[[nn.Module], nn.Module] | None = None,
                 stage_state: Callable[[nn.Module, bool], dict[str, torch.Tensor]]
                 | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
        allowed = tuple(TORCH_SCHEDULES) if variant == "torch" else \
            SCHEDULES + (OUR_V_SCHEDULES if variant == "ours" else ())
        if schedule not in allowed:
            raise ValueError(f"schedule={schedule!r} with variant={variant!r}: "
                             f"allowed {allowed}")
        if isinstance(n_micro, bool) or not isinstance(n_micro, int) or n_micro < 1:
            raise ValueError(f"n_micro={n_micro!r} must be a positive integer")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} must be a positive integer")
        per_rank = TORCH_SCHEDULES[schedule][1] if variant == "torch" else \
            (2 if schedule in OUR_V_SCHEDULES else 1)
        if per_rank is not None and chunks != per_rank:
            raise ValueError(f"chunks={chunks} with schedule={schedule!r}: a rank "
                             f"holds exactly {per_rank} stage(s) in that schedule")
        self.chunks = chunks
        if schedule in SPLIT_SCHEDULES + OUR_V_SCHEDULES and (prepare is not None
                                            or wrap_stage is not None):
            raise ValueError(
                f"schedule={schedule!r} splits each backward into B and W by module "
                "calls of a plain stage; with prepare= or wrap_stage= (tensor "
                "parallel, FSDP) allowed: 'gpipe' or '1f1b'")
        if variant == "tracer" and (micro_batch is None or micro_batch < 1):
            raise ValueError(f"variant='tracer' needs micro_batch >= 1 (rows of its "
                             f"example micro-batch), not {micro_batch!r}")
        self.schedule, self.n_micro, self.variant = schedule, n_micro, variant
        self.group, self.layers_per_stage, self.loss = group, layers_per_stage, loss
        self.micro_batch, self.act_dtype = micro_batch, act_dtype
        self.name = f"pp/{variant}-{schedule}" + (f"-v{chunks}" if chunks > 1 else "")
        self.scale = 1.0
        #: the teaching schedule's last :class:`StepResult` (events, peak in flight)
        self.last_step: StepResult | None = None
        self._plans: weakref.WeakKeyDictionary[nn.Module, StagePlan] = \
            weakref.WeakKeyDictionary()
        self._prepare, self._wrap_stage = prepare, wrap_stage
        self._stage_state = stage_state

    def plan(self, wrapped: nn.Module) -> StagePlan:
        """The :class:`StagePlan` of a stage this Parallelism's ``apply`` returned."""
        try:
            return self._plans[wrapped]
        except (KeyError, TypeError):
            raise ValueError(f"wrapped={type(wrapped).__name__} was not returned by "
                             f"this {type(self).__name__}.apply") from None

    # ---- hooks -------------------------------------------------------------------

    def prepare(self, model: GPT) -> GPT:
        """The whole model before it is cut (the constructor's ``prepare``, or
        identity)."""
        return self._prepare(model) if self._prepare is not None else model

    def wrap_stage(self, stage: nn.Module) -> nn.Module:
        """This rank's stage after the cut (the constructor's ``wrap_stage``, or
        identity)."""
        return self._wrap_stage(stage) if self._wrap_stage is not None else stage

    def stage_state(self, stage: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
        """This stage's full parameters (or gradients) by name, CPU copies (the
        constructor's ``stage_state``, or each tensor as it is)."""
        if self._stage_state is not None:
            return self._stage_state(stage, grads)
        return tensors_by_name(stage, grads=grads)

    # ---- the Parallelism ---------------------------------------------------------

    def peer(self, s: int) -> int:
        """The global rank of stage ``s``."""
        return dist.get_global_rank(self.group, s) if self.group is not None else s

    def apply(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, GPT):
            raise ValueError(f"model={type(model).__name__} must be a dtlib GPT")
        shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
        rank, n_stages = _in_group(self.group)
        model = self.prepare(model)
        if self.variant == "torch" and TORCH_SCHEDULES[self.schedule][1] != 1:
            return self._torch_stages(model, shapes, rank, n_stages)
        if self.schedule in OUR_V_SCHEDULES:
            wrapped, _, _ = self._rank_stages(model, shapes, rank, n_stages, "v")
            return wrapped
        stages = split_gpt(model, n_stages, self.layers_per_stage)
        plan = StagePlan(model.cfg, shapes, rank, n_stages,
                         [[n for n, _ in s.named_parameters()] for s in stages],
                         first=rank == 0, last_rank=n_stages - 1)
        if self.variant == "ours":
            stage = self.wrap_stage(stages[rank])
        else:
            stage = self._torch_stage(model, stages, plan)
        self._plans[stage] = plan
        return stage

    def _torch_schedule_class(self) -> Any:
        import torch.distributed.pipelining as pipelining

        name = TORCH_SCHEDULES[self.schedule][0]
        cls = getattr(pipelining, name, None)
        if cls is None:
            raise ValueError(f"schedule={self.schedule!r}: torch {torch.__version__} "
                             f"has no torch.distributed.pipelining.{name}")
        return cls

    def _loss_of_micro_batch(self) -> Callable[[torch.Tensor, torch.Tensor],
                                               torch.Tensor]:
        def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            # our 1/m on the loss; torch's own 1/m (scale_grads, torch >= 2.7) off
            return self.loss(out, tgt) * (self.scale / self.n_micro)
        return loss_fn

    def _schedule(self, cls: Any, stages: Any) -> Any:
        kwargs = {"scale_grads": False} if "scale_grads" in \
            inspect.signature(cls.__init__).parameters else {}
        return cls(stages, self.n_micro, loss_fn=self._loss_of_micro_batch(), **kwargs)

    def _rank_stages(self, model: GPT, shapes: dict[str, Any], rank: int,
                     n_ranks: int, placement: str
                     ) -> tuple[RankStages, StagePlan, list[int]]:
        """The model cut into ``n_ranks * chunks`` stages, this rank's (placed by
        ``placement``, :func:`stages_of_rank`) in a :class:`RankStages`, and which
        stages those are."""
        total = n_ranks * self.chunks
        stages = split_gpt(model, total, self.layers_per_stage)
        held = [stages_of_rank(r, n_ranks, self.chunks, placement)
                for r in range(n_ranks)]
        names = [[n for n, _ in RankStages([stages[i] for i in h]).named_parameters()]
                 for h in held]
        plan = StagePlan(model.cfg, shapes, rank, n_ranks, names)
        plan.first = 0 in held[rank]
        plan.last_rank = next(r for r, h in enumerate(held) if total - 1 in h)
        wrapped = RankStages([self.wrap_stage(stages[i]) for i in held[rank]])
        self._plans[wrapped] = plan
        return wrapped, plan, held[rank]

    def _torch_stages(self, model: GPT, shapes: dict[str, Any], rank: int,
                      n_ranks: int) -> nn.Module:
        """A multi-stage schedule of torch's: :meth:`_rank_stages`, each stage in a
        ``PipelineStage``."""
        from torch.distributed.pipelining import PipelineStage

        cls = self._torch_schedule_class()
        total = n_ranks * self.chunks
        if self.schedule == "dualpipev" and self.n_micro < total:
            raise ValueError(f"n_micro={self.n_micro} with schedule='dualpipev' on "
                             f"{n_ranks} ranks: needs at least {total} micro-batches "
                             "(one per stage)")
        wrapped, plan, held = self._rank_stages(model, shapes, rank, n_ranks,
                                                TORCH_SCHEDULES[self.schedule][2])
        device = world().device
        pstages = [PipelineStage(st, i, total, device, group=self.group)
                   for st, i in zip(wrapped.stages, held)]
        plan.torch_schedule = self._schedule(cls, pstages)
        return wrapped

    def _torch_stage(self, model: GPT, stages: list[nn.Module], plan: StagePlan
                     ) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

        device, rank, n_stages = world().device, plan.rank, plan.n_stages
        if self.variant == "torch":
            stage = self.wrap_stage(stages[rank])
            pstage = PipelineStage(stage, rank, n_stages, device, group=self.group)
        else:  # the tracer cuts before the blocks where our split starts a stage
            example = torch.zeros(self.micro_batch, plan.cfg.seq_len,
                                  dtype=torch.long, device=device)
            spec = {f"blocks.{s.block_range[0]}": SplitPoint.BEGINNING
                    for s in stages[1:]}
            pstage = pipeline(model, mb_args=(example,), split_spec=spec
                              ).build_stage(rank, device, group=self.group)
            stage = pstage.submod

        plan.torch_schedule = self._schedule(self._torch_schedule_class(), pstage)
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
        plan = self.plan(wrapped)
        self.scale = scale
        last = plan.rank == plan.last_rank
        if self.variant == "ours":
            shape = (idx.shape[0] // self.n_micro, idx.shape[1], plan.cfg.hidden)
            if self.schedule in OUR_V_SCHEDULES:
                res = pipeline_step_v(wrapped.stages, idx, targets,
                                      n_microbatches=self.n_micro, act_shape=shape,
                                      loss_fn=self._scaled, group=self.group,
                                      act_dtype=self.act_dtype)
            else:
                res = pipeline_step(wrapped, idx, targets,
                                    n_microbatches=self.n_micro, act_shape=shape,
                                    loss_fn=self._scaled, schedule=self.schedule,
                                    group=self.group, act_dtype=self.act_dtype)
            self.last_step = res
            return torch.tensor(res.loss / scale, device=idx.device)
        losses: list[torch.Tensor] = []
        args = (idx,) if plan.first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if last else {}
        plan.torch_schedule.step(*args, **kwargs)
        loss = torch.stack(losses).sum().detach() / scale if last else \
            torch.zeros((), device=idx.device)
        if plan.n_stages > 1:  # every stage reports the loss the last one computed
            dist.broadcast(loss, src=self.peer(plan.last_rank), group=self.group)
        return loss

    def _scaled(self, out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        loss = self.loss(out, tgt)
        return loss * self.scale if self.scale != 1.0 else loss

    def full_state(self, wrapped: nn.Module, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        """Every stage's tensors on every rank of the pipeline, by the model's names:
        each stage broadcasts its own, one tensor at a time (a name without a
        gradient on its stage is left out)."""
        plan = self.plan(wrapped)
        own = self.stage_state(wrapped, grads)
        if plan.n_stages == 1:
            return own
        device = world().device
        out: dict[str, torch.Tensor] = {}
        for s, names in enumerate(plan.stage_names):
            src, mine = self.peer(s), s == plan.rank
            present = torch.tensor([mine and n in own for n in names],
                                   dtype=torch.uint8, device=device)
            dist.broadcast(present, src=src, group=self.group)
            for n, here in zip(names, present.tolist()):
                if not here:
                    continue
                shape, dtype = plan.shapes[n]
                buf = own[n].to(device, dtype) if mine else \
                    torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(buf, src=src, group=self.group)
                out[n] = buf.cpu().clone()
        return out

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage: each stage's sum of squares, summed
        over the pipeline's group."""
        if self.plan(wrapped).n_stages == 1:
            return clip_by_global_norm(list(wrapped.parameters()), max_norm)
        stages = self.group if self.group is not None else dist.group.WORLD
        return clip_by_global_norm(list(wrapped.parameters()), max_norm, stages)


def parallelism(schedule: str = "1f1b", n_micro: int = 1, *, variant: str = "ours",
                group: Any = None, layers_per_stage: Sequence[int] | None = None,
                loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
                micro_batch: int | None = None,
                act_dtype: torch.dtype = torch.float32, chunks: int = 1
                ) -> PipelineParallel:
    """Pipeline parallelism for :func:`~dtlib.models.run.run_steps`.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"``, ``"zb-h1"`` (ours only: the backward
            split into B and W, Chapter 6) or ``"zb-v"`` (ours: ``chunks=2``, two
            stages per rank in a V, :func:`pipeline_step_v`); with
            ``variant="torch"`` also torch's multi-stage schedules
            (:data:`TORCH_SCHEDULES`): ``"interleaved-1f1b"``,
            ``"interleaved-zero-bubble"`` (``chunks`` stages per rank, round-robin),
            ``"zb-v"`` and ``"dualpipev"`` (two stages per rank in a V).
        n_micro: micro-batches per step ``m`` (must divide the batch).
        variant: ``"ours"`` (:func:`pipeline_step`), ``"torch"`` (our stage in
            ``torch.distributed.pipelining``'s ``PipelineStage`` and its schedule)
            or ``"tracer"`` (``pipeline()`` traces the model and cuts it where our
            balanced split does).
        group: the pipeline's process group; the stage index is the rank in it
            (None: the whole world).
        layers_per_stage: blocks per stage, one entry per (virtual) stage
            (default: balanced).
        loss: ``loss(logits, targets)`` on the last stage (default: mean
            cross-entropy, the GPT's own loss).
        micro_batch: rows of one micro-batch (``"tracer"`` only: its example).
        act_dtype: dtype of the activations sent between stages (``"ours"``).
        chunks: stages per rank (``v``), for the multi-stage schedules.
    Returns:
        A :class:`PipelineParallel`; ``run_steps(par, build_gpt(cfg), ...)`` trains
        this rank's stage on the whole batch (every stage gets the batch: the first
        uses the inputs, the last the targets).

    Taught in: Chapter 6, "Is it the same training?".
    """
    return PipelineParallel(schedule, n_micro, variant=variant, group=group,
                            layers_per_stage=layers_per_stage, loss=loss,
                            micro_batch=micro_batch, act_dtype=act_dtype,
                            chunks=chunks)
