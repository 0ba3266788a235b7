"""Chapter 7: formats, autocast op dtypes, loss scaling, mixed-precision training."""

from __future__ import annotations

import argparse

import pytest
import torch

from dtlib import precision as P
from dtlib.bench import matmul
from dtlib.exercises import WrongAnswer, precision as ex
from dtlib.chapters.ch07_mixed_precision.runs import scaler_trajectory, train_losses
from dtlib.precision.loss_scaling import (DynamicLossScaler, grad_scaler_available,
                                          simulate_scale)
from dtlib.precision.mixed_precision import (ManualMixedPrecision, flushed_fraction,
                                             gradient_underflow,
                                             state_bytes_per_param)
from dtlib.models.gpt import GPTConfig, build_gpt


@pytest.mark.parametrize("row", P.format_table(), ids=lambda r: r["format"])
def test_format_table_matches_finfo_and_formulas(row):
    info = P.format_info(row["format"])
    # Formulas from the definition, exact in binary.
    p = info.mantissa_bits + 1
    assert info.precision == p
    assert info.eps == 2.0 ** -(p - 1)
    assert info.smallest_normal == 2.0 ** (1 - info.bias)
    assert info.smallest_subnormal == info.smallest_normal * info.eps
    dtype = P.torch_dtype(row["format"])
    if dtype is None:
        assert row["format"] == "tf32" and row["source"] == "definition"
        return
    fi = torch.finfo(dtype)
    assert (fi.eps, fi.smallest_normal, fi.max) == (info.eps, info.smallest_normal,
                                                     info.largest)
    assert P.subnormal_from_bits(dtype) == info.smallest_subnormal
    assert fi.bits == 1 + info.exponent_bits + info.mantissa_bits  # sign + e + m


def test_format_consequences():
    one = P.round_trip([1 + 2 ** -11, 1 + 2 ** -10, 65504.0, 65520.0], torch.float16)
    assert one.tolist() == [1.0, 1 + 2 ** -10, 65504.0, float("inf")]
    tiny = P.round_trip([2.0 ** -25, 2.0 ** -24, 1e-10], torch.float16)
    assert tiny.tolist() == [0.0, 2.0 ** -24, 0.0]
    assert P.round_trip([1e-10], torch.bfloat16).item() != 0.0


def test_format_validation():
    with pytest.raises(ValueError, match="format='fp12'"):
        P.format_info("fp12")
    with pytest.raises(ValueError, match="dtype="):
        P.autocast_op_table(lambda: None, "cpu", torch.float32)


def test_autocast_op_dtypes_on_gpt():
    cfg = GPTConfig(n_layers=1, hidden=32, seq_len=8, vocab_size=32)
    model = build_gpt(cfg)
    idx = torch.randint(0, 32, (2, 8))
    table = P.autocast_op_table(lambda: model(idx, idx), "cpu", torch.bfloat16)
    out = P.op_output_dtypes(table)
    assert out["addmm"] == {"bf16"} and out["bmm"] == {"bf16"}  # matmuls go low
    assert out["native_layer_norm"] == {"fp32"}  # fp32 residual stream in, fp32 out
    assert out["nll_loss_forward"] == {"fp32"}  # the loss is kept in fp32
    assert "fp32" in out["_to_copy"] and "bf16" in out["_to_copy"]  # autocast's casts
    assert out["_softmax"] == {"bf16"}  # CPU autocast does not keep softmax in fp32


def test_deprecated_spellings_warn_and_are_caught(recwarn):
    msgs = P.deprecated_amp_warnings()
    if hasattr(torch.cuda, "amp") and hasattr(torch.cuda.amp, "GradScaler"):
        assert any("deprecated" in m for m in msgs)
    assert not [w for w in recwarn if "deprecated" in str(w.message)]


@pytest.mark.parametrize("kw", [dict(inject_inf_at=(3, 6)),
                                dict(init_scale=2.0 ** 127, inject_inf_at=())])
def test_scaler_matches_grad_scaler(kw):
    ok, why = grad_scaler_available("cpu")
    if not ok:
        pytest.skip(why)
    ours = scaler_trajectory("ours", steps=8, **kw)
    ref = scaler_trajectory("torch", steps=8, **kw)
    assert ours["scale"] == ref["scale"]
    assert ours["skipped"] == ref["skipped"]
    assert any(ours["skipped"]) and not all(ours["skipped"])
    # Same ops in the same order: bitwise equal (tolerance 0).
    for name, p in ours["params"].items():
        torch.testing.assert_close(p, ref["params"][name], rtol=0, atol=0)


