"""Chapter 12: interleaved pipeline schedules.

The simulator's bubble equals Narayanan et al.'s (1/v)(p-1)/m exactly (rel 1e-12:
sums of fractions of time units); ``v = 1`` reproduces Chapter 6's 1F1B. torch's
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` and the V-shaped
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, and our ZB-V (``pipeline_step_v``,
bit for bit torch's ZB-V), train Chapter 6's GPT, inside the
one loop, equal to one process on 2 and 4 ranks (one launch each), with Chapter 6's
optimizer (SGD with momentum) and its derived tolerances (``test_pipeline_parallel``:
a few units of fp32 rounding per term summed).
"""

from __future__ import annotations

import pytest
import torch

from test_pipeline_parallel import _scale, grad_rel, loss_rel, param_atol

from dtlib.chapters.ch06_pipeline_parallel.runs import (PP_GPT, reference,
                                                       train_pipeline)
from dtlib.chapters.ch12_long_sequences.runs import train_interleaved
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.pipeline_parallel.interleaved import (interleaved_bubble, interleaved_order,
                                                 simulate_interleaved)
from dtlib.pipeline_parallel.schedules import simulate
from dtlib.pipeline_parallel.zero_bubble_v import play_v, zbv_orders
from dtlib.runtime import launch

SCHEDULES = ("interleaved-1f1b", "interleaved-zero-bubble", "zb-v", "dualpipev")


def _bubble(events, m: int, t_f: float = 1.0, t_b: float = 2.0) -> float:
    span = max(e.end for e in events) - min(e.start for e in events)
    return (span - m * (t_f + t_b)) / (m * (t_f + t_b))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 4),
                                   (8, 3, 16), (4, 2, 12)])
def test_simulated_bubble_is_the_formula(p: int, v: int, m: int) -> None:
    events = simulate_interleaved(p, v, m)
    assert _bubble(events, m) == pytest.approx(interleaved_bubble(p, v, m), rel=1e-12)
    for r in range(p):  # every (micro-batch, chunk) forward and backward once
        acts = interleaved_order(r, p, v, m)
        assert sorted(acts) == sorted((k, i, c) for k in "BF" for i in range(m)
                                      for c in range(v))


def test_one_chunk_is_chapter_6_1f1b() -> None:
    p, m = 4, 8
    ours = simulate_interleaved(p, 1, m)
    ch6 = simulate("1f1b", p, m)
    assert max(e.end for e in ours) == max(e.end for e in ch6)
    assert _bubble(ours, m) == pytest.approx((p - 1) / m)


def test_bad_micro_batch_count_is_named() -> None:
    with pytest.raises(ValueError, match="n_microbatches=6 must be divisible"):
        interleaved_order(0, 4, 2, 6)


def both_schedules(batch: int, m: int, steps: int, v: int) -> dict:
    """On every rank: each interleaved schedule in turn, then our ZB-V (one launch)."""
    out = {s: train_interleaved(PP_GPT, batch, m, steps, v, s) for s in SCHEDULES}
    out["ours-zb-v"] = train_pipeline(PP_GPT, batch, m, steps, "ours-zb-v", chunks=2)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_interleaved_schedules_equal_one_process(world_size: int) -> None:
    # m = 2p: DualPipeV needs a micro-batch per stage (2 stages per rank)
    batch, m, steps, v = 8, 2 * world_size, 2, 2
    ref = reference(PP_GPT, batch, steps)
    g = _scale(ref)
    res = launch.spawn(both_schedules, world_size, batch, m, steps, v, stream=False,
                       timeout=240)
    for schedule in SCHEDULES + ("ours-zb-v",):
        runs = [r[schedule] for r in res]
        assert set().union(*(r["params"] for r in runs)) == set(ref["params"])
        for r in runs:
            torch.testing.assert_close(r["losses"], ref["losses"], atol=0,
                                       rtol=loss_rel(batch))
            for n, t in r["grads"].items():
                torch.testing.assert_close(t, ref["grads"][n], rtol=0,
                                           atol=grad_rel(batch) * g, msg=n)
            for n, q in r["params"].items():
                torch.testing.assert_close(q, ref["params"][n], rtol=0,
                                           atol=param_atol(batch, steps, g), msg=n)
    # torch's ZB-V runs our action lists, action by action; DualPipeV's lists are
    # valid V lists (every F, B, W once; they play without deadlock)
    n = world_size
    assert [r["zb-v"]["torch_order"] for r in res] == [zbv_orders(n, m)] * n
    dual = res[0]["dualpipev"]["torch_order"]
    for order in dual:
        assert sorted(order) == sorted((k, i, c) for k in "FBW" for i in range(m)
                                       for c in (0, 1))
    play_v(dual)
    # our ZB-V (pipeline_step_v) runs the same lists as torch's, with the same
    # kernels on the same operands in the same order: the same bits, on any machine
    for r in res:
        for key in ("losses", "grads", "params"):
            ours, theirs = r["ours-zb-v"][key], r["zb-v"][key]
            if key == "losses":
                assert torch.equal(torch.as_tensor(ours), torch.as_tensor(theirs))
            else:
                assert ours.keys() == theirs.keys()
                assert all(torch.equal(ours[n], theirs[n]) for n in ours), key
    # not vacuous: training moved the parameters far more than the tolerance
    start = build_gpt(GPTConfig(**PP_GPT), seed=0).state_dict()
    moved = max((ref["params"][n] - start[n]).abs().max().item() for n in ref["params"])
    assert moved > 100 * param_atol(batch, steps, g)


def test_a_schedule_names_the_stages_a_rank_may_hold() -> None:
    from dtlib.pipeline_parallel import parallelism
    from dtlib.pipeline_parallel.parallelism import PipelineParallel

    with pytest.raises(ValueError, match="chunks=3 with schedule='zb-v'"):
        parallelism("zb-v", 4, variant="torch", chunks=3)
    with pytest.raises(ValueError, match="chunks=1 with schedule='zb-v'"):
        parallelism("zb-v", 4)  # ours holds two stages a rank in a V too
    with pytest.raises(ValueError, match="schedule='zb-v' with variant='tracer'"):
        parallelism("zb-v", 4, variant="tracer", chunks=2, micro_batch=1)
    with pytest.raises(ValueError, match="splits each backward into B and W"):
        PipelineParallel("zb-v", 4, chunks=2, wrap_stage=lambda s: s)
    # one process: 2 stages in the V, so DualPipeV needs 2 micro-batches
    with pytest.raises(ValueError, match="n_micro=1 with schedule='dualpipev'"):
        parallelism("dualpipev", 1, variant="torch", chunks=2).apply(
            build_gpt(GPTConfig(**PP_GPT), seed=0))
