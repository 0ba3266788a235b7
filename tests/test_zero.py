"""Chapter 4: the book's ZeRO 1-3 and FSDP2 against one process, memory and
communication against the ZeRO paper's formulas, and the DeepSpeed config validator.

Each world size is ONE launch (:func:`rank_runs`): every variant on both models, the
toy MoE's cases, stage 3's refusal and its module behaviour, and three planted defects;
the single-process references are computed once per configuration, in this process.

Tolerances (derived, not tuned):

- fp32 sharded vs one process, SGD with momentum: the two compute the same gradients,
  summed in another order (the reference sums the global batch's B rows in one
  reduction; a rank sums its B/N rows and the reduce-scatter adds N partial sums). A
  sum of n fp32 terms in another order differs by at most (n - 1) u sum|terms|, u =
  2**-24 (Higham, Accuracy and Stability, 4.2). Here n <= B * seq_len = 8 * 16 = 128
  rows (4 ranks x 2 rows x 16 tokens) and each row's contribution to a gradient element
  is at most ~10 / B (softmax - onehot has L1 norm <= 2, weights and tanh/LayerNorm
  activations are O(1); the MLP's MSE residuals likewise), so sum|terms| <= 10 and
  |dg| <= 128 * 6e-8 * 10 = 7.7e-5. SGD with momentum 0.9 and lr 0.05 turns a gradient
  difference into a parameter difference of at most lr * sum_t sum_s<=t 0.9**(t-s)
  = 0.05 * 13.2 = 0.66 times it over 5 steps: |dp| <= 5e-5. ATOL_FP32 = 1e-4 allows
  that twice (the clip's norm, a double here and a float32 in torch, adds a relative
  ~1e-7 of the step).
- A planted defect moves parameters by a sizeable part of the training's own motion
  (a missing 1/N doubles every step at N = 2; a shard written at the wrong offset
  swaps whole blocks of parameters; a stale gradient repeats the first step's), which
  is >= 1e-2 here: test_planted_defects_fail_the_comparison checks each exceeds
  100 x ATOL_FP32.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from dtlib.runtime import launch
from dtlib.bench.zero import (LOSSES, ODD_MLP, TEST_GPT, compare_params,
                              reference_params, train_rank)
from dtlib.zero.deepspeed_config import (consistent_world_sizes, deepspeed_config,
                                         validate_deepspeed_config)
from dtlib.zero.flat_params import FlatLayout, assign_units, default_unit_modules
from dtlib.memory.formulas import model_state_bytes
from dtlib.models.gpt import MLP, GPTConfig, build_gpt, token_batch
from dtlib.zero import (FullyShardedModule, ShardedOptimizer, parallelism,
                        zero_comm_elements)

ATOL_FP32 = 1e-4  # see the module docstring
#: bf16 compute (FSDP2 MixedPrecisionPolicy): the distance to the fp32 reference is
#: under 25% of the distance training moved the parameters (bf16 keeps 8 significant
#: bits: each of the ~100 roundings per element in a step is up to 2**-9 relative;
#: AdamW normalises each update, so ~2**-9 * sqrt(100) ~ 2% per step, 5 steps apart
#: in sign-sensitive directions: well under 25%, and > 0 proves bf16 was used).
REL_BF16 = 0.25
RUNS = [("zero", 1), ("zero", 2), ("zero", 3), ("fsdp2", 3)]
MODELS = ("gpt", "mlp")
SGD = dict(optimizer="sgd", lr=0.05)
STEPS = 5

#: The toy MoE's cases (dtlib.chapters.ch04_zero_fsdp.runs), SGD with momentum 0.9 at
#: lr 0.05 and weight decay 0.1 for 4 steps: 16 rows of width 6 (n <= 16 terms a sum,
#: each row's contribution <= ~2 / 16), so |dg| <= 16 * 6e-8 * 2 = 2e-6 and
#: |dp| <= 0.05 * 9.1 * 2e-6 = 1e-6 (momentum sums, 4 steps). ATOL_MOE = 1e-5. A
#: parameter that should be skipped (no rank used it) but is stepped moves by
#: lr * weight_decay * |p| ~ 0.05 * 0.1 * 0.3 = 1.5e-3 a step: caught.
ATOL_MOE = 1e-5
MOE_CASES = {
    "unused_on_some_ranks": {},  # expert 1 on rank 0 only, and not at odd steps
    "unused_at_some_steps": {"routing": "steps"},  # no rank uses expert 1 at odd steps
    "frozen": {"routing": "steps", "freeze": True},
    "no_decay_groups": {"routing": "steps", "no_decay": True},
}
MOE_SGD = dict(optimizer="sgd", lr=0.05)


# ---- what every rank runs: one launch per world size ---------------------------------

def _stage3_mismatch() -> str:
    from dtlib.chapters.ch04_zero_fsdp.runs import moe_rank

    try:
        moe_rank(3, steps=1, compare=False)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _stage3_safety() -> dict:
    import io

    cfg = GPTConfig(**TEST_GPT)
    x, y = token_batch(cfg, 2, seed=1 + torch.distributed.get_rank())
    z = FullyShardedModule(build_gpt(cfg, 0))
    opt = torch.optim.SGD(z.parameters(), lr=0.05, momentum=0.9)
    out = {"repr_before": len(repr(z)) > 0}
    for step in range(2):
        F.cross_entropy(z(x).flatten(0, 1), y.flatten()).backward()
        out[f"grads_on_shards_{step}"] = all(p.grad is not None and
                                             p.grad.shape == p.shape
                                             for p in z.parameters())
        opt.step()
        opt.zero_grad()
    # After step: print, measure, save and load the module itself.
    out["printed"] = all(len(str(p)) > 0 for p in z.module.parameters())
    out["local_norm"] = float(torch.nn.utils.get_total_norm(list(z.parameters())))
    full = z.full_parameters()
    sd = z.state_dict()
    out["state_dict_equal"] = all(torch.equal(sd[n], t) for n, t in full.items())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    z.load_state_dict({k: v + 1 for k, v in loaded.items()})
    again = z.full_parameters()
    out["load_applied"] = all(torch.equal(again[n], t + 1) for n, t in full.items())
    # Between forward and backward (the buffers are freed): still safe to print.
    loss = F.cross_entropy(z(x).flatten(0, 1), y.flatten())
    out["printed_mid_step"] = all(len(str(p)) > 0 for p in z.module.parameters())
    loss.backward()
    opt.step()
    out["trains_after_load"] = all(torch.isfinite(t).all()
                                   for t in z.full_parameters().values())
    return out


def _planted(defect: str) -> dict:
    """Train with one defect planted in the sharding (SGD, no clip, so that no
    normalisation hides it); returns the full parameters."""
    from unittest import mock

    from dtlib.collectives.algorithms import reduce_scatter_into
    from dtlib.zero.shards import ShardedUnits

    gather = ShardedUnits.all_gather

    def no_average(self, flat):  # the reduce-scatter sums; the 1/N is forgotten
        out = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype)
        reduce_scatter_into(out, flat)
        return out

    def wrong_offset(self, out, shard):  # rank r's shard lands in slot r + 1
        gather(self, out, shard)
        out.copy_(out.roll(out.numel() // self.world_size))

    stale: dict = {}

    def stale_grads(self):  # stage 1 reduces the first step's gradients only
        if not stale:
            stale["done"] = True
            self.units.reduce_stage1()
        self._grads_reduced = True

    patch, stage = {"missing_1_over_n": (mock.patch.object(
        ShardedUnits, "reduce_scatter_mean", no_average), 2),
        "wrong_shard_offset": (mock.patch.object(
            ShardedUnits, "all_gather", wrong_offset), 3),
        "stale_gradient": (mock.patch.object(
            ShardedOptimizer, "_reduce", stale_grads), 1)}[defect]
    with patch:
        return train_rank("zero", stage, "gpt", STEPS, clip=None, compare=False,
                          keep_params=True, **SGD)["params"]


def _accumulated(variant: str, stage: int) -> dict:
    """Two micro-batches per step through Chapter 8's accumulation_step (the
    Parallelism's grad_sync off for the first): SGD with momentum, 3 steps."""
    from dtlib.accumulation import accumulation_step
    from dtlib.models.run import RunConfig, run_steps

    cfg = GPTConfig(**TEST_GPT)
    x, y = token_batch(cfg, 4 * torch.distributed.get_world_size(), seed=1)
    par = parallelism(stage) if variant == "zero" else parallelism(
        3, variant="fsdp2", group=torch.distributed.group.WORLD)
    return run_steps(par, build_gpt(cfg, 0), lambda step: (x, y),
                     RunConfig(3, optimizer_class=torch.optim.SGD,
                               optimizer_kwargs=dict(lr=0.05, momentum=0.9),
                               step_fn=accumulation_step(2), record_grads=False)
                     ).params