def test_scaler_rules_and_validation():
    assert simulate_scale([False, False, True, False], 8.0, growth_interval=2) == \
        [8.0, 16.0, 8.0, 8.0]
    assert simulate_scale([False], 2.0 ** 127, growth_interval=1) == [2.0 ** 127]
    for kw, msg in ((dict(init_scale=0.0), "init_scale"),
                    (dict(growth_factor=1.0), "growth_factor"),
                    (dict(backoff_factor=1.5), "backoff_factor"),
                    (dict(growth_interval=0), "growth_interval")):
        with pytest.raises(ValueError, match=msg):
            DynamicLossScaler(**kw)
    s = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="update"):
        s.update()


def test_ieee_constants_match_torch_finfo():
    # Exact: every constant is a power of two or (2 - 2**-m) * 2**bias, exact in
    # float64, and finfo reports the same doubles.
    for dtype, (e, m) in ((torch.float16, (5, 10)), (torch.bfloat16, (8, 7)),
                          (torch.float32, (8, 23)), (torch.float64, (11, 52))):
        fi = torch.finfo(dtype)
        assert ex.ieee_constants(e, m) == (fi.eps, fi.smallest_normal * fi.eps, fi.max)
    with pytest.raises(ValueError, match="e_bits"):
        ex.ieee_constants(1, 3)


def test_activation_gradients_shrink_as_one_over_tokens_weight_gradients_do_not():
    rows = gradient_underflow(torch.float16, (2, 32))
    growth = rows[1]["tokens"] / rows[0]["tokens"]
    act_fall = rows[0]["act_median"] / rows[1]["act_median"]
    weight_fall = rows[0]["weight_median"] / rows[1]["weight_median"]
    # The mean's 1/T is exact for every per-token gradient; the median of a
    # different sample of tokens moves by sampling noise, well under a factor 2.
    assert growth / 2 < act_fall < growth * 2
    assert weight_fall < act_fall / 2
    assert rows[1]["act_grads"].dtype == torch.float32
    with pytest.raises(ValueError, match="batches"):
        gradient_underflow(torch.float16, (0,))


def test_widest_input_list_and_fp32_precision_setting():
    from dtlib.precision import (CPU_PROMOTE_OPS, CUDA_PROMOTE_OPS,
                                 fp32_matmul_precision, widest_input_demo)

    assert "dot" in CUDA_PROMOTE_OPS and "index_copy" in CPU_PROMOTE_OPS
    demo = widest_input_demo("cpu")
    assert demo["op"] == "index_copy" and demo["with autocast"] == "fp32"
    assert demo["without autocast"].startswith("error")
    before = fp32_matmul_precision()
    assert before in ("ieee", "tf32", "none")
    with pytest.raises(ValueError, match="mode"):
        fp32_matmul_precision("fast")


def test_underflow_demo_numbers():
    fp16 = flushed_fraction(torch.float16)["flushed"]
    fp16_scaled = flushed_fraction(torch.float16, 2.0 ** 16)["flushed"]
    bf16 = flushed_fraction(torch.bfloat16)["flushed"]
    assert fp16 > 0.05  # a large share of the gradient is lost
    assert fp16_scaled < 0.01 and bf16 < 0.01
    with pytest.raises(ValueError, match="loss_scale"):
        flushed_fraction(torch.float16, 0.0)


def test_mixed_precision_close_to_fp32():
    fp32 = torch.tensor(train_losses("fp32"))
    auto = torch.tensor(train_losses("autocast"))
    manual = torch.tensor(train_losses("manual"))
    assert fp32[-1] < fp32[0] - 0.1  # it trains
    # bf16 has 8 significant bits: losses agree to 0.1 nats over 12 steps.
    torch.testing.assert_close(auto, fp32, rtol=0, atol=0.1)
    torch.testing.assert_close(manual, auto, rtol=0, atol=0.1)
    with pytest.raises(ValueError, match="mode"):
        train_losses("fp8")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_precision_parallelism_is_the_manual_recipe(dtype):
    """run_steps with precision.parallelism runs ManualMixedPrecision's step: the same
    ops in the same order, so bitwise the same (tolerance 0), fp16 with a scaler."""
    from dtlib.models.gpt import token_batch
    from dtlib.models.run import RunConfig, TrainState, run_steps

    cfg = GPTConfig(n_layers=1, hidden=16, seq_len=8, vocab_size=16)
    batches = [token_batch(cfg, 2, seed=i) for i in range(3)]
    scaler = (lambda: DynamicLossScaler()) if dtype == torch.float16 else \
        (lambda: None)
    res = run_steps(P.parallelism(dtype), build_gpt(cfg, 0), batches.__getitem__,
                    RunConfig(3, optimizer_class=torch.optim.SGD,
                              optimizer_kwargs={"lr": 0.1}),
                    TrainState(scaler=scaler()))
    model = build_gpt(cfg, 0)
    mp = ManualMixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              dtype, scaler())
    losses = [mp.step(*b)[0] for b in batches]
    assert res.losses == losses
    for name, p in model.named_parameters():
        torch.testing.assert_close(res.params[name], p.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="dtype"):
        P.parallelism(torch.float32)


