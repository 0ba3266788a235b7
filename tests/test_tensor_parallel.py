"""Chapter 5: tensor parallelism (ours and torch DTensor's) equals one process.

One launch per world size runs everything the tests compare (operators, layers, the
MLP pair, the GPT trained ours, DTensor's, and with two planted defects); the
single-process reference is computed once.

Tolerances (derived in ``fp32_tolerance.py``, never read off this CPU):

- layers: the longest reordered sum is the row layer's inner dimension ``4n``
  (partial products all-reduced, 2 sums on the path): ``reorder_rel(4n, 2, 3)``
  (3 rows of mixed sign summed into a weight gradient).
- the GPT: any reduction may be reordered (the split shapes change the kernels'
  blocking too); the longest is ``K = 4h = 128`` terms (fc_proj), a gradient sums
  ``b * s = 64`` tokens of mixed sign, and a gradient passes ~4 reductions per block
  in forward and backward over 2 blocks (8): ``GPT_REL = reorder_rel(128, 8, 64)``,
  about 5e-4 of each tensor's largest element. Measured differences are ~1e-6 of it;
  the planted defects (no f, a wrong shard) are off by more than 10%.
- parameters after ``STEPS`` steps of SGD with momentum (an update linear in the
  gradient): ``lr * momentum_gain * GPT_REL * max|g|``, doubled for the feedback of
  slightly different parameters into later gradients, plus one rounding of each
  update per step (``STEPS * u * max|p|``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fp32_tolerance import (assert_all_scaled, assert_scaled, reorder_rel,
                            sgd_param_scale)
from dtlib.chapters.ch05_tensor_parallel.runs import (TINY, mlp_pair_comms,
                                                      reference_linear_pair,
                                                      reference_gpt_run, train_tp)
from dtlib.exercises import WrongAnswer
from dtlib.exercises.tensor_parallel import check_tp_numbers
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.run import RunConfig, RunResult, run_steps
from dtlib.runtime import dist as ddist
from dtlib.runtime import launch
from dtlib.tensor_parallel import TensorParallel
from dtlib.tensor_parallel.gpt import block_tp_numbers, tensor_parallelize
from dtlib.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                          copy_to_tp, full_linear, gather_from_tp,
                                          reduce_from_tp, scatter_to_tp, tp_rank,
                                          tp_size)

STEPS, BATCH, LR, MOMENTUM = 5, 4, 0.05, 0.9
SGD = dict(lr=LR, optimizer_class=torch.optim.SGD, momentum=MOMENTUM)
GPT_REL = reorder_rel(4 * TINY.hidden, 8, BATCH * TINY.seq_len)


# ---- what the ranks run (one launch per world size) --------------------------------

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


class WrongShard(TensorParallel):
    """A planted defect: every ``fc`` holds the *next* rank's rows of the weight."""

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        full = [blk.fc.weight.detach().clone() for blk in model.blocks]
        model = super().apply(model)
        n, r = tp_size(), tp_rank()
        with torch.no_grad():
            for blk, w in zip(model.blocks, full):
                blk.fc.weight.copy_(w.chunk(n, 0)[(r + 1) % n])
        return model


def _wrong_shard() -> RunResult:
    device = ddist.world().device
    return run_steps(WrongShard("ours"), build_gpt(TINY, 0).to(device),
                     gpt_batches(TINY, BATCH, device),
                     RunConfig(STEPS, optimizer_class=torch.optim.SGD,
                               optimizer_kwargs={"lr": LR, "momentum": MOMENTUM}))


def _suite(defects: bool) -> dict:
    """Everything one rank contributes to this file's tests, in one launch."""
    out = {"layers": {bias: _layers(bias) for bias in (True, False)},
           "ours": train_tp(TINY, "ours", BATCH, STEPS, **SGD),
           "dtensor": train_tp(TINY, "dtensor", BATCH, STEPS, **SGD)}
    if defects:
        out["operators"] = _operators()
        out["pair"] = {g: mlp_pair_comms(16, 4, g) for g in (False, True)}
        out["no_f"] = train_tp(TINY, "ours", BATCH, STEPS, with_f=False, count=False,
                               **SGD)
        out["wrong_shard"] = _wrong_shard()
    return out


@pytest.fixture(scope="module")
def reference() -> RunResult:
    return reference_gpt_run(TINY, BATCH, STEPS, **SGD)


@pytest.fixture(scope="module")
def ranks2() -> list[dict]:
    return launch.spawn(_suite, 2, True, stream=False, timeout=300)


@pytest.fixture(scope="module")
def ranks4() -> list[dict]:
    return launch.spawn(_suite, 4, False, stream=False, timeout=300)


@pytest.fixture(params=[2, 4])
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    return request.getfixturevalue(f"ranks{request.param}")