def rank_runs() -> dict:
    """On every rank: everything this file compares, in one launch."""
    from dtlib.chapters.ch04_zero_fsdp.runs import moe_rank

    out: dict = {}
    for variant, stage in RUNS:
        for model in MODELS:
            # SGD with momentum, no clip: the trajectory, bytes and communication
            out[variant, stage, model] = train_rank(
                variant, stage, model, STEPS, clip=None, compare=False,
                keep_params=True, **SGD)
        # clipping on (the global norm across shards)
        out[variant, stage, "clip"] = train_rank(
            variant, stage, "gpt", STEPS, clip=0.5, compare=False, keep_params=True,
            **SGD)
        # AdamW: the optimizer the memory formula's 16 bytes per parameter counts
        out[variant, stage, "adamw"] = train_rank(variant, stage, "gpt", 2,
                                                  compare=False)
    out["bf16"] = train_rank("fsdp2", 3, "gpt", STEPS, bf16=True, compare=False,
                             keep_params=True)
    for stage in (1, 2, 3):
        for case, kwargs in MOE_CASES.items():
            if stage == 3 and case == "unused_on_some_ranks":
                continue  # stage 3 refuses it (test_stage3_rank_mismatch_is_named)
            out["moe", stage, case] = moe_rank(stage, compare=False, **kwargs,
                                               **MOE_SGD)
    for variant, stage in RUNS:
        out["accum", variant, stage] = _accumulated(variant, stage)
    out["safety"] = _stage3_safety()
    for defect in ("missing_1_over_n", "wrong_shard_offset", "stale_gradient"):
        out["defect", defect] = _planted(defect)
    out["mismatch"] = _stage3_mismatch()  # last: it stops a run mid-backward
    return out


