"""Two dimensions of parallelism, proven equal to one process (Chapter 11).

On 4 gloo ranks as 2 x 2 and on 2 ranks as 1 x 2: our tensor parallel inside our
data parallel on hand-built groups, torch's FSDP2 x TP on a DeviceMesh, HSDP, and
our pipeline inside our data parallel —
each against the single-process run (losses, first-step gradients, parameters after
three AdamW steps), and the bytes on each mesh dimension against the formulas.
"""

from __future__ import annotations

import pytest
import torch

from dtlib.chapters.ch11_multi_dim.runs import (PIPELINE, TINY, all_layouts,
                                               comm_by_dim, reference)
from dtlib.parallel_nd import data_shard, lines_along, rank_grid
from dtlib.runtime import launch

BATCH, STEPS = 8, 3
FP32 = 4  # bytes per element
# Losses and gradients differ from one process only by summation order (fp32).
# Parameters: the key bias gets an exactly-zero gradient in exact arithmetic
# (softmax ignores a constant shift of the scores), so its float gradient is noise
# near 1e-12 that AdamW normalises to a step of up to lr: hence atol 1e-5 there.
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)
PIPELINED = ("pp_dp", "fsdp_pp")


def test_rank_grid_lines():
    grid = rank_grid((2, 2))
    assert grid.tolist() == [[0, 1], [2, 3]]
    assert lines_along(grid, 0) == [[0, 2], [1, 3]]  # dp groups
    assert lines_along(grid, 1) == [[0, 1], [2, 3]]  # tp groups
    cube = rank_grid((2, 2, 2))  # dp, pp, tp
    assert lines_along(cube, 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lines_along(cube, 0) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="sizes"):
        rank_grid((2, 0))
    with pytest.raises(ValueError, match="dim"):
        lines_along(grid, 2)
    with pytest.raises(ValueError, match="parts"):
        data_shard(torch.zeros(6), 0, 4)


@pytest.fixture(scope="module")
def truth():
    return {"gpt": reference(TINY, BATCH, STEPS),
            "pipeline": reference(PIPELINE, BATCH, STEPS)}


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 2)])
def test_2d_layouts_equal_one_process(truth, dp, tp):
    res = launch.spawn(all_layouts, dp * tp, dp, tp, TINY, BATCH, STEPS,
                       stream=False, timeout=300)
    for rank, per_layout in enumerate(res):
        for layout, out in per_layout.items():
            where = f"{layout} rank {rank}"
            ref = truth["pipeline" if layout in PIPELINED else "gpt"]
            torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5,
                                       atol=1e-6, msg=where)
            if layout not in PIPELINED:  # a pipeline rank holds its stage only
                assert out["grads"].keys() == ref["grads"].keys(), where
            for name, g in out["grads"].items():
                torch.testing.assert_close(g, ref["grads"][name], **GRAD_TOL,
                                           msg=f"{where} grad {name}")
            for name, p in out["params"].items():
                torch.testing.assert_close(p, ref["params"][name], **PARAM_TOL,
                                           msg=f"{where} param {name}")
    for layout in PIPELINED:  # the stages cover the model
        stages = set().union(*(r[layout]["params"] for r in res))
        assert stages == set(truth["pipeline"]["params"]), layout

    cfg = TINY
    tp_bytes = 4 * cfg.n_layers * (BATCH // dp) * cfg.seq_len * cfg.hidden * FP32
    for per_layout in res:
        ours, torch_, hsdp = (per_layout[k] for k in ("ours", "torch", "hsdp"))
        assert ours["groups"] == torch_["groups"]  # the mesh is our grid
        by_dim = comm_by_dim(ours)
        # Chapter 5: f and g, two all-reduces forward and two backward per block,
        # of the (micro-batch, seq, hidden) activation; only on the tp groups.
        assert by_dim.get("tp", {}) == ({"all_reduce": tp_bytes} if tp > 1 else {})
        # Chapter 3: each gradient this rank holds, all-reduced once over dp.
        assert by_dim.get("dp", {}) == (
            {"all_reduce": FP32 * ours["local_numel"]} if dp > 1 else {})
        assert "other" not in by_dim
        by_dim = comm_by_dim(torch_)
        assert by_dim.get("tp", {}) == ({"all_reduce": tp_bytes} if tp > 1 else {})
        if dp > 1:  # Chapter 4: the reduce-scatter carries each gradient once
            assert by_dim["dp"]["reduce_scatter"] == FP32 * torch_["local_numel"] * dp
            assert by_dim["dp"]["all_gather"] > by_dim["dp"]["reduce_scatter"]
        by_dim = comm_by_dim(hsdp)
        shard_bytes = FP32 * hsdp["local_numel"]
        assert by_dim["shard"]["reduce_scatter"] == shard_bytes * tp
        # then each gradient shard is all-reduced across the replicas (FSDP2 calls
        # it even when the replicate dimension has one rank: nothing leaves it)
        assert by_dim["replicate"] == {"all_reduce": shard_bytes}
        # Chapter 6, two stages: each micro-batch's activation (micro-batch, seq,
        # hidden) goes forward and its gradient back, on the pp line; Chapter 3:
        # then each stage's gradients cross the dp line once.
        pipe = per_layout["pp_dp"]
        by_dim = comm_by_dim(pipe)
        act = (BATCH // dp) * PIPELINE.seq_len * PIPELINE.hidden * FP32
        assert by_dim["pp"]["send"] == by_dim["pp"]["recv"] == act
        grads = FP32 * sum(g.numel() for g in pipe["grads"].values())
        assert by_dim.get("dp", {}) == ({"all_reduce": grads} if dp > 1 else {})
        # torch's schedule over FSDP2 stages: the same activations on pp (plus a
        # few bytes of shape metadata on the first step); on dp one reduce-scatter
        # of the stage's gradients after the last micro-batch, and the weights'
        # all-gathers, repeated for every micro-batch
        by_dim = comm_by_dim(per_layout["fsdp_pp"])
        assert act <= by_dim["pp"]["send"] <= 1.01 * act
        assert act <= by_dim["pp"]["recv"] <= 1.01 * act
        if dp > 1:
            assert by_dim["dp"]["reduce_scatter"] == grads
            assert by_dim["dp"]["all_gather"] > 2 * grads


def test_3d_dp_pp_tp_on_8_ranks(truth):
    from dtlib.chapters.ch11_multi_dim.runs import train_3d

    ref = truth["pipeline"]
    res = launch.spawn(train_3d, 8, 2, 2, 2, PIPELINE, BATCH, stream=False,
                       timeout=500)
    # Tensor parallelism inside the stages changes more summation orders: the
    # gradients still agree to 1e-6, but AdamW turns gradients below ~1e-7 (its
    # eps is 1e-8) into steps whose sign is float noise, up to lr = 1e-3 per step.
    # Parameters: atol 5e-5, 5 % of one step.
    for rank, out in enumerate(res):
        torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5,
                                   atol=1e-6, msg=f"rank {rank}")
        for name, g in out["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], **GRAD_TOL,
                                       msg=f"rank {rank} grad {name}")
        for name, p in out["params"].items():
            torch.testing.assert_close(p, ref["params"][name], rtol=1e-4, atol=5e-5,
                                       msg=f"rank {rank} param {name}")
    assert set().union(*(r["params"] for r in res)) == set(ref["params"])
    for out in res:  # every dimension carried traffic, none went elsewhere
        assert set(comm_by_dim(out)) == {"dp", "pp", "tp"}
