"""What Chapter 6 runs: the same training run five ways, to compare them.

Rank functions for :func:`dtlib.runtime.launch.spawn`, shared by the tests and
Chapter 6:
the teaching schedules and ``torch.distributed.pipelining`` (manual ``PipelineStage``
path with ``ScheduleGPipe`` / ``Schedule1F1B``, and the ``pipeline()`` tracer), each a
:func:`dtlib.pipeline_parallel.parallelism` trained by the one loop ``run_steps``, and
the single-process reference (``reference_gpt_run``: ``run_steps`` with the identity),
all training the same untied GPT with SGD with momentum from the same weights.

Taught in: Chapter 6, "Is it the same training?".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.reference import gpt_batches, reference_gpt_run
from dtlib.models.run import RunConfig, TrainState, run_steps
from dtlib.models.sizes import size
from dtlib.pipeline_parallel import lm_loss, parallelism
from dtlib.pipeline_parallel.parallelism import (OUR_V_SCHEDULES, TORCH_SCHEDULES,
                                                 stages_of_rank)
from dtlib.pipeline_parallel.schedules import idle_fractions, pipeline_step
from dtlib.pipeline_parallel.split import split_gpt
from dtlib.pipeline_parallel.zero_bubble import (backward_input, backward_weight,
                                                 gpt_w_bytes, weight_sites)
from dtlib.pipeline_parallel.zero_bubble_v import pipeline_step_v, torch_orders
from dtlib.runtime.dist import world

__all__ = ["PP_GPT", "LR", "OPTIMIZER", "VARIANTS", "SPLIT_VARIANTS",
           "lm_loss", "train_pipeline",
           "reference", "compare_all", "timeline_rank", "stage_idle",
           "split_backward_one_process", "zero_bubble_rank", "mean_durations",
           "v_timeline_rank", "v_schedules_rank"]

# The chapter's GPT, as keyword arguments (ranks rebuild it from these): untied (see
# dtlib.pipeline_parallel.split), 8 blocks so 2 and 4 stages both split evenly, and
# small enough that a step takes milliseconds.
PP_GPT = dataclasses.asdict(size("pipeline"))
LR = 0.05
# SGD with momentum: its step is smooth in the gradient, so the same gradients give
# the same trajectory (AdamW's g / (|g| + eps) turns float noise in a near-zero
# gradient into a step of up to lr).
OPTIMIZER: dict[str, Any] = {"optimizer_class": torch.optim.SGD, "lr": LR,
                             "momentum": 0.9}
# "variant-schedule": "ours" the teaching schedules, "torch" our stages in
# PipelineStage, "tracer" the stages pipeline() cuts.
VARIANTS = ("ours-gpipe", "ours-1f1b", "torch-gpipe", "torch-1f1b", "tracer-gpipe")
#: the teaching ZB-H1 (backward split into B and W), proven beside them by the tests
SPLIT_VARIANTS = ("ours-zb-h1",)


def train_pipeline(gpt: dict, batch: int, n_microbatches: int, steps: int,
                   variant: str = "ours-1f1b", group: dist.ProcessGroup | None = None,
                   loss: Any = lm_loss, chunks: int = 1) -> dict[str, Any]:
    """On every rank of ``group``: train this rank's stage with one variant.

    The stage index is the rank in ``group`` (default: the whole world). Step ``k``
    trains on the reference's batch ``token_batch(cfg, batch, seed=k)``.

    Args:
        gpt: the GPT's fields (:data:`PP_GPT`).
        variant: one of :data:`VARIANTS`, ``"variant-schedule"``.
        loss: ``loss(logits, targets)`` on the last stage (a test plants defects).
        chunks: stages per rank, for torch's multi-stage schedules (Chapter 12).
    Returns:
        ``losses``, every stage's ``grads`` (step 0) and ``params`` (after ``steps``)
        by the model's names, this stage's ``names``, and for the teaching schedules
        ``peak_in_flight`` and the last step's ``events``; for torch's V-shaped
        schedules ``torch_order``, the compute actions torch's schedule runs on every
        rank (:func:`~dtlib.pipeline_parallel.zero_bubble_v.torch_orders`), and
        ``torch_idle_slots``, the ``None`` entries of this rank's list.

    Taught in: Chapter 6, "Is it the same training?".
    """
    kind, schedule = variant.split("-", 1)
    cfg = GPTConfig(**gpt)
    device = world().device
    par = parallelism(schedule, n_microbatches, variant=kind, group=group,
                      loss=loss, micro_batch=batch // n_microbatches,
                      chunks=chunks)
    opt = dict(OPTIMIZER)
    config = RunConfig(steps, optimizer_class=opt.pop("optimizer_class"),
                       optimizer_kwargs=opt)
    stage = par.apply(build_gpt(cfg, seed=0).to(device))
    res = run_steps(par, None, gpt_batches(cfg, batch, device), config,
                    TrainState(stage))
    plan = par.plan(stage)
    out = {"losses": res.losses, "grads": res.grads, "params": res.params,
           "names": plan.stage_names[plan.rank]}
    if plan.torch_schedule is not None and TORCH_SCHEDULES[schedule][2] == "v":
        order = plan.torch_schedule.pipeline_order
        out["torch_order"] = torch_orders(order, plan.n_stages)
        out["torch_idle_slots"] = sum(a is None for a in order[plan.rank])
    if par.last_step is not None:
        out["peak_in_flight"] = par.last_step.peak_in_flight
        out["w_bytes_peak"] = par.last_step.w_bytes_peak
        out["events"] = par.last_step.events
    return out


def reference(gpt: dict, batch: int, steps: int) -> Any:
    """The single process on the whole batch, with the chapter's optimizer.

    Args:
        gpt: the GPT's fields (:data:`PP_GPT`); batch, steps: as the pipelines'.
    Returns:
        ``reference_gpt_run``'s :class:`~dtlib.models.run.RunResult` (the one loop
        with no parallelism; step ``k`` on ``token_batch(cfg, batch, seed=k)``).

    Taught in: Chapter 6, "Is it the same training?".
    """
    opt = dict(OPTIMIZER)
    return reference_gpt_run(GPTConfig(**gpt), batch, steps,
                             optimizer_class=opt.pop("optimizer_class"), **opt)


def _max_diff(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
              names: list[str]) -> float:
    return max((mine[n] - ref[n]).abs().max().item() for n in names)


def compare_all(gpt: dict = PP_GPT, batch: int = 8, n_microbatches: int = 4,
                steps: int = 5, variants: tuple[str, ...] = VARIANTS,
                ref: Any = None) -> dict[str, Any]:
    """On every rank: train with each variant in ``variants`` and compare this
    rank's stage with the single-process reference (computed here unless given).

    Returns:
        ``{variant: {"losses", "loss_diff", "grad_diff", "param_diff", "moved",
        "n_params", "vs_teaching", ...}}`` (a V-shaped schedule on two stages a
        rank, its names those of both) where diffs are max absolute
        differences over this stage's parameters and ``moved`` the largest change
        training made to any of them; ``"ref_losses"``.

    Taught in: Chapter 6, "Is it the same training?"."""
    ref = ref if ref is not None else reference(gpt, batch, steps)
    init = dict(build_gpt(GPTConfig(**gpt), seed=0).named_parameters())
    out: dict[str, Any] = {"ref_losses": ref["losses"]}
    teaching: dict[str, dict[str, torch.Tensor]] = {}
    for variant in variants:
        kind, schedule = variant.split("-", 1)
        v_shaped = schedule in OUR_V_SCHEDULES or (
            kind == "torch" and TORCH_SCHEDULES.get(schedule, ("", 1, ""))[2] == "v")
        r = train_pipeline(gpt, batch, n_microbatches, steps, variant,
                           chunks=2 if v_shaped else 1)
        names = r["names"]
        out[variant] = {
            "losses": r["losses"],
            "loss_diff": max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])),
            "grad_diff": _max_diff(r["grads"], ref["grads"], names),
            "param_diff": _max_diff(r["params"], ref["params"], names),
            "moved": max((ref["params"][n] - init[n].detach()).abs().max().item()
                         for n in names),
            "n_params": sum(r["params"][n].numel() for n in names),
            "peak_in_flight": r.get("peak_in_flight"),
            # library vs teaching schedule of the same kind (None if not run first)
            "vs_teaching": _max_diff(r["params"], teaching[schedule], names)
            if schedule in teaching and kind != "ours" else None,
            # the split backward against the fused one in the same order (1F1B's)
            "vs_1f1b": _max_diff(r["params"], teaching["1f1b"], names)
            if schedule == "zb-h1" and "1f1b" in teaching else None,
            "w_bytes_peak": r.get("w_bytes_peak"),
        }
        if kind == "ours":
            teaching[schedule] = r["params"]
    return out


def timeline_rank(gpt: dict, batch: int, n_microbatches: int,
                  schedules: tuple[str, ...] = ("gpipe", "1f1b"),
                  repeats: int = 3) -> dict[str, Any]:
    """On every rank: measured events of one step per schedule (the fastest of
    ``repeats`` after a warm-up step), this stage's idle fraction and peak in flight.

    Taught in: Chapter 6, "The bubble, measured"."""
    cfg = GPTConfig(**gpt)
    model = build_gpt(cfg, seed=0).to(world().device)
    stage = split_gpt(model, dist.get_world_size())[dist.get_rank()]
    shape = (batch // n_microbatches, cfg.seq_len, cfg.hidden)
    idx, tgt = gpt_batches(cfg, batch, world().device)(0)
    out: dict[str, Any] = {}
    for schedule in schedules:
        results = []
        for _ in range(repeats + 1):
            res = pipeline_step(stage, idx, tgt, n_microbatches=n_microbatches,
                                act_shape=shape, loss_fn=lm_loss, schedule=schedule)
            stage.zero_grad()
            results.append(res)
        out[schedule] = _fastest_repeat(results[1:])
    return out


def _fastest_repeat(results: list[Any]) -> dict[str, Any]:
    """The events and peak of the same repeat on every rank: the one whose slowest
    stage was fastest."""
    spans = torch.tensor([max(e.end for e in r.events) for r in results],
                         device=world().device)
    dist.all_reduce(spans, op=dist.ReduceOp.MAX)
    best = results[int(spans.argmin())]
    return {"events": best.events, "peak_in_flight": best.peak_in_flight}


def stage_idle(per_rank: list[dict[str, Any]], schedule: str) -> list[float]:
    """Idle fraction per stage of a measured step, from :func:`timeline_rank` results.

    Taught in: Chapter 6, "The bubble, measured"."""
    events = [e for r in per_rank for e in r[schedule]["events"]]
    return idle_fractions(events, len(per_rank))



def split_backward_one_process(gpt: dict = PP_GPT, batch: int = 2,
                               seed: int = 1) -> dict[str, Any]:
    """One process, the whole GPT as one stage: ``loss.backward()`` against B then W,
    from the same weights on the same batch.

    Returns:
        ``n_params``; ``bitwise``, how many parameters' gradients are bit-identical;
        ``after_b``, how many had a gradient after B alone (W computes them);
        ``w_bytes``, what the deferred W held, and ``w_bytes_counted``, the chapter's
        count (:func:`dtlib.pipeline_parallel.zero_bubble.gpt_w_bytes`).

    Taught in: Chapter 6, "Splitting the backward".
    """
    cfg = GPTConfig(**gpt)
    fused = split_gpt(build_gpt(cfg, seed=0), 1)[0]
    split = split_gpt(build_gpt(cfg, seed=0), 1)[0]
    idx, tgt = token_batch(cfg, batch, seed=seed)
    lm_loss(fused(idx), tgt).backward()
    with weight_sites(split) as sites:
        out = split(idx)
    _, deferred = backward_input(lm_loss(out, tgt), None, None, sites)  # B
    after_b = sum(p.grad is not None for p in split.parameters())
    held = deferred.nbytes
    backward_weight(deferred)  # W, later
    pairs = list(zip(fused.parameters(), split.parameters()))
    return {"n_params": len(pairs),
            "bitwise": sum(torch.equal(a.grad, b.grad) for a, b in pairs),
            "after_b": after_b, "w_bytes": held,
            "w_bytes_counted": gpt_w_bytes(cfg.hidden, cfg.seq_len, batch,
                                           cfg.n_layers, first=True, last=True,
                                           vocab=cfg.vocab_size)}


def zero_bubble_rank(gpt: dict = PP_GPT, batch: int = 8,
                     timeline_gpt: dict | None = None, timeline_batch: int = 16,
                     n_microbatches: int = 8, steps: int = 5) -> dict[str, Any]:
    """On every rank: ZB-H1 against 1F1B and one process (:func:`compare_all`, with
    four micro-batches as in "Is it the same training?"), and one measured step of
    each (:func:`timeline_rank` on ``timeline_gpt``, default ``gpt``).

    Taught in: Chapter 6, "Splitting the backward".
    """
    return {"compare": compare_all(gpt, batch, 4, steps,
                                   variants=("ours-1f1b", "ours-zb-h1")),
            "timeline": timeline_rank(timeline_gpt or gpt, timeline_batch,
                                      n_microbatches, schedules=("1f1b", "zb-h1"))}


def mean_durations(per_rank: list[dict[str, Any]], schedule: str) -> dict[str, float]:
    """The mean duration of each kind of action ("F", "B", "W") in a measured step,
    over every stage, from :func:`timeline_rank` results.

    Taught in: Chapter 6, "Splitting the backward"."""
    events = [e for r in per_rank for e in r[schedule]["events"]]
    kinds = sorted({e.kind for e in events})
    return {k: sum(e.end - e.start for e in events if e.kind == k)
            / sum(1 for e in events if e.kind == k) for k in kinds}


def v_timeline_rank(gpt: dict, batch: int, n_microbatches: int,
                    repeats: int = 3) -> dict[str, Any]:
    """On every rank: the measured events of one step of our ZB-V
    (:func:`~dtlib.pipeline_parallel.zero_bubble_v.pipeline_step_v`, the GPT cut into
    ``2p`` stages, this rank's two in a V), the fastest of ``repeats`` after a
    warm-up step, as :func:`timeline_rank` picks it.

    Taught in: Chapter 6, "The V: two chunks per rank"."""
    cfg = GPTConfig(**gpt)
    p, rank = dist.get_world_size(), dist.get_rank()
    stages = split_gpt(build_gpt(cfg, seed=0).to(world().device), 2 * p)
    mine = [stages[i] for i in stages_of_rank(rank, p, 2, "v")]
    shape = (batch // n_microbatches, cfg.seq_len, cfg.hidden)
    idx, tgt = gpt_batches(cfg, batch, world().device)(0)
    results = []
    for _ in range(repeats + 1):
        results.append(pipeline_step_v(mine, idx, tgt, n_microbatches=n_microbatches,
                                       act_shape=shape, loss_fn=lm_loss))
        for st in mine:
            st.zero_grad()
    return _fastest_repeat(results[1:])


def v_schedules_rank(gpt: dict = PP_GPT, batch: int = 8, n_microbatches: int = 8,
                     steps: int = 3, timeline_gpt: dict | None = None,
                     timeline_batch: int = 16) -> dict[str, Any]:
    """On every rank: our ZB-V and torch's ``ScheduleZBVZeroBubble`` trained
    ``steps`` steps on the chapter's GPT (two stages per rank, in a V), one step of
    torch's ``ScheduleDualPipeV``, and one measured step of ours
    (:func:`v_timeline_rank` on ``timeline_gpt``, default ``gpt``).

    Returns:
        ``zb-v`` and ``dualpipev``: torch's ``order`` (every rank's compute actions,
        as :func:`~dtlib.pipeline_parallel.zero_bubble_v.torch_orders` reads them)
        and ``idle_slots`` (the ``None`` entries of this rank's list); ``ours``:
        ``param_diff`` (this rank's parameters after ``steps`` against one
        process's), ``same_bits`` (ours and torch's ZB-V: every loss, gradient and
        parameter equal bit for bit) and ``timeline``.

    Taught in: Chapter 6, "The V: two chunks per rank".
    """
    ref = reference(gpt, batch, steps)
    ours = train_pipeline(gpt, batch, n_microbatches, steps, "ours-zb-v", chunks=2)
    zbv = train_pipeline(gpt, batch, n_microbatches, steps, "torch-zb-v", chunks=2)
    dual = train_pipeline(gpt, batch, n_microbatches, 1, "torch-dualpipev", chunks=2)
    same = ours["losses"] == zbv["losses"] and all(
        torch.equal(ours[k][n], zbv[k][n]) for k in ("grads", "params")
        for n in ours[k])
    return {"zb-v": {"order": zbv["torch_order"],
                     "idle_slots": zbv["torch_idle_slots"]},
            "dualpipev": {"order": dual["torch_order"],
                          "idle_slots": dual["torch_idle_slots"]},
            "ours": {"param_diff": _max_diff(ours["params"], ref["params"],
                                             ours["names"]),
                     "same_bits": same,
                     "timeline": v_timeline_rank(timeline_gpt or gpt, timeline_batch,
                                                 n_microbatches)}}