@functools.lru_cache(maxsize=None)
def runs(world_size: int) -> list[dict]:
    return launch.spawn(rank_runs, world_size, stream=False, timeout=600)


@functools.lru_cache(maxsize=None)
def reference(model: str, world_size: int, clip: float | None = None,
              optimizer: str = "sgd", lr: float = 0.05) -> dict:
    """The single-process run of one configuration, computed once."""
    return reference_params(model, STEPS, world_size, clip=clip, optimizer=optimizer,
                            lr=lr)


@functools.lru_cache(maxsize=None)
def moe_reference(world_size: int, case: str) -> dict:
    from dtlib.chapters.ch04_zero_fsdp.runs import moe_reference as ref

    return ref(world_size, **MOE_CASES[case], **MOE_SGD)


def layouts(model: str, world_size: int) -> list[FlatLayout]:
    """The units' padded flat layouts, as dtlib.zero lays them out."""
    net = build_gpt(GPTConfig(**TEST_GPT)) if model == "gpt" else MLP(ODD_MLP)
    units = assign_units(net, default_unit_modules(net))
    return [FlatLayout(ps, ns, world_size) for _, ns, ps in units]


def padded(model: str, world_size: int) -> int:
    """Psi padded unit by unit."""
    return sum(lay.padded_numel for lay in layouts(model, world_size))


def owned(model: str, world_size: int, rank: int) -> int:
    """Real (not padding) elements of rank ``rank``'s shards: what the optimizer keeps
    state for (it steps each parameter's piece of the shard)."""
    return sum(max(0, min(lay.numel, hi) - lo)
               for lay in layouts(model, world_size)
               for lo, hi in [lay.shard_range(rank)])


def small_collectives(model: str, world_size: int, stage: int) -> int:
    """Elements of one step's bookkeeping collectives, ZeRO convention: the all-reduce
    of one "got a gradient" flag per parameter tensor (2 each), and in stage 3 the
    (operation, unit) check of 2 ints before each of the 3 collectives per unit (an
    all-gather of 2 x world_size). These runs do not clip (a clip adds 2)."""
    lays = layouts(model, world_size)
    flags = sum(len(lay.params) for lay in lays)
    checks = 3 * len(lays) * 2 * world_size if stage == 3 else 0
    return 2 * flags + checks


