"""Every technique composes with Chapter 8's gradient accumulation: the product test.

Each ``Parallelism`` the package exports trains the GPT (the MoE GPT for expert
parallelism) three SGD-with-momentum steps on the same global batches in three ways:
the default step (one forward and backward of its part of the batch, the mean loss),
and ``accumulation_step(2)`` and ``accumulation_step(3)`` (the summed token loss,
normalised by the global batch's tokens). All three must equal one process on the
whole batch (losses, first-step gradients, parameters after the last step) within
the bound of a reordered float32 sum, on 2 and 4 gloo ranks where the technique is
parallel. Backward runs in one place, ``Parallelism.forward_backward``, so what a
technique does there happens under accumulation too; the techniques that cannot
accumulate this way (a pipeline splits its batch into micro-batches itself; the
DeepSpeed engine accumulates by its config) raise, naming both, by design.

The case that started it: manual bf16 (``precision.parallelism``) under
accumulation used to skip the 16-bit copy and train in fp32, bit-identical to the
fp32 run; it must now differ from fp32 and stay within bf16's bound of the one-step
bf16 run.

One launch per world size runs every technique in turn; the references once, here.
"""

from __future__ import annotations

import math

import pytest
import torch

from dtlib import context_parallel, data_parallel, expert_parallel, parallel_nd, \
    pipeline_parallel, precision, tensor_parallel, zero
from dtlib.accumulation import accumulation_step
from dtlib.expert_parallel import MoEConfig, moe_gpt
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.run import Parallelism, RunConfig, run_steps
from dtlib.models.sizes import size
from dtlib.parallel_nd import build_grid_groups
from dtlib.precision.sharded import SimulatedRanks
from dtlib.runtime import dist as ddist
from dtlib.runtime import launch
from fp32_tolerance import U32

CFG = size("tiny")  # 2 blocks, hidden 32, 4 heads, seq_len 16, vocab 64
MOE = MoEConfig(n_experts=4, aux_loss_coef=0.0, z_loss_coef=0.0)  # loss: the CE
BATCH, STEPS, LR, MOMENTUM = 24, 3, 0.05, 0.9  # 24 rows: dp 4 x accum 3 x 2 rows
ACCUMS = (1, 2, 3)  # 1: the default step; k > 1: accumulation_step(k)
BF16_U = 2.0 ** -8  # bfloat16's unit roundoff (8 significant bits)


def _mesh(sizes: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ddist.world().device.type, sizes, mesh_dim_names=names)


def techniques(world_size: int) -> dict[str, tuple]:
    """name -> (factory of its Parallelism, the model it trains): every technique
    the package exports that trains a whole GPT on ``world_size`` ranks."""
    half = world_size // 2
    return {
        "ddp/torch": (lambda: data_parallel.parallelism("torch"), "gpt"),
        "ddp/naive": (lambda: data_parallel.parallelism("naive"), "gpt"),
        "ddp/bucketed": (lambda: data_parallel.parallelism("bucketed",
                                                           bucket_cap_mb=0.01), "gpt"),
        "ddp/overlapped": (lambda: data_parallel.parallelism(
            "overlapped", bucket_cap_mb=0.01), "gpt"),
        "zero-1": (lambda: zero.parallelism(1), "gpt"),
        "zero-2": (lambda: zero.parallelism(2), "gpt"),
        "zero-3": (lambda: zero.parallelism(3), "gpt"),
        "fsdp2": (lambda: zero.parallelism(3, variant="fsdp2"), "gpt"),
        "tp/ours": (lambda: tensor_parallel.parallelism("ours"), "gpt"),
        "tp/dtensor": (lambda: tensor_parallel.parallelism(
            "dtensor", mesh=_mesh((world_size,), ("tp",))), "gpt"),
        "tp_dp": (lambda: parallel_nd.parallelism(
            "tp_dp", grid=build_grid_groups(("dp", "tp"), (half, 2))), "gpt"),
        "fsdp_tp": (lambda: parallel_nd.parallelism(
            "fsdp_tp", mesh=_mesh((half, 2), ("dp", "tp"))), "gpt"),
        "hsdp": (lambda: parallel_nd.parallelism(
            "hsdp", mesh=_mesh((half, 2), ("replicate", "shard"))), "gpt"),
        "cp": (lambda: context_parallel.parallelism(), "gpt"),
        "ep": (lambda: expert_parallel.parallelism(ep=world_size), "moe"),
    }


def pipelines(world_size: int) -> dict[str, object]:
    """The techniques that refuse accumulation by design: each pipeline."""
    half = world_size // 2
    return {
        "pipeline/gpipe": lambda: pipeline_parallel.parallelism("gpipe", 2),
        "pipeline/1f1b-torch": lambda: pipeline_parallel.parallelism(
            "1f1b", 2, variant="torch"),
        "pp_dp": lambda: parallel_nd.parallelism(
            "pp_dp", grid=build_grid_groups(("dp", "pp"), (half, 2)), n_micro=2),
    }


