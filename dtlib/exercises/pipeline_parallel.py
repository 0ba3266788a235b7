"""Checkers for Chapter 6, "Pipeline parallel"."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from dtlib.exercises import WrongAnswer, checker, passed, run_on_ranks
from dtlib.pipeline_parallel.schedules import in_flight_peak, schedule_order

GRID = [(p, m) for p in (1, 2, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


@checker
def check_1f1b_order(order: Callable[[int, int, int], list]) -> None:
    """Check ``order(stage, n_stages, n_microbatches)``: the list of ``("F", i)`` and
    ``("B", i)`` actions stage ``stage`` runs under 1F1B (PipeDream-Flush)."""
    for p, m in GRID:
        for s in range(p):
            want = schedule_order("1f1b", s, p, m)
            got = [tuple(a) for a in order(s, p, m)]
            if got != want:
                k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
                what = (f"action {k} is {got[k]}" if k < len(got) else
                        f"your list ends after {len(got)} actions")
                raise WrongAnswer(
                    f"stage {s} of p={p} with m={m}: {what}, and that is where it "
                    "leaves 1F1B" + ("" if len(got) == len(want) else
                                     f" ({len(got)} actions; 1F1B runs {len(want)})")
                    + ".", "how many forwards does stage s run before its first "
                    "backward can arrive from the last stage? After that warm-up, one "
                    "forward and one backward take turns ('Two schedules').")
    passed("your 1F1B order matches on every stage of p in {1, 2, 4, 8}")


@checker
def check_peak_in_flight(predict: Callable[[str, int, int, int], int]) -> None:
    """Check ``predict(schedule, stage, n_stages, n_microbatches)``: the most
    micro-batches whose activations stage ``stage`` holds at once."""
    for schedule in ("gpipe", "1f1b"):
        for p, m in GRID:
            for s in range(p):
                want = in_flight_peak(schedule_order(schedule, s, p, m))
                got = predict(schedule, s, p, m)
                if got != want:
                    side = "too many" if isinstance(got, (int, float)) and \
                        got > want else "not the right count"
                    raise WrongAnswer(
                        f"{schedule}, stage {s}, p={p}, m={m}: {got!r} is {side}.",
                        "GPipe runs every forward before any backward; 1F1B frees one "
                        "micro-batch for each new one after its warm-up "
                        "('Activation memory in flight').")
    passed("your peak in-flight counts match GPipe and 1F1B on every stage")


# ---- build it: one GPipe step of a two-stage pipeline, on two real ranks -------------

_PP_MICRO, _PP_BATCH, _PP_HIDDEN = 3, 2, 8


def _pp_stages() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(4, _PP_HIDDEN), torch.nn.Tanh()),
            torch.nn.Linear(_PP_HIDDEN, 3)]


def _pp_data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(_PP_BATCH, 4, generator=gen) for _ in range(_PP_MICRO)]
    ys = [torch.randn(_PP_BATCH, 3, generator=gen) for _ in range(_PP_MICRO)]
    return xs, ys


def _pp_on_rank(step: Callable[..., Any]) -> dict[str, Any]:
    """On each of two ranks: the learner's step with this rank's stage and data."""
    import torch.distributed as dist

    rank = dist.get_rank()
    stage = _pp_stages()[rank]
    xs, ys = _pp_data()
    loss = step(stage, xs if rank == 0 else None, ys if rank == 1 else None,
                (_PP_BATCH, _PP_HIDDEN))
    return {"loss": loss, "grads": [None if p.grad is None else p.grad.clone()
                                    for p in stage.parameters()]}


def _pp_truth() -> dict[str, Any]:
    stages = _pp_stages()
    xs, ys = _pp_data()
    losses = [F.mse_loss(stages[1](stages[0](x)), y) / _PP_MICRO
              for x, y in zip(xs, ys)]
    sum(losses).backward()
    return {"loss": sum(l.item() for l in losses),
            "grads": [[p.grad for p in s.parameters()] for s in stages]}


@checker
def check_pipeline_step(step: Callable[..., Any]) -> None:
    """Check ``step(stage, micro_batches, targets, act_shape)`` on two real ranks.

    Rank 0 holds the first stage and the input micro-batches (``targets`` is None),
    rank 1 the second stage and the targets (``micro_batches`` is None); activations
    of shape ``act_shape`` go 0 -> 1 and their gradients 1 -> 0 by send/recv. The loss
    of a micro-batch is ``F.mse_loss(output, target) / len(targets)``. Rank 1 returns
    the summed loss, rank 0 anything; afterwards both stages' gradients must equal one
    process's on the whole batch.
    """
    truth = _pp_truth()
    ranks = run_on_ranks(_pp_on_rank, step, 2, timeout=30,
                         what="your pipeline step")
    loss = ranks[1]["loss"]
    if isinstance(loss, torch.Tensor):
        loss = loss.item()
    if not isinstance(loss, (int, float)) or isinstance(loss, bool):
        raise WrongAnswer(f"rank 1 returned {loss!r}: return the summed loss, a number")
    if abs(loss - truth["loss"] * _PP_MICRO) < 1e-5 * abs(truth["loss"] * _PP_MICRO):
        raise WrongAnswer("the loss is len(targets) times too large.",
                          "each micro-batch's loss is divided by the number of "
                          "micro-batches, so that the step's gradient is the mean's")
    if abs(loss - truth["loss"]) > 1e-5 * abs(truth["loss"]):
        raise WrongAnswer(f"rank 1's summed loss, {loss:.6g}, is not one process's on "
                          "the same micro-batches.")
    for rank, name in ((1, "the second stage (rank 1)"),
                       (0, "the first stage (rank 0)")):
        for got, want in zip(ranks[rank]["grads"], truth["grads"][rank]):
            if got is None:
                raise WrongAnswer(
                    f"{name} has no gradient.", "rank 1 must send each micro-batch's "
                    "activation gradient back (the input's .grad, which needs "
                    "requires_grad_()), and rank 0 must call y.backward(grad) on the "
                    "output it sent ('Two schedules').")
            if torch.allclose(got, want * _PP_MICRO, rtol=1e-4, atol=1e-6):
                raise WrongAnswer(
                    f"{name}: gradients are len(targets) times too large.")
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                raise WrongAnswer(f"{name}: gradients differ from one process's.",
                                  "pair each activation gradient with the output of "
                                  "the same micro-batch")
    passed(f"your two-stage step equals one process: loss and gradients, "
           f"{_PP_MICRO} micro-batches")