# ---- operators ---------------------------------------------------------------------

def test_operator_semantics(ranks2: list[dict]) -> None:
    world_size = len(ranks2)
    total = sum(r + 1.0 for r in range(world_size))
    for rank, res in enumerate(ranks2):
        r = res["operators"]  # small integers: every sum is exact
        mine = torch.full((2, 4), rank + 1.0)
        torch.testing.assert_close(r["f_fwd"], mine, rtol=0, atol=0)  # f: identity
        torch.testing.assert_close(r["f_bwd"], torch.full((2, 4), total),
                                   rtol=0, atol=0)  # f backward: the sum
        torch.testing.assert_close(r["g_fwd"], torch.full((2, 4), total),
                                   rtol=0, atol=0)  # g: the sum
        torch.testing.assert_close(r["g_bwd"], mine, rtol=0, atol=0)  # g backward
        row = torch.arange(2.0 * world_size) + 10 * rank
        torch.testing.assert_close(r["scatter"][0], row[2 * rank:2 * rank + 2],
                                   rtol=0, atol=0)
        full = torch.arange(2.0 * world_size)
        gathered = torch.cat([full[2 * k:2 * k + 2] + 10 * k
                              for k in range(world_size)])
        torch.testing.assert_close(r["gather"][0], gathered, rtol=0, atol=0)
        # backward: gather's split keeps this rank's slice of the output gradient,
        # scatter's all-gather reassembles the whole: the gradient of replicated x
        torch.testing.assert_close(r["sg_bwd"][0], torch.arange(2.0 * world_size),
                                   rtol=0, atol=0)


def test_operators_are_identity_on_one_rank() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    for op in (copy_to_tp, reduce_from_tp, gather_from_tp, scatter_to_tp):
        y = op(x)
        y.sum().backward()
        torch.testing.assert_close(y, x, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, torch.ones_like(x), rtol=0, atol=0)
        x.grad = None


# ---- layers ------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_column_row_equal_linear(ranks: list[dict], bias: bool) -> None:
    n = len(ranks)
    rel = reorder_rel(4 * n, 2, 3)
    fc, proj = full_linear(8, 4 * n, bias, seed=3), full_linear(4 * n, 8, bias, seed=4)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5)).requires_grad_()
    h = fc(x)
    y = proj(h)
    y.pow(2).sum().backward()
    for res in ranks:
        r = res["layers"][bias]
        part = slice(r["rank"] * 4, (r["rank"] + 1) * 4)
        assert_scaled(r["h"], h.detach(), rel, "h")
        assert_scaled(r["y"], y.detach(), rel, "y")
        assert_scaled(r["xgrad"], x.grad, rel, "x.grad")
        assert_scaled(r["col_w"], fc.weight.grad[part], rel, "col weight grad")
        assert_scaled(r["row_w"], proj.weight.grad[:, part], rel, "row weight grad")
        if bias:
            assert_scaled(r["col_b"], fc.bias.grad[part], rel, "col bias grad")
            assert_scaled(r["row_b"], proj.bias.grad, rel, "row bias grad")
        assert r["same_init"]
        msgs = r["errors"]
        assert "out_features" in msgs[0] and f"tp={n}" in msgs[0]
        assert "in_features" in msgs[1] and f"tp={n}" in msgs[1]
        assert "in_features=0" in msgs[2]
        assert "n_heads" in msgs[3]


def test_row_parallel_without_bias_single_process() -> None:
    row = RowParallelLinear(8, 4, bias=False)
    assert row.bias is None and row(torch.randn(2, 8)).shape == (2, 4)


def test_mlp_pair_needs_no_all_gather(ranks2: list[dict]) -> None:
    ref = reference_linear_pair(16, 4)
    rel = reorder_rel(4 * 16, 2, 4)  # inner dimension 4h = 64, 4 rows
    for gather in (False, True):
        for res in ranks2:
            r = res["pair"][gather]
            assert_scaled(r["out"], ref["out"], rel, "out")
            assert_scaled(r["grad"], ref["grad"], rel, "grad")
        ops = {d["op"]: d["calls"] for d in ranks2[0]["pair"][gather]["forward"]}
        back = {d["op"]: d["calls"] for d in ranks2[0]["pair"][gather]["backward"]}
        if gather:
            assert ops == {"all_gather": 1, "all_reduce": 1}
            assert back == {"all_reduce": 1, "all_gather": 1}
        else:
            assert ops == {"all_reduce": 1} and back == {"all_reduce": 1}


# ---- the GPT -----------------------------------------------------------------------

def _param_scale(ref: RunResult) -> float:
    """Absolute parameter tolerance after STEPS SGD-momentum steps (see the top)."""
    return sgd_param_scale(GPT_REL, ref.grads, ref.params, LR, STEPS, MOMENTUM)


