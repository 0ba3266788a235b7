"""Pipeline parallelism, part 3: the same training run three ways, to compare them.

Rank functions for :func:`dtlib.runtime.launch.spawn`, shared by the tests and Chapter 6:
the teaching schedules (:mod:`dtlib.pipeline_parallel.schedules`), ``torch.distributed.pipelining``
(manual ``PipelineStage`` path, ``ScheduleGPipe`` / ``Schedule1F1B``), and the single-
process reference, all training the same untied GPT with AdamW from the same weights.

Taught in: Chapter 6, "Is it the same training?".
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.runtime.dist import world
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.pipeline_parallel.split import split_gpt
from dtlib.pipeline_parallel.schedules import idle_fractions, pipeline_step
from dtlib.models.reference import train_reference

import dataclasses

from dtlib.models.sizes import size

__all__ = ["PP_GPT", "lm_loss", "reference_training", "train_teaching", "train_torch",
           "compare_all", "timeline_rank", "stage_idle"]

#: The chapter's GPT: untied (see :mod:`dtlib.pipeline_parallel`), 8 blocks so 2 and 4
#: stages both split evenly, and small enough that a step takes milliseconds.
#: The pipeline chapter's GPT, as keyword arguments (ranks rebuild it from these).
PP_GPT = dataclasses.asdict(size("pipeline"))
LR = 1e-2
#: ``library-schedule``; "torch" is the manual PipelineStage path, "tracer" pipeline().
IMPLS = ("teaching-gpipe", "teaching-1f1b", "torch-gpipe", "torch-1f1b", "tracer-gpipe")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits ``(b, s, V)``, targets ``(b, s)``."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _batch(cfg: GPTConfig, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(cfg, batch, seed=100 + step, device=world().device)


def reference_training(gpt: dict, batch: int, steps: int) -> dict[str, Any]:
    """One process, whole batch: losses per step, gradients of step 0, final params.

    Taught in: Chapter 6, "Is it the same training?"."""
    cfg = GPTConfig(**gpt)
    model = build_gpt(cfg, seed=0).to(world().device)
    batches = (_batch(cfg, batch, step) for step in range(steps))
    return train_reference(model, batches, optimizer=_opt(model.parameters()),
                           loss_fn=lambda m, idx, tgt: lm_loss(m(idx), tgt))


def _my_stage(cfg: GPTConfig, group: dist.ProcessGroup | None = None):
    model = build_gpt(cfg, seed=0).to(world().device)
    stages = split_gpt(model, dist.get_world_size(group))
    return stages[dist.get_rank(group)]


def train_teaching(gpt: dict, batch: int, n_microbatches: int, steps: int,
                   schedule: str, group: dist.ProcessGroup | None = None
                   ) -> dict[str, Any]:
    """On every rank: train this rank's stage with the teaching schedule; the stage
    index is the rank in ``group`` (default: the whole world).

    Returns:
        ``losses``, this stage's ``grads`` (step 0) and ``params`` (after ``steps``),
        ``peak_in_flight`` and the last step's ``events``.

    Taught in: Chapter 6, "Is it the same training?"."""
    cfg = GPTConfig(**gpt)
    stage = _my_stage(cfg, group)
    opt = _opt(stage.parameters())
    shape = (batch // n_microbatches, cfg.seq_len, cfg.hidden)
    losses, grads, res = [], {}, None
    for step in range(steps):
        idx, tgt = _batch(cfg, batch, step)
        opt.zero_grad()
        res = pipeline_step(stage, idx, tgt, n_microbatches=n_microbatches,
                            act_shape=shape, loss_fn=lm_loss, schedule=schedule,
                            group=group)
        if step == 0:
            grads = {n: p.grad.detach().cpu().clone()
                     for n, p in stage.named_parameters()}
        opt.step()
        losses.append(res.loss)
    return {"losses": losses, "grads": grads, "peak_in_flight": res.peak_in_flight,
            "events": res.events,
            "params": {n: p.detach().cpu().clone()
                       for n, p in stage.named_parameters()}}


def train_torch(gpt: dict, batch: int, n_microbatches: int, steps: int,
                schedule: str, frontend: str = "manual") -> dict[str, Any]:
    """On every rank: the same training with ``torch.distributed.pipelining``.

    ``frontend="manual"``: our own :class:`~dtlib.pipeline_parallel.GPTStage` wrapped
    in a ``PipelineStage(submodule, stage_index, num_stages, device)``.
    ``frontend="tracer"``: ``pipeline(model, mb_args=(micro_batch,), split_spec=...)``
    traces the whole model and cuts it before the blocks where our balanced split
    starts a stage, then ``pipe.build_stage(rank, device)``. Both keep the original
    parameter names, so both compare with the reference by name. The loss
    function divides by ``m`` and ``scale_grads`` (torch >= 2.7) is turned off, so the
    gradient means the same thing on every torch version.

    Taught in: Chapter 6, "The library: torch.distributed.pipelining"."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                               ScheduleGPipe, SplitPoint, pipeline)

    cfg = GPTConfig(**gpt)
    w = world()
    if frontend == "manual":
        stage_mod = _my_stage(cfg)
        pstage = PipelineStage(stage_mod, w.rank, w.world_size, w.device)
    elif frontend == "tracer":
        model = build_gpt(cfg, seed=0).to(w.device)
        starts = [s.block_range[0] for s in split_gpt(model, w.world_size)[1:]]
        example = _batch(cfg, batch, 0)[0][: batch // n_microbatches]
        pipe = pipeline(model, mb_args=(example,), split_spec={
            f"blocks.{i}": SplitPoint.BEGINNING for i in starts})
        pstage = pipe.build_stage(w.rank, w.device)
        stage_mod = pstage.submod
    else:
        raise ValueError(f"frontend={frontend!r} must be 'manual' or 'tracer'")

    def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return lm_loss(out, tgt) / n_microbatches

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    kwargs = {"scale_grads": False} if "scale_grads" in \
        inspect.signature(cls.__init__).parameters else {}
    sched = cls(pstage, n_microbatches, loss_fn=loss_fn, **kwargs)
    opt = _opt(stage_mod.parameters())
    losses, grads = [], {}
    first, last = w.rank == 0, w.rank == w.world_size - 1
    for step in range(steps):
        idx, tgt = _batch(cfg, batch, step)
        opt.zero_grad()
        mb_losses: list[torch.Tensor] = []
        if first:
            sched.step(idx)
        elif last:
            sched.step(target=tgt, losses=mb_losses)
        else:
            sched.step()
        loss = torch.stack(mb_losses).sum().detach() if last else \
            torch.zeros((), device=w.device)
        dist.broadcast(loss, src=w.world_size - 1)
        if step == 0:
            grads = {n: p.grad.detach().cpu().clone()
                     for n, p in stage_mod.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().cpu().clone()
                       for n, p in stage_mod.named_parameters()}}