def model_of(kind: str) -> torch.nn.Module:
    return moe_gpt(CFG, MOE, seed=0) if kind == "moe" else build_gpt(CFG, 0)


def train(par: Parallelism, kind: str, accum: int) -> dict:
    """Three steps of ``par`` on the global batches (``accum``: 1, the default
    step; else accumulation over ``accum`` micro-batches of this rank's rows)."""
    device = ddist.world().device
    config = RunConfig(STEPS, optimizer_class=torch.optim.SGD,
                       optimizer_kwargs={"lr": LR, "momentum": MOMENTUM},
                       step_fn=accumulation_step(accum) if accum > 1 else None)
    res = run_steps(par, model_of(kind).to(device), gpt_batches(CFG, BATCH, device),
                    config)
    return {"losses": res.losses, "grads": res.grads, "params": res.params}


def product(world_size: int) -> dict:
    """On every rank: every technique x ACCUMS, and every pipeline's refusal."""
    out: dict = {}
    for name, (make, kind) in techniques(world_size).items():
        for accum in ACCUMS:
            out[name, accum] = train(make(), kind, accum)
    for name, make in pipelines(world_size).items():
        par = make()
        for accum in ACCUMS[1:]:
            try:
                accumulation_step(accum)(par, None, [()] * accum)
                out[name, accum] = "ran"
            except ValueError as exc:
                out[name, accum] = str(exc)
    return out


@pytest.fixture(scope="module")
def one_rank():
    """A world of one in this process for the module (removed after it)."""
    import torch.distributed as dist

    owns = not dist.is_initialized()
    ddist.init()
    yield
    if owns:
        ddist.destroy()


@pytest.fixture(scope="module")
def references(one_rank) -> dict:
    """One process on the whole batch, per model (and the single-process
    techniques: the identity, bf16's 16-bit copy, simulated ranks in fp32)."""
    torch.set_num_threads(1)
    out = {kind: train(Parallelism(), kind, 1) for kind in ("gpt", "moe")}
    for accum in ACCUMS:
        out["identity", accum] = train(Parallelism(), "gpt", accum)
        out["simulated-4", accum] = train(SimulatedRanks(4, torch.float32), "gpt",
                                          accum)
        out["manual-bf16", accum] = train(precision.parallelism(torch.bfloat16),
                                          "gpt", accum)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request) -> tuple[int, dict]:
    return request.param, launch.spawn(product, request.param, request.param,
                                       stream=False,
                                       timeout=900)[0]


# ---- the bound ------------------------------------------------------------------------

def bounds(cfg: GPTConfig, parts: int) -> dict[str, float]:
    """What a technique and one process may differ by: the same fp32 arithmetic in
    another order (Higham's n u for a length-n sum, relative to its terms'
    magnitudes; ``tests/fp32_tolerance.py``).

    Forward passes ``n_layers + 1`` dot products of at most ``4 hidden`` terms (tp
    splits them into partial sums); the loss and every weight gradient sum the
    batch's ``BATCH x seq_len`` tokens, which ranks, micro-batches and simulated
    ranks split into ``parts`` partial sums added afterwards. Backward is as deep
    again. SGD with momentum 0.9 moves a parameter after K steps by lr times at
    most K(K+1)/2 gradients; twice that for the differences fed back into later
    gradients (lr x curvature well below 1 here).

    Returns:
        ``loss`` (relative), ``grad`` and ``param`` (relative to the reference's
        largest first-step gradient entry).
    """
    depth = (cfg.n_layers + 1) * 4 * cfg.hidden
    terms = BATCH * cfg.seq_len + parts
    grad = U32 * (2 * depth + terms)
    return {"loss": U32 * (depth + terms), "grad": grad,
            "param": 2 * LR * STEPS * (STEPS + 1) / 2 * grad}


def assert_equal(got: dict, ref: dict, parts: int, where: str,
                 scale_of: dict | None = None) -> None:
    """``got`` equals ``ref`` within :func:`bounds` (gradients and parameters
    relative to ``scale_of``'s largest gradient entry, default ``ref``'s)."""
    b = bounds(CFG, parts)
    g = max(t.abs().max().item() for t in (scale_of or ref)["grads"].values())
    assert got["grads"].keys() == ref["grads"].keys(), where
    assert got["params"].keys() == ref["params"].keys(), where
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=b["loss"], atol=0,
                               msg=lambda m: f"{where} losses: {m}")
    for name, t in got["grads"].items():
        torch.testing.assert_close(t, ref["grads"][name], rtol=0, atol=b["grad"] * g,
                                   msg=lambda m, n=name: f"{where} grad {n}: {m}")
    for name, t in got["params"].items():
        torch.testing.assert_close(t, ref["params"][name], rtol=0,
                                   atol=b["param"] * g,
                                   msg=lambda m, n=name: f"{where} param {n}: {m}")


# ---- the product ----------------------------------------------------------------------

