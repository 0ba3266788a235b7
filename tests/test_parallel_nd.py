"""Two and three dimensions of parallelism, proven equal to one process (Chapter 11).

On 4 gloo ranks as 2 x 2 and on 2 ranks as 1 x 2: our tensor parallel inside our
data parallel on hand-built groups, torch's FSDP2 x TP on a DeviceMesh, HSDP, our
pipeline inside our data parallel and torch's schedule over FSDP2 stages; on 8 ranks
dp x pp x tp. Each is one ``parallel_nd.parallelism`` trained by the one loop with
SGD with momentum, against the single-process run (losses, first-step gradients,
parameters after three steps: every rank gathers every stage and shard), and the
bytes on each mesh dimension against the formulas. One launch per world size; the
references once, here; planted defects (a dp group that forgets the average, every
replica on the same rows) must fail the same comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.chapters.ch11_multi_dim.runs import (LR, PIPELINE, TINY, all_layouts,
                                               comm_by_dim, reference, train,
                                               train_3d)
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.run import Parallelism, RunConfig, run_steps
from dtlib.data_parallel import rows_of_rank
from dtlib.parallel_nd import (build_grid_groups, lines_along,
                               parallelism, rank_grid)
from dtlib.parallel_nd.parallelism import layout_parts
from dtlib.parallel_nd.parts import (AverageAfterBackward, Composed, DataPart,
                                     Fsdp2, OurDataParallel, OurTensorParallel,
                                     Pipeline)
from dtlib.runtime import launch
from dtlib.runtime.dist import world

BATCH, STEPS = 8, 3
FP32 = 4  # bytes per element
PIPELINED = ("pp_dp", "fsdp_pp")
U = 2.0 ** -24  # fp32 unit roundoff


def bounds(cfg: GPTConfig, dp: int, steps: int = STEPS) -> dict[str, float]:
    """What a layout and one process can differ by: the same fp32 arithmetic in
    another order, relative to the magnitudes summed.

    A length-n sum or dot product in any order is within n*u of the exact value,
    relative to the sum of its terms' magnitudes (Higham's gamma_n). A layout
    changes orders only: tp splits each dot product of length <= 4 * hidden into
    partial sums added by an all-reduce; micro-batches and dp replicas split the
    batch * seq_len terms of the loss and of each weight gradient into partial sums
    added after (dp more terms). Forward: n_layers + 1 such dot products deep, then
    the mean loss; backward: as deep again.

    SGD with momentum 0.9: after K steps a parameter moved by lr times at most
    K(K+1)/2 gradients (sum_k sum_{j<=k} 0.9^(k-j) <= sum_k (k+1)); twice that for
    the parameter differences feeding back into later gradients (a few steps of a
    small lr: lr * |curvature| well below 1).

    Returns:
        ``loss`` (relative), ``grad`` (relative to the model's largest gradient
        entry), ``param`` (the same, for parameters).
    """
    depth = (cfg.n_layers + 1) * 4 * cfg.hidden
    terms = BATCH * cfg.seq_len + dp
    grad = U * (2 * depth + terms)
    return {"loss": U * (depth + terms), "grad": grad,
            "param": 2 * LR * steps * (steps + 1) / 2 * grad}


def _scale(ref) -> float:
    """The largest gradient entry: the magnitude the bounds are relative to (a
    near-zero gradient, e.g. the key bias's, is a sum of such terms that cancel)."""
    return max(g.abs().max().item() for g in ref["grads"].values())


def compare(out: dict, ref, cfg: GPTConfig, dp: int, where: str) -> None:
    b, g = bounds(cfg, dp), _scale(ref)
    assert out["grads"].keys() == ref["grads"].keys(), where
    assert out["params"].keys() == ref["params"].keys(), where
    for name, t in out["grads"].items():
        torch.testing.assert_close(t, ref["grads"][name], rtol=0, atol=b["grad"] * g,
                                   msg=f"{where} grad {name}")
    torch.testing.assert_close(out["losses"], ref["losses"], rtol=b["loss"], atol=0,
                               msg=f"{where} losses")
    for name, t in out["params"].items():
        torch.testing.assert_close(t, ref["params"][name], rtol=0,
                                   atol=b["param"] * g, msg=f"{where} param {name}")


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
    with pytest.raises(ValueError, match="world_size=4 must divide"):
        rows_of_rank((torch.zeros(6),), 0, 4)
    with pytest.raises(ValueError, match="rank=2"):
        rows_of_rank((torch.zeros(6),), 2, 2)


def test_factory_rejects_bad_arguments():
    with pytest.raises(ValueError, match="layout"):
        parallelism("zero_tp")
    with pytest.raises(ValueError, match="mesh"):
        parallelism("fsdp_tp")
    with pytest.raises(ValueError, match="grid"):
        parallelism("tp_dp", grid=None)


class ForgetsTheAverage(DataPart):
    """A planted defect: each replica trains on its rows and keeps their gradients."""


class SameRows(OurDataParallel):
    """A planted defect: every replica trains on replica 0's rows."""

    def rows(self, batch):
        return rows_of_rank(batch, 0, self.size)


def planted(layout: str, grid, defect: type, **kwargs) -> Composed:
    """``layout``'s parts with its data part replaced by ``defect`` on the same
    group, coordinate and size."""
    parts = layout_parts(layout, grid=grid, **kwargs)
    return Composed([defect(p.group, p.coord, p.size, p.label)
                     if isinstance(p, DataPart) else p for p in parts])


def defects() -> dict:
    """On 4 ranks: the planted defects, each trained as its layout is."""
    grid = build_grid_groups(("dp", "pp"), (2, 2))
    forgets = train(planted("pp_dp", grid, ForgetsTheAverage, n_micro=2), PIPELINE,
                    BATCH, STEPS)
    grid = build_grid_groups(("dp", "tp"), (2, 2))
    same = train(planted("tp_dp", grid, SameRows), TINY, BATCH, STEPS)
    return {"forgets_average": forgets, "same_rows": same}


MAX_NORM = 0.5  # below the gradient norms of these runs: clipping acts every step


def clipped_run(par, cfg: GPTConfig) -> dict:
    """``run_steps`` with gradient clipping (one process when ``par`` is the
    identity): the global norm over every stage and shard."""
    device = world().device
    config = RunConfig(STEPS, optimizer_class=torch.optim.SGD,
                       optimizer_kwargs={"lr": LR, "momentum": 0.9},
                       max_grad_norm=MAX_NORM)
    res = run_steps(par, build_gpt(cfg, 0).to(device), gpt_batches(cfg, BATCH, device),
                    config)
    return {"losses": res.losses, "grads": res.grads, "params": res.params,
            "norms": res.grad_norms}


def clipped() -> dict:
    """On 4 ranks: FSDP2 x TP (DTensors on two meshes) and our pipeline inside our
    data parallel (a norm summed over the stages), both clipped."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(world().device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    grid = build_grid_groups(("dp", "pp"), (2, 2))
    return {"fsdp_tp": clipped_run(parallelism("fsdp_tp", mesh=mesh), TINY),
            "pp_dp": clipped_run(parallelism("pp_dp", grid=grid, n_micro=2),
                                 PIPELINE)}


def new_list() -> dict:
    """On 4 ranks: a combination no layout names, written as its list of parts:
    our Megatron layers on ``mesh["tp"]``'s group, then FSDP2 on ``mesh["dp"]``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(world().device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    par = Composed([OurTensorParallel(mesh["tp"].get_group(), 2),
                    Fsdp2(dp, dp.get_local_rank(), dp.size(), "fsdp2")])
    return train(par, TINY, BATCH, STEPS)