def assert_params_close(got: dict, want: dict, atol: float) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=atol, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ---- equal to one process ------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant,stage", RUNS)
@pytest.mark.parametrize("model", MODELS)
def test_matches_single_process_sgd_momentum(world_size, variant, stage, model):
    ref = reference(model, world_size)
    for r in runs(world_size):
        assert_params_close(r[variant, stage, model]["params"], ref, ATOL_FP32)
    if model == "mlp":
        n = runs(world_size)[0][variant, stage, model]["n_params"]
        assert n % world_size != 0  # the padding path is used


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant,stage", RUNS)
def test_matches_single_process_with_clipping(world_size, variant, stage):
    ref = reference("gpt", world_size, clip=0.5)
    for r in runs(world_size):
        assert_params_close(r[variant, stage, "clip"]["params"], ref, ATOL_FP32)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant,stage", RUNS)
def test_accumulation_through_grad_sync(world_size, variant, stage):
    """Chapter 8's token-normalised accumulation over each variant's grad_sync
    equals one process on the whole batch (16 x 4 rows of 16 tokens at most: n <=
    256 terms a sum, |dg| <= 256 * 6e-8 * 10 = 1.5e-4, times lr * (1 + 1.9 + 2.71)
    = 0.28 over 3 steps: 4e-5 < ATOL_FP32)."""
    from dtlib.models.run import Parallelism, RunConfig, run_steps

    cfg = GPTConfig(**TEST_GPT)
    x, y = token_batch(cfg, 4 * world_size, seed=1)
    ref = run_steps(Parallelism(), build_gpt(cfg, 0), lambda step: (x, y),
                    RunConfig(3, optimizer_class=torch.optim.SGD,
                              optimizer_kwargs=dict(lr=0.05, momentum=0.9),
                              record_grads=False)).params
    for r in runs(world_size):
        assert_params_close(r["accum", variant, stage], ref, ATOL_FP32)


@pytest.mark.parametrize("world_size", [2, 4])
def test_reference_moves_far_more_than_the_tolerance(world_size):
    net = build_gpt(GPTConfig(**TEST_GPT))
    init = {n: p.detach() for n, p in net.named_parameters()}
    ref = reference("gpt", world_size)
    assert max(float((ref[n] - init[n]).abs().max()) for n in init) > 100 * ATOL_FP32


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("defect", ["missing_1_over_n", "wrong_shard_offset",
                                    "stale_gradient"])
def test_planted_defects_fail_the_comparison(world_size, defect):
    """The tolerance is tight enough to see each defect a sharding can have."""
    ref = reference("gpt", world_size)
    got = runs(world_size)[0]["defect", defect]
    worst = max(float((got[n] - w).abs().max()) for n, w in ref.items())
    assert worst > 100 * ATOL_FP32, (defect, worst)
    with pytest.raises(AssertionError):
        assert_params_close(got, ref, ATOL_FP32)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_bf16_params_fp32_reduce(world_size):
    ref = reference("gpt", world_size, clip=1.0, optimizer="adamw", lr=1e-2)
    init = dict(build_gpt(GPTConfig(**TEST_GPT)).named_parameters())
    init = {n: p.detach() for n, p in init.items()}
    for rank in runs(world_size):
        r = rank["bf16"]
        rel = compare_params(r["params"], ref, init)["rel_update_err"]
        assert 0 < rel <= REL_BF16, rel  # > 0: bf16 really was used
        ops = {s["op"]: s for s in r["comm_summary"]}
        # bf16 all-gathers (2 bytes/element, 2 Psi elements), fp32 reduce-scatter
        assert ops["all_gather"]["bytes"] == 2 * 2 * r["n_params"]
        assert ops["reduce_scatter"]["bytes"] == 4 * r["n_params"]