def test_state_bytes_per_param_is_16():
    model = build_gpt(GPTConfig(n_layers=1, hidden=16, seq_len=8, vocab_size=16))
    opt = torch.optim.Adam(model.parameters())
    mp = ManualMixedPrecision(model, opt, torch.bfloat16)
    idx = torch.randint(0, 16, (2, 8))
    mp.step(idx, idx)
    b = state_bytes_per_param(mp)
    assert (b["params_16"], b["grads_16"], b["master_32"], b["optimizer"]) == \
        (2, 2, 4, 8)
    assert b["total"] == 16
    with pytest.raises(ValueError, match="dtype"):
        ManualMixedPrecision(model, opt, torch.float32)


def _constants(e, m):
    bias = 2 ** (e - 1) - 1
    return 2.0 ** -m, 2.0 ** (1 - bias - m), (2 - 2.0 ** -m) * 2.0 ** bias


def test_checkers_accept_right_and_reject_wrong(capsys):
    from dtlib.exercises.tripwires import ShortcutTaken

    ex.check_format_constants(_constants)
    # the checker's truth agrees (judged with its tripwires off), and as an answer
    # it is refused
    ex.check_format_constants.__wrapped__(ex.ieee_constants)
    with pytest.raises(ShortcutTaken, match="ieee_constants"):
        ex.check_format_constants(ex.ieee_constants)
    with pytest.raises(WrongAnswer, match="eps"):  # p - 1 taken for p
        ex.check_format_constants(lambda e, m: (2.0 ** -(m + 1),
                                                *_constants(e, m)[1:]))
    with pytest.raises(WrongAnswer, match="subnormal"):  # the smallest normal instead
        ex.check_format_constants(lambda e, m: (2.0 ** -m, 2.0 ** (2 - 2 ** (e - 1)),
                                                _constants(e, m)[2]))
    vals = list(ex.UNDERFLOW_VALUES)  # 3e-5, 5e-8, 2e-8, 1e-20, 1e-45
    fp16, bf16 = [False, False, True, True, True], [False, False, False, False, True]
    ex.check_underflow_prediction(vals, fp16, bf16)
    with pytest.raises(WrongAnswer, match="2e-08"):
        ex.check_underflow_prediction(vals, [False] * 5, bf16)
    for fewer in ([], vals[:3]):  # predicting for fewer values predicts nothing
        with pytest.raises(WrongAnswer, match="values lacks"):
            ex.check_underflow_prediction(fewer, fp16[:len(fewer)], bf16[:len(fewer)])
    assert capsys.readouterr().out.count("Correct") == 3