def _max_diff(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((mine[n] - ref[n]).abs().max().item() for n in mine)


def compare_all(gpt: dict = PP_GPT, batch: int = 8, n_microbatches: int = 4,
                steps: int = 5, impls: tuple[str, ...] = IMPLS,
                ) -> dict[str, Any]:
    """On every rank: train with each implementation in ``impls`` and compare this
    rank's stage with the single-process reference (computed here, on the whole batch).

    Returns:
        ``{impl: {"losses", "loss_diff", "grad_diff", "param_diff", "moved",
        "n_params", "vs_teaching", ...}}`` where diffs are max absolute
        differences over this stage's parameters and ``moved`` the largest change
        training made to any of them.

    Taught in: Chapter 6, "Is it the same training?"."""
    ref = reference_training(gpt, batch, steps)
    init = build_gpt(GPTConfig(**gpt), seed=0)
    out: dict[str, Any] = {"ref_losses": ref["losses"]}
    teaching: dict[str, dict[str, torch.Tensor]] = {}
    for impl in impls:
        lib, schedule = impl.split("-")
        if lib == "teaching":
            r = train_teaching(gpt, batch, n_microbatches, steps, schedule)
        else:
            r = train_torch(gpt, batch, n_microbatches, steps, schedule,
                            "tracer" if lib == "tracer" else "manual")
        names = list(r["params"])
        init_params = dict(init.named_parameters())
        out[impl] = {
            "losses": r["losses"],
            "loss_diff": max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])),
            "grad_diff": _max_diff(r["grads"], ref["grads"]),
            "param_diff": _max_diff(r["params"], ref["params"]),
            "moved": max((ref["params"][n] - init_params[n].detach()).abs().max().item()
                         for n in names),
            "n_params": sum(r["params"][n].numel() for n in names),
            "peak_in_flight": r.get("peak_in_flight"),
            # library vs teaching schedule of the same kind (None if not run first)
            "vs_teaching": _max_diff(r["params"], teaching[schedule])
            if schedule in teaching and lib != "teaching" else None,
        }
        if lib == "teaching":
            teaching[schedule] = r["params"]
    return out


def timeline_rank(gpt: dict, batch: int, n_microbatches: int,
                  schedules: tuple[str, ...] = ("gpipe", "1f1b"),
                  repeats: int = 3) -> dict[str, Any]:
    """On every rank: measured events of one step per schedule (the fastest of
    ``repeats`` after a warm-up step), this stage's idle fraction and peak in flight.

    Taught in: Chapter 6, "The bubble, measured"."""
    cfg = GPTConfig(**gpt)
    stage = _my_stage(cfg)
    shape = (batch // n_microbatches, cfg.seq_len, cfg.hidden)
    idx, tgt = _batch(cfg, batch, 0)
    out: dict[str, Any] = {}
    for schedule in schedules:
        results = []
        for _ in range(repeats + 1):
            res = pipeline_step(stage, idx, tgt, n_microbatches=n_microbatches,
                                act_shape=shape, loss_fn=lm_loss, schedule=schedule)
            stage.zero_grad()
            results.append(res)
        # Pick the same repeat on every rank: the one whose slowest stage was fastest.
        spans = torch.tensor([max(e.end for e in r.events) for r in results[1:]],
                             device=world().device)
        dist.all_reduce(spans, op=dist.ReduceOp.MAX)
        best = results[1 + int(spans.argmin())]
        out[schedule] = {"events": best.events, "peak_in_flight": best.peak_in_flight}
    return out


def stage_idle(per_rank: list[dict[str, Any]], schedule: str) -> list[float]:
    """Idle fraction per stage of a measured step, from :func:`timeline_rank` results.

    Taught in: Chapter 6, "The bubble, measured"."""
    events = [e for r in per_rank for e in r[schedule]["events"]]
    return idle_fractions(events, len(per_rank))

