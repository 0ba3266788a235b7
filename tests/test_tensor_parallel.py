"""Chapter 5: tensor parallelism (ours and torch DTensor's) equals one process.

Tolerance: a row-parallel layer sums tp partial products with an all-reduce where one
process sums the whole inner dimension at once; float32 addition is not associative,
so outputs and gradients agree to rounding (~1e-6 relative): rtol=1e-5, atol=1e-6.
After 5 AdamW steps parameters are compared with rtol=1e-4, atol=1e-5: the key bias
has a gradient that is exactly zero in exact arithmetic (softmax ignores a constant
added to every score), so its rounding-noise gradient is normalised by Adam into
updates of a few 1e-6. A real bug (a missing f, a wrong slice) moves parameters by
~lr = 1e-3 and gradients by tens of percent.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.runtime import launch
from dtlib.exercises import WrongAnswer
from dtlib.exercises.tensor_parallel import check_tp_numbers
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, copy_to_tp,
                                   full_linear, gather_from_tp, reduce_from_tp,
                                   scatter_to_tp)
from dtlib.chapters.ch05_tensor_parallel.runs import (TINY, mlp_pair_comms, reference_linear_pair,
                              reference_training, train_tp)
from dtlib.tensor_parallel.gpt import block_tp_numbers, tensor_parallelize

TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)
STEPS, BATCH = 5, 4


# ---- operators ---------------------------------------------------------------

def _operators() -> dict[str, torch.Tensor]:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    x = torch.full((2, 4), rank + 1.0, requires_grad=True)
    y = copy_to_tp(x)  # f
    (y * (rank + 1.0)).sum().backward()
    out["f_fwd"], out["f_bwd"] = y.detach(), x.grad
    x = torch.full((2, 4), rank + 1.0, requires_grad=True)
    y = reduce_from_tp(x)  # g
    (y * (rank + 1.0)).sum().backward()
    out["g_fwd"], out["g_bwd"] = y.detach(), x.grad
    x = torch.arange(2.0 * n).reshape(1, 2 * n) + 10 * rank
    x.requires_grad_()
    y = scatter_to_tp(x)
    z = gather_from_tp(y)
    (z * torch.arange(2.0 * n)).sum().backward()
    out["scatter"], out["gather"], out["sg_bwd"] = y.detach(), z.detach(), x.grad
    return out


@pytest.mark.parametrize("world_size", [2])
def test_operator_semantics(world_size: int) -> None:
    res = launch.spawn(_operators, world_size, stream=False, timeout=60)
    total = sum(r + 1.0 for r in range(world_size))
    for rank, r in enumerate(res):
        mine = torch.full((2, 4), rank + 1.0)
        torch.testing.assert_close(r["f_fwd"], mine)  # f: identity forward
        torch.testing.assert_close(r["f_bwd"], torch.full((2, 4), total))  # sum
        torch.testing.assert_close(r["g_fwd"], torch.full((2, 4), total))  # sum
        torch.testing.assert_close(r["g_bwd"], mine)  # g: identity backward
        row = torch.arange(2.0 * world_size) + 10 * rank
        torch.testing.assert_close(r["scatter"][0], row[2 * rank:2 * rank + 2])
        full = torch.arange(2.0 * world_size)
        gathered = torch.cat([full[2 * k:2 * k + 2] + 10 * k
                              for k in range(world_size)])
        torch.testing.assert_close(r["gather"][0], gathered)
        # backward: gather's split keeps this rank's slice of the output gradient,
        # scatter's all-gather reassembles the whole: the gradient of replicated x
        torch.testing.assert_close(r["sg_bwd"][0], torch.arange(2.0 * world_size))


def test_operators_are_identity_on_one_rank() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    for op in (copy_to_tp, reduce_from_tp, gather_from_tp, scatter_to_tp):
        y = op(x)
        y.sum().backward()
        torch.testing.assert_close(y, x)
        torch.testing.assert_close(x.grad, torch.ones_like(x))
        x.grad = None


# ---- layers ------------------------------------------------------------------

def _layers(bias: bool) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    out: dict = {}
    col = ColumnParallelLinear(8, 4 * n, bias=bias, gather_output=True, seed=3)
    row = RowParallelLinear(4 * n, 8, bias=bias, input_is_parallel=False, seed=4)
    xin = x.clone().requires_grad_()
    h = col(xin)
    y = row(h)
    y.pow(2).sum().backward()
    out["h"], out["y"], out["xgrad"] = h.detach(), y.detach(), xin.grad
    out["col_w"], out["row_w"] = col.weight.grad, row.weight.grad
    out["col_b"] = col.bias.grad if bias else None
    out["row_b"] = row.bias.grad if bias else None
    # from_linear gives the same slices as the seeded constructor
    out["same_init"] = torch.equal(
        ColumnParallelLinear.from_linear(full_linear(8, 4 * n, bias, seed=3)).weight,
        ColumnParallelLinear(8, 4 * n, bias=bias, seed=3).weight)
    errors = []
    for make in (lambda: ColumnParallelLinear(8, 4 * n + 1),
                 lambda: RowParallelLinear(4 * n + 1, 8),
                 lambda: ColumnParallelLinear(0, 4 * n),
                 lambda: tensor_parallelize(build_gpt(GPTConfig(hidden=8 * (n + 1),
                                                                n_heads=n + 1)))):
        try:
            make()
            errors.append("")
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"], out["rank"] = errors, rank
    return out


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("world_size", [2, 4])
def test_column_row_equal_linear(world_size: int, bias: bool) -> None:
    res = launch.spawn(_layers, world_size, bias, stream=False, timeout=60)
    n = world_size
    fc, proj = full_linear(8, 4 * n, bias, seed=3), full_linear(4 * n, 8, bias, seed=4)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5)).requires_grad_()
    h = fc(x)
    y = proj(h)
    y.pow(2).sum().backward()
    for r in res:
        part = slice(r["rank"] * 4, (r["rank"] + 1) * 4)
        torch.testing.assert_close(r["h"], h.detach(), **TOL)
        torch.testing.assert_close(r["y"], y.detach(), **TOL)
        torch.testing.assert_close(r["xgrad"], x.grad, **TOL)
        torch.testing.assert_close(r["col_w"], fc.weight.grad[part], **TOL)
        torch.testing.assert_close(r["row_w"], proj.weight.grad[:, part], **TOL)
        if bias:
            torch.testing.assert_close(r["col_b"], fc.bias.grad[part], **TOL)
            torch.testing.assert_close(r["row_b"], proj.bias.grad, **TOL)
        assert r["same_init"]
        msgs = r["errors"]
        assert "out_features" in msgs[0] and f"tp={n}" in msgs[0]
        assert "in_features" in msgs[1] and f"tp={n}" in msgs[1]
        assert "in_features=0" in msgs[2]
        assert "n_heads" in msgs[3]


def test_row_parallel_without_bias_single_process() -> None:
    row = RowParallelLinear(8, 4, bias=False)
    assert row.bias is None and row(torch.randn(2, 8)).shape == (2, 4)


def test_mlp_pair_needs_no_all_gather() -> None:
    ref = reference_linear_pair(16, 4)
    for gather in (False, True):
        res = launch.spawn(mlp_pair_comms, 2, 16, 4, gather, stream=False)
        for r in res:
            torch.testing.assert_close(r["out"], ref["out"], **TOL)
            torch.testing.assert_close(r["grad"], ref["grad"], **TOL)
        ops = {d["op"]: d["calls"] for d in res[0]["forward"]}
        back = {d["op"]: d["calls"] for d in res[0]["backward"]}
        if gather:
            assert ops == {"all_gather": 1, "all_reduce": 1}
            assert back == {"all_reduce": 1, "all_gather": 1}
        else:
            assert ops == {"all_reduce": 1} and back == {"all_reduce": 1}


# ---- the GPT -----------------------------------------------------------------

@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_training(TINY, BATCH, STEPS)


def _assert_equal_to_reference(results: list[dict], ref: dict) -> None:
    for rank, res in enumerate(results):
        torch.testing.assert_close(torch.tensor(res["losses"]),
                                   torch.tensor(ref["losses"]), **TOL)
        assert res["grads"].keys() == ref["grads"].keys()
        for name in ref["grads"]:
            torch.testing.assert_close(res["grads"][name], ref["grads"][name], **TOL,
                                       msg=f"rank {rank}, grad of {name}")
        for name in ref["params"]:
            torch.testing.assert_close(res["params"][name], ref["params"][name],
                                       **PARAM_TOL, msg=f"rank {rank}, param {name}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_gpt_equals_one_process(world_size: int, reference: dict) -> None:
    res = launch.spawn(train_tp, world_size, TINY, "ours", BATCH, STEPS, stream=False,
                       timeout=120)
    _assert_equal_to_reference(res, reference)
    # the formula of the exercise, checked against these real ranks
    truth = block_tp_numbers(TINY.hidden, BATCH, TINY.seq_len, world_size)
    assert res[0]["counts"]["parallel"] == TINY.n_layers * truth["params_per_rank"]
    for phase in ("forward", "backward"):
        (summary,) = res[0]["comms"][phase]
        assert summary["op"] == "all_reduce"
        assert summary["calls"] == TINY.n_layers * 2
        assert summary["bytes"] == TINY.n_layers * truth["allreduce_bytes"] // 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_dtensor_tp_equals_one_process(world_size: int, reference: dict) -> None:
    res = launch.spawn(train_tp, world_size, TINY, "dtensor", BATCH, STEPS,
                       stream=False, timeout=120)
    _assert_equal_to_reference(res, reference)
    assert res[0]["counts"]["parallel"] == TINY.n_layers * block_tp_numbers(
        TINY.hidden, BATCH, TINY.seq_len, world_size)["params_per_rank"]


def test_without_f_gradients_are_wrong_and_ranks_diverge(reference: dict) -> None:
    res = launch.spawn(train_tp, 2, TINY, "ours", BATCH, STEPS, with_f=False,
                       count=False, stream=False)
    name = "blocks.0.ln1.weight"
    ref = reference["grads"][name]
    rel = (res[0]["grads"][name] - ref).norm() / ref.norm()
    assert rel > 0.1, f"leaving out f should corrupt {name}'s gradient, rel err {rel}"
    drift = (res[0]["local"]["tok_emb.weight"] - res[1]["local"]["tok_emb.weight"])
    assert drift.abs().max() > 1e-4, "replicated parameters should diverge without f"


# ---- checkers ----------------------------------------------------------------

def test_numbers_checker() -> None:
    def right(h: int, b: int, s: int, tp: int) -> dict:
        return {"params_per_rank": (12 * h * h + 7 * h) // tp + 2 * h,
                "allreduce_bytes": 16 * b * s * h}

    def all_split(h: int, b: int, s: int, tp: int) -> dict:  # forgets replicated biases
        return {"params_per_rank": (12 * h * h + 9 * h) // tp,
                "allreduce_bytes": 16 * b * s * h}

    def forward_only(h: int, b: int, s: int, tp: int) -> dict:
        return {"params_per_rank": right(h, b, s, tp)["params_per_rank"],
                "allreduce_bytes": 8 * b * s * h}

    check_tp_numbers(right)
    for wrong in (all_split, forward_only):
        with pytest.raises(WrongAnswer):
            check_tp_numbers(wrong)