def test_matmul_bench_records():
    parser = argparse.ArgumentParser()
    matmul.add_arguments(parser)
    records = matmul.run(parser.parse_args(
        ["--sizes", "32", "--dtypes", "bf16", "fp32", "--iters", "2", "--repeats", "2",
         "--warmup", "1"]))
    assert [r["dtype"] for r in records] == ["fp32", "bf16"]
    for r in records:
        assert {"dtype", "size", "time_s", "tflops", "ratio_to_fp32"} <= set(r)
        assert r["size"] == 32 and r["time_s"] > 0
        assert r["tflops"] == pytest.approx(2 * 32 ** 3 / r["time_s"] / 1e12)
    assert records[0]["ratio_to_fp32"] == 1.0
    with pytest.raises(ValueError, match="iters"):
        matmul.time_matmul(8, torch.float32, torch.device("cpu"), iters=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_scaler_and_autocast():
    dev = torch.device("cuda", 0)
    ours = scaler_trajectory("ours", steps=6, inject_inf_at=(2,), device=dev)
    ref = scaler_trajectory("torch", steps=6, inject_inf_at=(2,), device=dev)
    assert ours["scale"] == ref["scale"] and ours["skipped"] == ref["skipped"]
    for name, p in ours["params"].items():
        torch.testing.assert_close(p, ref["params"][name], rtol=1e-6, atol=1e-7)
    cfg = GPTConfig(n_layers=1, hidden=32, seq_len=8, vocab_size=32)
    model = build_gpt(cfg).to(dev)
    idx = torch.randint(0, 32, (2, 8), device=dev)
    out = P.op_output_dtypes(P.autocast_op_table(lambda: model(idx, idx), "cuda"))
    assert out["_softmax"] == {"fp32"}  # CUDA's fp32 list includes softmax
    assert out["addmm"] == {"bf16"}


# ---- the scaler beside GradScaler: several optimizers, misuse, floor, state --------

def _two_optimizer_run(make_scaler, steps: int = 4, inf_at: int = 1) -> list:
    """Two models, two optimizers, one scaler: step(oa); step(ob); update()."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.SGD(b.parameters(), lr=1e-1)
    scaler = make_scaler()
    x = torch.randn(8, 4)
    for i in range(steps):
        scaler.scale(a(x).pow(2).mean() + b(x).pow(2).mean()).backward()
        if i == inf_at:
            a.weight.grad[0, 0] = float("inf")  # only optimizer a overflows
        scaler.unscale_(oa)
        scaler.step(oa)
        scaler.step(ob)  # unscaled inside step
        scaler.update()
        oa.zero_grad()
        ob.zero_grad()
    return [p.detach().clone() for p in [*a.parameters(), *b.parameters()]] + \
        [torch.tensor(scaler.get_scale())]


def test_scaler_two_optimizers_equal_grad_scaler():
    kw = dict(init_scale=1024.0, growth_interval=2)
    ours = _two_optimizer_run(lambda: DynamicLossScaler(**kw))
    ref = _two_optimizer_run(lambda: torch.amp.GradScaler("cpu", **kw))
    for o, r in zip(ours, ref):  # same kernels, same order: bitwise (tolerance 0)
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_scaler_refuses_double_step_and_double_unscale():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = DynamicLossScaler()
    s.scale(p.sum()).backward()
    s.step(opt)
    with pytest.raises(RuntimeError, match="step.. has already been called"):
        s.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        s.unscale_(opt)
    s.update()
    s.scale(p.sum()).backward()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_.. has already been called"):
        s.unscale_(opt)


def test_scaler_never_reaches_zero():
    from dtlib.precision.loss_scaling import MIN_SCALE

    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = DynamicLossScaler(init_scale=2.0 ** 16)
    for _ in range(300):  # 300 overflows in a row: 2**16 * 2**-300 would be 0
        s.scale(p.sum()).backward()
        p.grad.fill_(float("nan"))
        assert s.step(opt) is False
        s.update()
        opt.zero_grad()
    assert s.get_scale() == MIN_SCALE > 0
    s.scale(p.sum()).backward()  # a clean step still works
    assert s.step(opt) is True
    assert torch.isfinite(p).all()


def test_scaler_state_dict_round_trip_and_grad_scaler_keys():
    s = DynamicLossScaler(init_scale=256.0, growth_interval=3)
    s._update_scale(True)
    s._update_scale(False)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {
        "scale": 128.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 3, "_growth_tracker": 1}
    g = torch.amp.GradScaler("cpu", init_scale=64.0)
    t.load_state_dict(g.state_dict())
    assert t.get_scale() == 64.0
    with pytest.raises(ValueError, match="scale"):
        t.load_state_dict({**s.state_dict(), "scale": 0.0})


def test_scaler_unscale_does_not_synchronise(monkeypatch):
    """The inf check stays a device tensor in unscale_; step reads it once."""
    calls = []
    for name in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            calls.append(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(5)]
    opt = torch.optim.SGD(ps, lr=0.1)
    s = DynamicLossScaler()
    s.scale(sum(p.sum() for p in ps)).backward()
    calls.clear()
    s.unscale_(opt)
    assert calls == []
    s.step(opt)
    s.update()
    assert calls == ["item"]


def test_the_tf32_switches_behave_as_chapter_7_says() -> None:
    """Chapter 7: setting the legacy ``allow_tf32`` neither warns nor fails; after
    ``fp32_precision`` was set, reading ``allow_tf32`` raises (mixed APIs)."""
    import warnings

    matmul = torch.backends.cuda.matmul
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) != (2, 13):
        pytest.skip("the chapter states torch 2.13's behaviour")
    before = matmul.fp32_precision
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning would fail here
            matmul.allow_tf32 = False
        matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            _ = matmul.allow_tf32
    finally:
        matmul.fp32_precision = before
