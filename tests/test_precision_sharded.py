"""Chapter 7, "Mixed precision across ranks": the book's ZeRO-3 under a
MixedPrecisionPolicy against torch's FSDP2 under the same policy and against one
process running the same casts; bytes on the wire; the sharded loss scaler.

One launch per world size (:func:`rank_runs`); the one-process references are
computed once per configuration, in this process.

Tolerances (derived, not tuned):

- Policies: relative to the largest element of the reference (the convention of
  tests/fp32_tolerance.py, since a sum's error scales with its terms); the formulas
  and their derivation are ``across_ranks.policy_tolerances`` (the GPU suite uses
  them too). In short: the reduction's N summands in ``reduce_dtype``, 2 N**2 u
(u = 2**-24 fp32, 2**-8 bf16); plus, between implementations whose kernels may differ
(always assumed, even for FSDP2 in the same process: its buffers are not ours), one
16-bit rounding flip per product on a gradient's path, 2 (4 n_layers + 2) u_param;
parameters after 3 SGD steps 0.28 times that, plus one u_param for a master value
whose 16-bit cast rounds the other way; losses T u32 (T tokens) plus the compute term.
Where the kernels are the same (the book's ZeRO-3 against itself, one rank process,
only the reduce dtype changed) the compute term is 0, and the fp32 bound (~1e-6) is
far below what a bf16 reduction changes (~2**-9): test_reduce_dtype_is_honoured.
  The reference parameters move by more than 5 times the parameter tolerance, so a
  missing 1/N (every update doubled at N = 2: a difference of the whole motion) is
  seen; the fp32 policy's tolerance is 10**4 times tighter still.
- Loss scaling, fp32 policy: the sharded run and one process differ as in
  tests/test_zero.py (ATOL_FP32 = 1e-4, SGD with momentum); the loss scale is a power
  of two, so scaling and unscaling are exact.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dtlib.chapters.ch07_mixed_precision import across_ranks as ar
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.runtime import launch
from fp32_tolerance import U32, momentum_gain

ATOL_FP32 = 1e-4  # tests/test_zero.py's derivation: same model, batch and optimizer
UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}
PARAM_GAIN = ar.SGD["lr"] * momentum_gain(3, ar.SGD["momentum"])
SCALER_CASES = [(agree, bad) for agree in (True, False) for bad in ("inf", "nan")]


def _fp16_mean_near_the_top() -> dict:
    """Every rank reduces fp16 gradients of 65536 / N (the largest fp16 is 65504):
    their sum overflows, their mean does not."""
    from dtlib.zero.shards import ShardedUnits

    units = ShardedUnits(torch.nn.Linear(2, 2), 3, param_dtype=torch.float16,
                         reduce_dtype=torch.float16)
    n = units.world_size
    flat = torch.full((4 * n,), 65536.0 / n, dtype=torch.float16)
    return {"mean": units.reduce_scatter_mean(flat), "n": n}


def rank_runs() -> dict:
    """On every rank: every policy with both variants, the scaler runs, and an fp16
    reduction near the top of fp16's range."""
    out = ar.policy_rank()
    for agree, bad in SCALER_CASES:
        out["scaler", agree, bad] = ar.scaler_rank(agree, bad)
    out["fp16_top"] = _fp16_mean_near_the_top()
    return out


@functools.lru_cache(maxsize=None)
def runs(world_size: int) -> list[dict]:
    return launch.spawn(rank_runs, world_size, stream=False, timeout=600)


@functools.lru_cache(maxsize=None)
def simulated(world_size: int, name: str) -> dict:
    return ar.simulated(world_size, name)


def tolerances(world_size: int, name: str, same_kernels: bool = False
               ) -> tuple[float, float, float]:
    """``(rel_grad, rel_param, rel_loss)``: ``ar.policy_tolerances``, its formula
    restated here (see the module docstring)."""
    got = ar.policy_tolerances(world_size, name, same_kernels)
    param_dtype, reduce_dtype = ar.POLICIES[name]
    u_param = UNIT_ROUNDOFF[param_dtype or torch.float32]
    compute = 0 if same_kernels else 2 * (4 * ar.GPT["n_layers"] + 2) * u_param
    rel_grad = 2 * world_size ** 2 * UNIT_ROUNDOFF[reduce_dtype or param_dtype
                                                   or torch.float32] + compute
    tokens = ar.ROWS_PER_RANK * world_size * ar.GPT["seq_len"]
    want = (rel_grad, PARAM_GAIN * (rel_grad + u_param), tokens * U32 + compute)
    assert got == pytest.approx(want, rel=1e-12)
    return got


def assert_scaled_close(got: dict, want: dict, rel: float, scale: float) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=rel * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