@pytest.mark.timeout(1200)
def test_every_technique_under_accumulation_equals_one_process(ranks, references):
    world_size, got = ranks
    for name, (_, kind) in techniques(world_size).items():
        for accum in ACCUMS:
            assert_equal(got[name, accum], references[kind],
                         parts=world_size * accum,
                         where=f"{name} on {world_size} ranks, accum {accum}")


@pytest.mark.timeout(1200)
def test_a_pipeline_refuses_accumulation_naming_both(ranks):
    world_size, got = ranks
    for name in pipelines(world_size):
        for accum in ACCUMS[1:]:
            said = got[name, accum]
            assert said != "ran", (name, accum)
            assert "gradient accumulation" in said and "n_micro=2" in said, said
            assert f"n_micro = 2 x {accum}" in said, said


def test_one_process_techniques_compose(references):
    """The identity and four simulated fp32 ranks equal one process under every
    accumulation (another order of the same sums)."""
    for name in ("identity", "simulated-4"):
        for accum in ACCUMS:
            assert_equal(references[name, accum], references["gpt"],
                         parts=4 * accum, where=f"{name}, accum {accum}")


def test_bf16_runs_under_accumulation(references):
    """Manual bf16's 16-bit copy runs under accumulation: its parameters differ
    from the fp32 accumulation's by more than any reordering of fp32 sums allows
    (before the fix they were bit-identical to them: the accumulation called the
    loss and backward itself, never the technique), and stay within bf16's bound
    of the one-step bf16 run.

    Both bf16 runs round the same weights to bf16 and every row's activations
    identically; they differ in how the weight gradients' token sums are cut: one
    bf16 rounding of each micro-batch's partial sum (a relative 2**-8, BF16_U) per
    micro-batch and per layer the signal passes, forward and back, relative to
    the largest gradient entry; SGD's accumulation of it as in :func:`bounds`."""
    one_step = references["manual-bf16", 1]
    depth = 2 * (CFG.n_layers + 1)
    g = max(t.abs().max().item() for t in one_step["grads"].values())
    for accum in ACCUMS[1:]:
        got, fp32 = references["manual-bf16", accum], references["identity", accum]
        moved = max((got["params"][n] - fp32["params"][n]).abs().max().item()
                    for n in fp32["params"])
        # more than any reordering of fp32 sums could move them: bf16 ran
        assert moved > bounds(CFG, accum)["param"] * g, \
            f"accum {accum}: bf16 never ran (parameters {moved:.1e} from fp32's)"
        grad = BF16_U * accum * depth
        param = 2 * LR * STEPS * (STEPS + 1) / 2 * grad
        for name, t in got["params"].items():
            torch.testing.assert_close(t, one_step["params"][name], rtol=0,
                                       atol=param * g,
                                       msg=lambda m, n=name: f"accum {accum} {n}: {m}")
        torch.testing.assert_close(got["losses"], one_step["losses"],
                                   rtol=BF16_U * accum * depth, atol=0)
    assert not math.isnan(one_step["losses"][-1])


def test_deepspeed_refuses_accumulation_naming_both(one_rank):
    from dtlib.zero.deepspeed_engine import DeepSpeedParallelism

    par = DeepSpeedParallelism(2, 2, torch.optim.SGD, {"lr": LR})
    with pytest.raises(ValueError, match="deepspeed-2.*DeepSpeed engine accumulates"):
        accumulation_step(2)(par, None, [(), ()])


def test_fsdp2s_gradient_sync_switch_is_restored_on_leaving():
    """The one switch of every FSDP2 layout: off inside the block, on after it,
    even when the block raises; a module that is not FSDP2's is left alone."""
    from dtlib.zero.fsdp import gradient_sync

    class Switch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[bool] = []

        def set_requires_gradient_sync(self, on: bool) -> None:
            self.calls.append(on)

    m = Switch()
    with gradient_sync(m, False):
        assert m.calls == [False]
    assert m.calls == [False, True]
    with pytest.raises(RuntimeError):
        with gradient_sync(m, False):
            raise RuntimeError("a failing micro-batch")
    assert m.calls == [False, True, False, True]
    with gradient_sync(torch.nn.Linear(2, 2), False):
        pass  # no switch to turn: nothing happens


def test_clip_by_global_norm_is_torchs_clip_on_plain_tensors(one_rank):
    """The one global-norm clip (FSDP x TP, HSDP, the pipelines) on plain tensors:
    torch's ``clip_grad_norm_`` to float32 rounding (both sum the squares of a few
    hundred terms: within 2**-24 times that many of each other, relative)."""
    from dtlib.models.run import clip_by_global_norm

    gen = torch.Generator().manual_seed(0)
    ours, theirs = [], []
    for shape in ((7, 5), (11,), (3, 2, 4)):
        g = torch.randn(shape, generator=gen)
        for out in (ours, theirs):
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = g.clone()
            out.append(p)
    ours.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: skipped
    n = sum(p.numel() for p in theirs)
    total = clip_by_global_norm(ours, 0.5)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    torch.testing.assert_close(total, want, rtol=n * U32, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=2 * n * U32, atol=0)
    assert ours[-1].grad is None
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_by_global_norm(ours, 0)