# ---- memory and communication --------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant,stage", RUNS)
def test_state_bytes_match_formula(world_size, variant, stage):
    """AdamW (16 bytes per parameter in fp32) and SGD with momentum (12): the bytes a
    rank holds are the ZeRO paper's, within the padding of each unit."""
    for r in runs(world_size):
        for key, optimizer in (("adamw", "adam"), ("gpt", "sgd_momentum")):
            rec = r[variant, stage, key]
            want = model_state_bytes(rec["n_params"], zero_stage=stage, dp=world_size,
                                     precision="fp32", optimizer=optimizer).total
            # the GPT's units divide by 4: no padding, so exactly the formula
            assert rec["state"]["total"] == want, (key, rec["state"], want)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_bytes_exact_with_padding(world_size, stage):
    pad = padded("mlp", world_size)
    shard = pad // world_size
    for rank, r in enumerate(runs(world_size)):
        mom = owned("mlp", world_size, rank)  # SGD's momentum, no padding
        want = {1: (pad, pad, mom), 2: (pad, shard, mom), 3: (shard, shard, mom)}[stage]
        s = r["zero", stage, "mlp"]["state"]
        assert (s["params"], s["grads"], s["optimizer"]) == tuple(4 * n for n in want)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant,stage", RUNS)
@pytest.mark.parametrize("model", MODELS)
def test_comm_per_step(world_size, variant, stage, model):
    factor = 2 if stage < 3 else 3
    for r in runs(world_size):
        rec = r[variant, stage, model]
        psi, got = rec["n_params"], rec["comm_elements"]
        if variant == "zero":
            # 2 or 3 Psi of the padded buffers, + the small bookkeeping collectives
            extra = small_collectives(model, world_size, stage)
            assert factor * psi <= got <= factor * padded(model, world_size) + extra
            if model == "gpt":  # no padding: exactly
                assert got == factor * psi + extra
        elif model == "gpt":  # FSDP2 pads per parameter (dim 0); the GPT needs none
            assert got == factor * psi, got


def test_zero_comm_elements_convention():
    class R:
        def __init__(self, op, numel):
            self.op, self.numel = op, numel

    recs = [R("all_reduce", 10), R("reduce_scatter", 10), R("all_gather", 10),
            R("broadcast", 10)]
    assert zero_comm_elements(recs) == 40


# ---- one process: accumulation, any torch optimizer ----------------------------------

@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer_class,kwargs", [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 1e-2}),
])
def test_single_rank_with_accumulation(stage, optimizer_class, kwargs):
    """A world of one (no process group): two micro-batches per step, stage hooks and
    bucket flushing included, equal the torch optimizer on the concatenated batch.

    One process sums the same gradients in the same order but for the split of the
    batch into two halves: |dg| <= 64 rows * 6e-8 * 10 = 4e-5 (see the module
    docstring); SGD: x 0.05 * 6.6 over 3 steps; Adam's first step is lr * g / (|g| +
    eps), so a near-zero gradient can move its parameter by up to lr = 1e-2 a step:
    Adam is compared on its first step only, where the gradients agree to ~1e-7 and
    an element with |g| >= 1e-4 moves by at most lr * 1e-7 / 1e-4 = 1e-5."""
    cfg = GPTConfig(**TEST_GPT)
    x, y = token_batch(cfg, 4, seed=1)
    steps = 3 if optimizer_class is torch.optim.SGD else 1
    ref = build_gpt(cfg, 0)
    opt = optimizer_class(ref.parameters(), **kwargs)
    net = build_gpt(cfg, 0)
    if stage == 3:
        z = FullyShardedModule(net)
        zopt = optimizer_class(z.parameters(), **kwargs)
    else:
        z = net
        zopt = ShardedOptimizer(net.parameters(), optimizer_class, stage=stage,
                                module=net, **kwargs)
    for _ in range(steps):
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (F.cross_entropy(z(xs).flatten(0, 1), ys.flatten()) / 2).backward()
        (z if stage == 3 else zopt).clip_grad_norm_(0.5)
        zopt.step()
        zopt.zero_grad()
    got = z.full_parameters() if stage == 3 else dict(net.named_parameters())
    if steps == 1:  # Adam: only elements whose gradient is well above the noise
        for name, p in ref.named_parameters():
            big = grads[name].abs() >= 1e-4
            torch.testing.assert_close(got[name].detach()[big], p.detach()[big],
                                       atol=1e-5, rtol=0)
    else:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name].detach(), p.detach(),
                                       atol=ATOL_FP32, rtol=0)