def all_runs(dp: int, inner: int) -> dict:
    """On every rank: every 2-D layout; on 4 ranks the defects, clipping and a new
    list of parts too."""
    out = {"layouts": all_layouts(dp, inner, TINY, BATCH, STEPS)}
    if dist.get_world_size() == 4:
        out["defects"] = defects()
        out["clipped"] = clipped()
        out["new_list"] = new_list()
    return out


@pytest.fixture(scope="module")
def truth():
    return {"gpt": reference(TINY, BATCH, STEPS),
            "pipeline": reference(PIPELINE, BATCH, STEPS)}


@pytest.fixture(scope="module")
def launched():
    """One launch per grid (run the first time a test asks)."""
    cache: dict = {}

    def get(dp: int, tp: int) -> list[dict]:
        if (dp, tp) not in cache:
            cache[dp, tp] = launch.spawn(all_runs, dp * tp, dp, tp, stream=False,
                                         timeout=400)
        return cache[dp, tp]
    return get


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 2)])
def test_2d_layouts_equal_one_process(truth, launched, dp, tp):
    res = launched(dp, tp)
    for rank, r in enumerate(res):
        for layout, out in r["layouts"].items():
            pipelined = layout in PIPELINED
            compare(out, truth["pipeline" if pipelined else "gpt"],
                    PIPELINE if pipelined else TINY, dp, f"{layout} rank {rank}")


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 2)])
def test_bytes_per_dimension(launched, dp, tp):
    cfg = TINY
    tp_bytes = 4 * cfg.n_layers * (BATCH // dp) * cfg.seq_len * cfg.hidden * FP32
    for r in launched(dp, tp):
        per_layout = r["layouts"]
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
        grads = FP32 * sum(pipe["grads"][n].numel() for n in pipe["stage_names"])
        assert by_dim.get("dp", {}) == ({"all_reduce": grads} if dp > 1 else {})
        # torch's schedule over FSDP2 stages: the same activations on pp; on dp one
        # reduce-scatter of the stage's gradients after the last micro-batch, and
        # the weights' all-gathers, repeated for every micro-batch
        by_dim = comm_by_dim(per_layout["fsdp_pp"])
        assert act <= by_dim["pp"]["send"] <= 1.01 * act
        assert act <= by_dim["pp"]["recv"] <= 1.01 * act
        if dp > 1:
            assert by_dim["dp"]["reduce_scatter"] == grads
            assert by_dim["dp"]["all_gather"] > 2 * grads


def test_a_new_combination_is_a_new_list(truth, launched):
    """Our tensor parallel under FSDP2 is no layout of the factory: its parts,
    applied in order, train as one process does."""
    for rank, r in enumerate(launched(2, 2)):
        compare(r["new_list"], truth["gpt"], TINY, 2, f"our tp in fsdp2 rank {rank}")


def test_parts_that_cannot_compose_are_refused():
    a = AverageAfterBackward(None, 0, 2, "dp2")
    pipe = Pipeline(None, 2, "1f1b", 2)
    with pytest.raises(ValueError, match="at most one data part"):
        Composed([a, AverageAfterBackward(None, 0, 2, "dp2")])
    with pytest.raises(ValueError, match="one tensor part"):
        Composed([OurTensorParallel(None, 2), OurTensorParallel(None, 2)])
    with pytest.raises(ValueError, match="data part must come after the Pipeline"):
        Composed([a, pipe])
    with pytest.raises(ValueError, match="non-empty list of Part"):
        Composed([])
    with pytest.raises(ValueError, match="clipping is not implemented for tp2xpp2"):
        Composed([OurTensorParallel(None, 2), pipe]).clip_grad_norm(
            torch.nn.Linear(2, 2), 1.0)


def test_tolerances_catch_planted_defects(truth, launched):
    for rank, r in enumerate(launched(2, 2)):
        d = r["defects"]
        with pytest.raises(AssertionError, match="grad"):
            compare(d["forgets_average"], truth["pipeline"], PIPELINE, 2,
                    f"forgets rank {rank}")
        with pytest.raises(AssertionError):
            compare(d["same_rows"], truth["gpt"], TINY, 2, f"same rows rank {rank}")


def test_clipping_uses_the_global_norm(launched):
    """The norm is taken over every shard and stage: equal to one process's, so the
    clipped trajectories are equal too (the norm is a sum of squares of the
    gradients: the gradient bound, relative)."""
    refs = {"fsdp_tp": clipped_run(Parallelism(), TINY),
            "pp_dp": clipped_run(Parallelism(), PIPELINE)}
    for rank, r in enumerate(launched(2, 2)):
        for layout, out in r["clipped"].items():
            ref, cfg = refs[layout], TINY if layout == "fsdp_tp" else PIPELINE
            assert min(ref["norms"]) > MAX_NORM  # clipping acted at every step
            torch.testing.assert_close(out["norms"], ref["norms"], atol=0,
                                       rtol=bounds(cfg, 2)["grad"])
            compare(out, ref, cfg, 2, f"clipped {layout} rank {rank}")


def test_3d_dp_pp_tp_on_8_ranks(truth):
    res = launch.spawn(train_3d, 8, 2, 2, 2, PIPELINE, BATCH, stream=False,
                       timeout=500)
    for rank, out in enumerate(res):
        compare(out, truth["pipeline"], PIPELINE, 2, f"rank {rank}")
    for out in res:  # every dimension carried traffic, none went elsewhere
        assert set(comm_by_dim(out)) == {"dp", "pp", "tp"}


def test_parallel_dims_owns_the_degrees() -> None:
    """One place validates the degrees: each bad one named, the product must fill
    the world, a layout must name every degree above 1, and each layout name
    stands for the degree it says."""
    from dtlib.parallel_nd import ParallelDims

    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=8)
    assert dims.dp == 4
    assert dims.sizes(("replicate", "shard", "tp")) == (2, 2, 2)
    assert dims.sizes(("dp", "tp")) == (4, 2)
    with pytest.raises(ValueError, match=r"leave tp=2 out of the layout"):
        dims.sizes(("dp",))
    with pytest.raises(ValueError, match=r"= 8, not the world size 6"):
        ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=6)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"^tp=.* must be an integer >= 1"):
            ParallelDims(tp=bad, world_size=1)
    with pytest.raises(ValueError, match=r"ep=3 must divide .* dp=4"):
        ParallelDims(dp_shard=4, ep=3, world_size=4)
    experts = ParallelDims(dp_shard=4, ep=2, world_size=4)
    assert experts.sizes(("edp", "ep")) == (2, 2)
    with pytest.raises(ValueError, match=r"dimension 'xp' is not one of"):
        experts.size("xp")