def assert_equal_to_reference(result: RunResult, ref: RunResult, msg: str) -> None:
    """The proof: losses, first-step gradients and final parameters as one process."""
    assert_scaled(torch.tensor(result.losses), torch.tensor(ref.losses), GPT_REL,
                  f"{msg} losses")
    assert_all_scaled(result.grads, ref.grads, GPT_REL, f"{msg} grad")
    scale = _param_scale(ref)
    assert set(result.params) == set(ref.params)
    for name, p in ref.params.items():
        assert_scaled(result.params[name], p, 1.0, f"{msg} param {name}", scale=scale)


@pytest.mark.parametrize("variant", ["ours", "dtensor"])
def test_tp_gpt_equals_one_process(ranks: list[dict], variant: str,
                                   reference: RunResult) -> None:
    world_size = len(ranks)
    for rank, res in enumerate(ranks):
        assert_equal_to_reference(res[variant], reference, f"{variant} rank {rank}")
    # not vacuous: training moved the parameters far more than the tolerance
    start = build_gpt(TINY, 0).state_dict()
    moved = max((reference.params[n] - start[n]).abs().max().item()
                for n in reference.params)
    assert moved > 100 * _param_scale(reference)
    # the formula of the exercise, checked against these real ranks
    truth = block_tp_numbers(TINY.hidden, BATCH, TINY.seq_len, world_size)
    first = ranks[0][variant]
    assert first["counts"]["parallel"] == TINY.n_layers * truth["params_per_rank"]
    for phase in ("forward", "backward"):
        (summary,) = first["comms"][phase]
        assert summary["op"] == "all_reduce"
        assert summary["calls"] == TINY.n_layers * 2
        assert summary["bytes"] == TINY.n_layers * truth["allreduce_bytes"] // 2


def test_without_f_the_proof_fails_and_ranks_diverge(ranks2: list[dict],
                                                     reference: RunResult) -> None:
    """ERRATA 17 planted: the comparison above must catch it."""
    res = [r["no_f"] for r in ranks2]
    with pytest.raises(AssertionError, match="grad"):
        assert_all_scaled(res[0].grads, reference.grads, GPT_REL, "no f grad")
    name = "blocks.0.ln1.weight"
    ref = reference.grads[name]
    rel = (res[0].grads[name] - ref).norm() / ref.norm()
    assert rel > 0.1, f"leaving out f should corrupt {name}'s gradient, rel err {rel}"
    drift = (res[0]["local"]["tok_emb.weight"] - res[1]["local"]["tok_emb.weight"])
    # further apart than rounding could ever take them (the parameter tolerance)
    assert drift.abs().max() > 10 * _param_scale(reference), \
        "replicated parameters should diverge without f"


def test_a_wrong_shard_fails_the_proof(ranks2: list[dict],
                                       reference: RunResult) -> None:
    """Each rank's fc holds its neighbour's rows: losses and gradients must differ."""
    for res in ranks2:
        with pytest.raises(AssertionError):
            assert_equal_to_reference(res["wrong_shard"], reference, "wrong shard")
        with pytest.raises(AssertionError, match="losses"):
            assert_scaled(torch.tensor(res["wrong_shard"].losses),
                          torch.tensor(reference.losses), GPT_REL, "losses")


def test_bad_variant_is_named() -> None:
    with pytest.raises(ValueError, match="variant='megatron'"):
        train_tp(TINY, "megatron", BATCH, 1)
    with pytest.raises(ValueError, match="with_f=False"):
        train_tp(TINY, "dtensor", BATCH, 1, with_f=False)


# ---- checkers ----------------------------------------------------------------------

def test_numbers_checker() -> None:
    def right(h: int, b: int, s: int, tp: int) -> dict:
        return {"params_per_rank": (12 * h * h + 7 * h) // tp + 2 * h,
                "allreduce_bytes": 16 * b * s * h,
                "ring_send_bytes": 16 * b * s * h * 2 * (tp - 1) / tp}

    def all_split(h: int, b: int, s: int, tp: int) -> dict:  # forgets replicated biases
        return {**right(h, b, s, tp), "params_per_rank": (12 * h * h + 9 * h) // tp}

    def forward_only(h: int, b: int, s: int, tp: int) -> dict:
        return {**right(h, b, s, tp), "allreduce_bytes": 8 * b * s * h}

    def message_is_wire(h: int, b: int, s: int, tp: int) -> dict:  # 2(N-1)/N left out
        return {**right(h, b, s, tp), "ring_send_bytes": 16 * b * s * h}

    check_tp_numbers(right)
    for wrong in (all_split, forward_only, message_is_wire):
        with pytest.raises(WrongAnswer):
            check_tp_numbers(wrong)