def test_flat_layout_pads_and_views():
    net = MLP(ODD_MLP)
    ps = list(net.parameters())
    lay = FlatLayout(ps, [str(i) for i in range(len(ps))], 4)
    got = (lay.numel, lay.padded_numel, lay.shard_numel, lay.padding)
    assert got == (111, 112, 28, 1)
    flat = lay.flatten([p.detach() for p in ps])
    assert flat[-1] == 0
    for v, p in zip(lay.views(flat), ps):
        assert v.data_ptr() >= flat.data_ptr() and torch.equal(v, p.detach())
    assert lay.shard_range(3) == (84, 112)
    with pytest.raises(ValueError, match="rank=4"):
        lay.shard_range(4)


def test_tied_weights_go_to_root_unit():
    net = build_gpt(GPTConfig(**TEST_GPT))
    units = assign_units(net, default_unit_modules(net))
    assert units[0][0] is net and "tok_emb.weight" in units[0][1]
    assert len(units) == 1 + TEST_GPT["n_layers"]
    assert sum(len(ps) for _, _, ps in units) == len(list(net.parameters()))


def test_zero_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stage=3"):
        ShardedOptimizer(MLP().parameters(), torch.optim.SGD, stage=3, lr=0.1)
    with pytest.raises(ValueError, match="optimizer_class='adamw'"):
        ShardedOptimizer(MLP().parameters(), "adamw")
    with pytest.raises(ValueError, match="stage=4"):
        parallelism(4)
    with pytest.raises(ValueError, match="stage=2 not allowed for variant='fsdp2'"):
        parallelism(2, variant="fsdp2")
    with pytest.raises(ValueError, match="variant='megatron'"):
        parallelism(3, variant="megatron")
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        train_rank("zero", 1, optimizer="lamb")
    with pytest.raises(ValueError, match="variant='ddp'"):
        train_rank("ddp")


def test_losses_table_names_both_models():
    assert set(LOSSES) == set(MODELS)


# ---- parameters some ranks or steps do not use, frozen parameters, groups ----------

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_cases_match_torch_sgd(world_size, stage, case):
    if stage == 3 and case == "unused_on_some_ranks":
        pytest.skip("stage 3 refuses it with a clear error (tested below)")
    ref = moe_reference(world_size, case)
    for r in runs(world_size):
        got = r["moe", stage, case]
        moved = max(float((w - got["init"][n]).abs().max()) for n, w in ref.items())
        assert moved > 100 * ATOL_MOE  # the run moved the parameters
        assert_params_close(got["params"], ref, ATOL_MOE)


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_order_is_fixed(world_size):
    """Gradients complete in a different order on rank 0 (which used expert 1) than on
    the others; the reduce-scatters go in one fixed order on every rank anyway."""
    per_rank = [r["moe", 2, "unused_on_some_ranks"] for r in runs(world_size)]
    assert per_rank[0]["hook_order"] != per_rank[1]["hook_order"]
    assert all(r["reduce_order"] == per_rank[0]["reduce_order"] for r in per_rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_rank_mismatch_is_named(world_size):
    """Expert 1 runs on rank 0 only: stage 3 cannot gather it on demand. Every rank
    raises at once, naming the units, instead of waiting for the gloo timeout."""
    for r in runs(world_size):
        msg = r["mismatch"]
        assert "ranks disagree" in msg and "experts.1" in msg, msg


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_module_safe_to_print_measure_save_load(world_size):
    for rank in runs(world_size):
        r = rank["safety"]
        assert all(v for k, v in r.items() if k != "local_norm"), r
        assert r["local_norm"] > 0, r


def test_frozen_and_groups_single_process():
    """One process, no process group: frozen input layer, no-decay groups, expert 1
    unused at odd steps, every stage equal to torch.optim.SGD (momentum)."""
    from dtlib.chapters.ch04_zero_fsdp.runs import moe_rank
    from dtlib.chapters.ch04_zero_fsdp.runs import moe_reference as one_process

    case = dict(freeze=True, no_decay=True, routing="steps", **MOE_SGD)
    ref = one_process(1, **case)
    for stage in (1, 2, 3):
        got = moe_rank(stage, compare=False, **case)
        assert_params_close(got["params"], ref, ATOL_MOE)


# ---- DeepSpeed config -------------------------------------------------------------

SEED = {
    "train_batch_size": 256, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "offload_param": {"device": "cpu"}},
    "fp16": {"enabled": True},
}