def gmax(grads: dict) -> float:
    return max(float(g.abs().max()) for g in grads.values())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(ar.POLICIES))
@pytest.mark.parametrize("against", ["fsdp2", "one_process"])
def test_policy_matches(world_size, name, against):
    """The book's ZeRO-3 under the policy: first-step gradients, losses and the
    parameters after 3 steps equal FSDP2's (same policy) and one process's with the
    same casts, on every rank."""
    rel_grad, rel_param, rel_loss = tolerances(world_size, name)
    for rank in runs(world_size):
        ours = rank["ours", name]
        want = rank["fsdp2", name] if against == "fsdp2" else \
            simulated(world_size, name)
        g = gmax(want["grads"])
        assert_scaled_close(ours["grads"], want["grads"], rel_grad, g)
        assert_scaled_close(ours["params"], want["params"], rel_param, g)
        torch.testing.assert_close(ours["losses"][0], want["losses"][0],
                                   rtol=rel_loss, atol=0)
        torch.testing.assert_close(ours["losses"], want["losses"], rtol=rel_loss,
                                   atol=4 * rel_param * g)


@pytest.mark.parametrize("world_size", [2, 4])
def test_reference_moves_far_more_than_the_tolerance(world_size):
    init = {n: p.detach() for n, p in build_gpt(GPTConfig(**ar.GPT), 0)
            .named_parameters()}
    ref = simulated(world_size, "bf16")
    _, rel_param, _ = tolerances(world_size, "bf16")
    moved = max(float((ref["params"][n] - p).abs().max()) for n, p in init.items())
    assert moved > 5 * rel_param * gmax(ref["grads"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_dtype_is_honoured(world_size):
    """bf16 compute: reducing in bf16 instead of fp32 changes the averaged gradient
    by more than the fp32 tolerance (so the comparison above would catch it) and
    by no more than the bf16 one."""
    rel32 = tolerances(world_size, "bf16", same_kernels=True)[0]
    rel16 = tolerances(world_size, "bf16-reduce-bf16", same_kernels=True)[0]
    r = runs(world_size)[0]
    a, b = r["ours", "bf16"]["grads"], r["ours", "bf16-reduce-bf16"]["grads"]
    worst = max(float((a[n] - b[n]).abs().max()) for n in a) / gmax(a)
    assert rel32 < worst <= rel16, worst


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(ar.POLICIES))
def test_bytes_on_the_wire(world_size, name):
    """Per step: two all-gathers of Psi elements in param_dtype, one reduce-scatter
    of Psi in reduce_dtype (the GPT's units divide 4: no padding); fp32 is Chapter
    4's exact count, and the bookkeeping is the same under every policy; FSDP2
    moves the same payload."""
    param_dtype, reduce_dtype = ar.POLICIES[name]
    size = {None: 4, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
    for rank in runs(world_size):
        ours, fsdp2 = rank["ours", name], rank["fsdp2", name]
        psi = ours["n_params"]
        assert ours["bytes"]["all_gather"]["payload"] == 2 * psi * size[param_dtype]
        assert ours["bytes"]["reduce_scatter"]["payload"] == \
            psi * size[reduce_dtype or param_dtype]
        for op in ("all_gather", "reduce_scatter"):
            assert ours["bytes"][op]["payload"] == fsdp2["bytes"][op]["payload"]
            assert ours["bytes"][op]["other"] == rank["ours", "fp32"]["bytes"][op][
                "other"]
        if param_dtype is not None:  # 16-bit all-gathers: half of fp32's
            assert 2 * ours["bytes"]["all_gather"]["payload"] == \
                rank["ours", "fp32"]["bytes"]["all_gather"]["payload"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_reduction_divides_before_it_sums(world_size):
    """As FSDP2 does for fp16: divided by a power of two near sqrt(N) (2 for N = 2
    and 4) before the sum and by the rest after, the mean of N values v = 65536 / N
    is v exactly (powers of two: every partial sum k v / 2 is exact in fp16), where
    the plain sum, 65536, is past fp16's largest value and would be inf."""
    for rank in runs(world_size):
        got = rank["fp16_top"]["mean"]
        assert got.dtype == torch.float16
        assert torch.equal(got, torch.full_like(got, 65536.0 / world_size))


# ---- loss scaling under sharding ----------------------------------------------------

@functools.lru_cache(maxsize=None)
def scaler_reference(world_size: int, bad: str) -> dict:
    """One process on the global batch, skipping the bad step."""
    return ar.scaler_rank(False, bad, bad_rank=0, world_size=world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_sharded_scaler_skips_together(world_size, bad):
    """One rank's shard holds the inf (NaN): with the all-reduced flag every rank
    skips that step and backs off, and the model equals one process skipping it."""
    ref = scaler_reference(world_size, bad)
    assert ref["scales"][1] == ref["scales"][0] / 2  # the reference skipped step 1
    for rank in runs(world_size):
        got = rank["scaler", True, bad]
        assert got["scales"] == ref["scales"]
        for name, w in ref["params"].items():
            torch.testing.assert_close(got["params"][name], w, atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_per_rank_scaler_drifts(world_size, bad):
    """Without the all-reduce the rank with the bad shard skips and halves its scale
    while the others step and grow theirs: the scales part, and the model leaves the
    one-process trajectory by far more than the tolerance."""
    ref = scaler_reference(world_size, bad)
    ranks = runs(world_size)
    scales = [r["scaler", False, bad]["scales"] for r in ranks]
    assert scales[1] == ref["scales"]  # the bad rank did what one process does
    assert all(s[1] == 4 * ref["scales"][1] for i, s in enumerate(scales) if i != 1)
    worst = max(float((ranks[0]["scaler", False, bad]["params"][n] - w).abs().max())
                for n, w in ref["params"].items())
    assert worst > 100 * ATOL_FP32, worst


def test_sharded_scaler_on_one_process():
    """A world of one: no all-reduce, the plain scaler's decisions."""
    from dtlib.precision.sharded import ShardedLossScaler

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ShardedLossScaler(init_scale=4.0)
    scaler.scale(p.sum()).backward()
    assert scaler.step(opt)
    scaler.update()
    p.grad = torch.tensor([1.0, float("nan"), 1.0])
    assert not scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0  # no growth yet (interval 2000), one backoff


def test_policy_rejects_bad_arguments():
    from dtlib.precision.sharded import SimulatedRanks
    from dtlib.zero import FullyShardedModule, MixedPrecisionPolicy, parallelism

    net = build_gpt(GPTConfig(**ar.GPT), 0)
    with pytest.raises(ValueError, match="param_dtype"):
        FullyShardedModule(net, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.int8))
    with pytest.raises(ValueError, match="stage=3"):
        parallelism(2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="world_size"):
        SimulatedRanks(0)
    with pytest.raises(ValueError, match="reduce_dtype"):
        SimulatedRanks(2, torch.bfloat16, torch.int32)
    with pytest.raises(ValueError, match="bad"):
        ar.scaler_rank(True, bad="zero")


# ---- reduce in what dtype? ----------------------------------------------------------

@functools.lru_cache(maxsize=None)
def errors() -> tuple[list, list]:
    from dtlib.precision.reduction import accumulation_errors, reduction_errors

    return reduction_errors(), accumulation_errors()


def test_bf16_reduction_loses_what_fp32_keeps():
    """Across 2, 4, 8 ranks: the fp32 sum of bf16 gradients stays under its Higham
    bound ((N - 1) u32 sum|g| / |sum g|), the bf16 sum under its own (with u16) but
    above the fp32 bound, and more ranks (more roundings) lose more."""
    rows, _ = errors()
    by = {(r["world_size"], r["dtype"]): r for r in rows}
    for n in (2, 4, 8):
        b16, f32 = by[n, "bfloat16"], by[n, "float32"]
        assert f32["rel_err"] <= f32["bound"] < b16["rel_err"] <= b16["bound"]
    assert by[8, "bfloat16"]["rel_err"] > by[2, "bfloat16"]["rel_err"]


def test_fp32_main_grad_fixes_accumulation():
    """K micro-batches: one term needs no rounding (error 0); from two on the bf16
    .grad loses more than fp32's bound allows, within bf16's, and more at 64 than at
    2; the fp32 main_grad stays within fp32's bound."""
    _, rows = errors()
    by = {r["micro_batches"]: r for r in rows}
    assert by[1]["bf16_rel_err"] == by[1]["fp32_rel_err"] == 0.0
    for r in rows[1:]:
        assert r["fp32_rel_err"] <= r["fp32_bound"] < r["bf16_rel_err"] <= \
            r["bf16_bound"]
    assert by[64]["bf16_rel_err"] > by[2]["bf16_rel_err"]


# ---- the exercise: a reduce-scatter in reduce_dtype into fp32 master shards ---------

def _reduce(grad, reduce_dtype, *, cast=True, average=True, up=True, shard_of=None,
            via="reduce_scatter", pre_divide=False, always=None):
    import torch.distributed as dist

    reduce_dtype = always or reduce_dtype
    n, rank = dist.get_world_size(), dist.get_rank()
    send = grad.to(reduce_dtype) if cast else grad
    if pre_divide:
        send = send / n
    if via == "reduce_scatter":
        out = torch.empty(grad.numel() // n, dtype=send.dtype, device=send.device)
        dist.reduce_scatter_tensor(out, send)
    else:  # all-reduce, then keep a slice: the same numbers, not the method
        dist.all_reduce(send)
        r = rank if shard_of is None else shard_of
        out = send.chunk(n)[r]
    if average and not pre_divide:
        out = out / n
    return out.float() if up else out


GRAD_ANSWERS = {
    "right": functools.partial(_reduce),
    "all_reduce_slice": functools.partial(_reduce, via="all_reduce"),
    "pre_divide": functools.partial(_reduce, pre_divide=True),
    "bf16_always": functools.partial(_reduce, cast=False),
    "fp32_always": functools.partial(_reduce, always=torch.float32),
    "no_average": functools.partial(_reduce, average=False),
    "bf16_shard": functools.partial(_reduce, up=False),
    "wrong_shard": functools.partial(_reduce, via="all_reduce", shard_of=0),
}


def _every_grad_answer(answers):
    from dtlib.exercises.precision import grad_shards_on_rank

    return [grad_shards_on_rank(a) for a in answers]


@functools.lru_cache(maxsize=None)
def grad_answers() -> dict:
    names = list(GRAD_ANSWERS)
    ranks = launch.spawn(_every_grad_answer, 2, [GRAD_ANSWERS[n] for n in names],
                         timeout=120, stream=False)
    return {n: [ranks[0][i], ranks[1][i]] for i, n in enumerate(names)}


def test_grad_shard_truths_differ():
    """The fp32 and bf16 sums of the checker's gradients differ by far more than
    the checker's fp32 tolerance: a reduction in the wrong dtype is seen."""
    from dtlib.exercises.precision import grad_shard_truth

    a = torch.cat(grad_shard_truth(0, 2, torch.float32))
    b = torch.cat(grad_shard_truth(0, 2, torch.bfloat16))
    assert float((a - b).abs().max()) > 100 * 4 * U32 * float(a.abs().max())


@pytest.mark.parametrize("name", ["right", "pre_divide"])
def test_grad_shard_checker_accepts(name, capsys):
    from dtlib.exercises.precision import judge_grad_shards

    judge_grad_shards(grad_answers()[name])
    assert "Correct" in capsys.readouterr().out


# The exercise names the method: one reduce-scatter, in reduce_dtype on the wire. A
# sum in the other dtype is named by the wire's dtype; an all-reduce of the whole
# gradient (and a slice of it), right numbers or not, by its op.
@pytest.mark.parametrize("name,match", [
    ("bf16_always", r"\('reduce_scatter', 'bfloat16'\)\] \(op, dtype\): the exercise "
                    "asks for a reduce-scatter in float32"),
    ("fp32_always", r"\('reduce_scatter', 'float32'\)\] \(op, dtype\): the exercise "
                    "asks for a reduce-scatter in bfloat16"),
    ("no_average", "times too large"), ("bf16_shard", "the shard is torch.bfloat16"),
    ("all_reduce_slice", r"\[\('all_reduce', "), ("wrong_shard", r"\[\('all_reduce', ")])
def test_grad_shard_checker_rejects(name, match):
    from dtlib.exercises import WrongAnswer
    from dtlib.exercises.precision import judge_grad_shards

    with pytest.raises(WrongAnswer, match=match):
        judge_grad_shards(grad_answers()[name])


def test_policy_module_on_one_process():
    """A world of one under the bf16 policy: the optimizer sees fp32 pieces with fp32
    .grad; compute runs in bf16 (the loss differs from fp32's); state_dict and
    load_state_dict move the fp32 master values, not their bf16 casts; between steps
    only the fp32 shards are held (the bf16 buffer is freed)."""
    from dtlib.zero import FullyShardedModule, MixedPrecisionPolicy

    cfg = GPTConfig(**ar.GPT)
    x, y = ar._batch(1)
    plain = build_gpt(cfg, 0)
    net = FullyShardedModule(build_gpt(cfg, 0), mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    loss = ar._loss(net, x, y)
    loss.backward()
    with torch.no_grad():
        assert loss.item() != ar._loss(plain, x, y).item()  # bf16 compute
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in net.parameters())
    sd = net.state_dict()
    for name, p in plain.state_dict().items():
        assert sd[name].dtype == p.dtype and torch.equal(sd[name], p), name
    third = {n: v + 2.0 ** -20 if v.is_floating_point() else v for n, v in sd.items()}
    net.load_state_dict(third)  # a change below bf16's resolution survives
    back = net.state_dict()
    assert all(torch.equal(back[n], v) for n, v in third.items())
    psi = sum(p.numel() for p in plain.parameters())
    assert net.state_bytes()["params"] == 4 * psi