def test_seed_config_world_sizes():
    assert consistent_world_sizes(SEED, 128) == [1, 2, 4, 8, 16, 32, 64]
    check = validate_deepspeed_config(SEED, 8)
    assert check.micro_batch == 8 and check.precision == "fp16"
    assert any("bf16" in n for n in check.notes)


@pytest.mark.parametrize("change,message", [
    ({"train_micro_batch_size_per_gpu": 16}, r"256 != .* 16 x 4 x 8 = 512"),
    ({"bf16": {"enabled": True}}, "both true"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "offload_param needs stage 3"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer needs ZeRO stage 1, 2 or 3"),
    ({"gradient_accumulation_step": 4}, "unknown key 'gradient_accumulation_step'.*"
                                        "did you mean 'gradient_accumulation_steps'"),
    ({"zero_optimization": {"stage": 3, "overlap_com": True}},
     "unknown key zero_optimization.'overlap_com'"),
])
def test_validator_rejects(change, message):
    bad = {**SEED, **change}
    validate_deepspeed_config(SEED, 8)  # the seed itself is fine on 8 ranks
    with pytest.raises(ValueError, match=message):
        validate_deepspeed_config(bad, 8)


def test_validator_rejects_world_size_without_integer_micro_batch():
    with pytest.raises(ValueError, match="not divisible .* 4 x 3 = 12"):
        validate_deepspeed_config(SEED, 3)


def test_deepspeed_config_builds_consistent():
    cfg = deepspeed_config(micro_batch=4, accum_steps=2, world_size=8, zero_stage=3,
                           offload_param=True)
    assert cfg["train_batch_size"] == 64 and cfg["bf16"] == {"enabled": True}
    assert validate_deepspeed_config(cfg, 8).zero_stage == 3
    with pytest.raises(ValueError):
        validate_deepspeed_config(cfg, 4)
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        deepspeed_config(micro_batch=4, zero_stage=2, offload_param=True)
    with pytest.raises(ValueError, match="precision='fp8'"):
        deepspeed_config(micro_batch=4, precision="fp8")


# ---- exercise checkers --------------------------------------------------------------

def _shard_step(params, grads, rank, m, v, step, lr, scale=None, l2=False):
    world_size = len(grads)
    shard = params.numel() // world_size
    lo, hi = rank * shard, (rank + 1) * shard
    g = torch.stack(grads).sum(0)[lo:hi] / (scale or world_size)
    if l2:  # Adam with L2: the decay goes through the moments
        g = g + 0.01 * params[lo:hi]
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    t = step + 1
    p = params[lo:hi] * (1 - lr * 0.01) if not l2 else params[lo:hi]
    return p - lr * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)


def test_exercise_zero1_shard_step():
    from dtlib.exercises import WrongAnswer
    from dtlib.exercises.zero import check_zero1_shard_step

    check_zero1_shard_step(_shard_step)
    with pytest.raises(WrongAnswer, match="summed gradient"):
        check_zero1_shard_step(functools.partial(_shard_step, scale=1))
    with pytest.raises(WrongAnswer, match="Adam with L2 regularisation"):
        check_zero1_shard_step(functools.partial(_shard_step, l2=True))
    with pytest.raises(WrongAnswer, match="shape"):
        check_zero1_shard_step(lambda params, *a: params)


def test_exercise_stage_memory():
    from dtlib.exercises import WrongAnswer
    from dtlib.exercises.zero import check_stage_memory

    def right(n, stage, world_size):
        shard = -(-n // world_size)
        return {"params": 2 * (shard if stage >= 3 else n),
                "grads": 2 * (shard if stage >= 2 else n),
                "optimizer": 12 * (shard if stage >= 1 else n)}

    def wrong(n, stage, world_size):  # forgets that stage 2 shards gradients
        return {**right(n, stage, world_size), "grads": 2 * n}

    check_stage_memory(right)
    with pytest.raises(WrongAnswer, match="gradients.*should be sharded"):
        check_stage_memory(wrong)
