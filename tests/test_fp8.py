"""FP8 from scratch (Chapter 7, "FP8"): quantisers against reference formulas, the
``_scaled_mm`` path against dequantised matmuls, Float8Linear's gradients against
nn.Linear's within bounds derived from the formats. One process, no launch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dtlib.models.gpt import build_gpt, token_batch
from dtlib.models.sizes import size
from dtlib.precision import float8_linear as f8l
from dtlib.precision import fp8
from dtlib.precision.formats import format_info

FORMATS = fp8.FP8_FORMATS
HAS_SCALED_MM = hasattr(torch, "_scaled_mm")


def reference_round(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round-to-nearest-even onto ``fmt``'s grid, written from the format's definition
    (fp64): a value of binade ``2**e`` (``e`` at least the smallest normal's
    exponent) sits on a grid of spacing ``2**(e - m)``; beyond ``max`` it saturates."""
    info = format_info(fmt)
    v = v.double().clamp(-info.largest, info.largest)
    emin = 1 - info.bias
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** (emin - 40)))).clamp(min=emin)
    spacing = torch.exp2(e - info.mantissa_bits)
    return torch.round(v / spacing) * spacing  # torch.round: ties to even


def error_bound(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """Largest |dequantize(quantize(x)) - x| the format allows, elementwise (fp64):
    half a spacing, i.e. ``2**-(m+1) |x s|`` for a normal ``x s`` and half the
    smallest subnormal below the normals, divided by the scale. Holds when nothing
    saturates (the scale is max / amax or smaller)."""
    info = format_info(fmt)
    xs = (x.double() * scale.double()).abs()
    half = torch.maximum(xs * 2.0 ** -(info.mantissa_bits + 1),
                         torch.full_like(xs, info.smallest_subnormal / 2))
    return half / scale.double()


def spread(n: int, lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    """``n`` magnitudes log-uniform in [lo, hi], random signs (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(n).uniform_(torch.log(torch.tensor(lo)).item(),
                                            torch.log(torch.tensor(hi)).item(),
                                            generator=gen))
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    return mag * sign


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_max_and_scale_rule(fmt):
    m = fp8.fp8_max(fmt)
    assert m == torch.finfo(fp8.fp8_dtype(fmt)).max == {"fp8_e4m3": 448.0,
                                                          "fp8_e5m2": 57344.0}[fmt]
    x = spread(1000, 1e-3, 3.0)
    a = fp8.amax(x)
    s = fp8.choose_scale(a, fmt)
    assert torch.equal(s, m / a)  # scale = max / amax
    q = fp8.quantize(x, fmt, s)
    assert q.dtype == fp8.fp8_dtype(fmt)
    assert q.float().abs().max().item() == m  # amax lands on the format's max
    # An all-zero tensor gets a finite scale (amax clamped), and quantises to 0.
    z = torch.zeros(4)
    sz = fp8.choose_scale(fp8.amax(z), fmt)
    assert torch.isfinite(sz) and fp8.quantize(z, fmt, sz).float().eq(0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_equals_reference_and_bound(fmt):
    info = format_info(fmt)
    # Magnitudes from deep in the subnormals to amax, after scaling.
    x = spread(5000, 1e-9, 5.0, seed=1)
    s = fp8.choose_scale(fp8.amax(x), fmt)
    q = fp8.quantize(x, fmt, s)
    # Bit for bit the definition's grid (fp32's x * s is exact up to its own rounding,
    # which the reference sees too: it rounds the same fp32 product).
    torch.testing.assert_close(q.double(), reference_round(x * s, fmt),
                               rtol=0, atol=0)
    back = fp8.dequantize(q, s).double()
    xs = (x * s).double().abs()
    normal = xs >= info.smallest_normal
    assert normal.sum() > 100 and (~normal).sum() > 100  # both regimes tested
    rel = ((back - x.double()).abs() / x.double().abs())[normal]
    # Normal values: relative error <= 2**-(m+1), half a spacing; plus the fp32
    # rounding of x * s and of q / s (2 * 2**-24, relative).
    assert rel.max().item() <= 2.0 ** -(info.mantissa_bits + 1) + 2 * 2.0 ** -24
    assert ((back - x.double()).abs() <= error_bound(x, fmt, s) * (1 + 2 ** -22)).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_at_the_format_max(fmt):
    m = fp8.fp8_max(fmt)
    x = torch.tensor([1.0, -1.0, 3.0, -1e30, float("inf")])
    q = fp8.quantize(x, fmt, torch.tensor(m))  # scale too large: 1 -> max already
    assert q.float().tolist() == [m, -m, m, -m, m]  # saturated, never inf


def test_per_row_scaling_survives_an_outlier_row():
    fmt = "fp8_e4m3"
    info = format_info(fmt)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 64, generator=gen)
    x[3] *= 1e5  # one outlier row (a token with huge activations)
    rows = torch.arange(16) != 3
    per_tensor = fp8.choose_scale(fp8.amax(x), fmt)
    per_row = fp8.choose_scale(fp8.amax(x, -1), fmt)
    assert per_row.shape == (16, 1)
    errs = {}
    for name, s in (("tensor", per_tensor), ("row", per_row)):
        back = fp8.dequantize(fp8.quantize(x, fmt, s), s)
        errs[name] = ((back - x).abs() / x.abs())[rows]
    # Per row: each row's own amax maps to max; every entry obeys the format's bound.
    assert (errs["row"].double() * x.abs()[rows].double()
            <= error_bound(x, fmt, per_row)[rows] * (1 + 2 ** -22)).all()
    # Per tensor: the outlier's amax (> 1e5) maps to 448, a scale < 5e-3, so an
    # ordinary entry (|x| < 4 in 960 normal draws) scales below 2e-2 ... in fact below
    # 2**-6, the smallest normal: all subnormal, 2**-9 apart, the typical one
    # (|x| ~ 0.7 -> ~3e-3) off by a large fraction of itself, far above 2**-4.
    scaled = (x[rows] * per_tensor).abs()
    assert (scaled < info.smallest_normal).all()
    assert errs["tensor"].median() > 2.0 ** -(info.mantissa_bits + 1)
    assert errs["row"].median() < errs["tensor"].median() / 4


def test_delayed_scaling_history_window():
    fmt = "fp8_e4m3"
    hist = fp8.AmaxHistory(history=3)
    one, spike = torch.tensor(1.0), torch.tensor(100.0)
    seen = []
    for current in (one, spike, one, one, one, one):
        seen.append(hist.scale(fmt, current).item())
        hist.record(current)
    m = fp8.fp8_max(fmt)
    # Step 0: empty history -> this step's amax; step 1 is cast with step 0's amax (the
    # spike is not seen yet); steps 2-4 see the spike in the window of 3; step 5 not.
    assert seen == pytest.approx([m, m, m / 100, m / 100, m / 100, m])
    assert len(hist.amaxes) == 3
    # Step 1's spike, cast with the old scale, saturates; current scaling does not.
    x = torch.tensor([100.0, 1.0])
    delayed = fp8.dequantize(fp8.quantize(x, fmt, torch.tensor(seen[1])),
                             torch.tensor(seen[1]))
    current = fp8.choose_scale(fp8.amax(x), fmt)
    assert delayed[0].item() == 1.0 and delayed[1].item() == 1.0
    assert fp8.dequantize(fp8.quantize(x, fmt, current), current)[0].item() == 100.0
    with pytest.raises(ValueError, match="history"):
        fp8.AmaxHistory(0)


def _gemm_bound(ad: torch.Tensor, bd: torch.Tensor, out_dtype: torch.dtype
                ) -> torch.Tensor:
    """|scaled_mm - exact product of the dequantised operands| allowed (fp64): the
    products of two fp8 values are exact in fp32 (at most 2 x 4 significant bits),
    their sum over K loses at most K fp32 roundings (gamma_K ~ K 2**-24 of the sum
    of |products|), the two inverse scales one rounding each; a bf16 output rounds
    once more, by half its spacing, 2**-8 relative."""
    k = ad.size(1)
    mag = ad.abs() @ bd.abs()
    bound = (k + 3) * 2.0 ** -24 * mag
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * ((ad @ bd).abs() + bound)
    return bound


@pytest.mark.skipif(not HAS_SCALED_MM, reason="this torch has no torch._scaled_mm")
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_equals_dequantized_fp32_matmul(scaling, out_dtype):
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(24, 48, generator=gen), torch.randn(48, 40, generator=gen) * 5
    fa, fb = "fp8_e4m3", "fp8_e4m3"
    if scaling == "row":
        sa, sb = fp8.choose_scale(fp8.amax(a, -1), fa), fp8.choose_scale(
            fp8.amax(b, 0), fb)
    else:
        sa, sb = fp8.choose_scale(fp8.amax(a), fa), fp8.choose_scale(fp8.amax(b), fb)
    qa, qb = fp8.quantize(a, fa, sa), fp8.quantize(b, fb, sb)
    out, ran = fp8.scaled_mm(qa, qb, sa, sb, out_dtype=out_dtype, path="scaled_mm")
    assert ran == "scaled_mm" and out.dtype == out_dtype
    ad, bd = qa.double() / sa.double(), qb.double() / sb.double()
    diff = (out.double() - ad @ bd).abs()
    assert (diff <= _gemm_bound(ad, bd, out_dtype)).all(), diff.max()
    # The fallback computes the same thing in fp32, and must obey the same bound.
    ref, ran = fp8.scaled_mm(qa, qb, sa, sb, out_dtype=out_dtype, path="dequantized")
    assert ran == "dequantized"
    assert ((ref.double() - ad @ bd).abs() <= _gemm_bound(ad, bd, out_dtype)).all()


def test_auto_path_falls_back_where_scaled_mm_refuses(monkeypatch):
    def refuse(*args, **kwargs):  # as a GPU refuses E5M2 x E5M2, or an old torch
        raise RuntimeError("Multiplication of two Float8_e5m2 matrices is not "
                           "supported")

    monkeypatch.setattr(torch, "_scaled_mm", refuse, raising=False)
    gen = torch.Generator().manual_seed(7)
    lin = f8l.Float8Linear(8, 4, scaling="tensor")
    x = torch.randn(3, 8, generator=gen, requires_grad=True)
    lin(x).sum().backward()
    assert lin.recipe.paths == {"dequantized": 3}  # all three GEMMs fell back
    one = torch.tensor(1.0)
    q = fp8.quantize(torch.ones(2, 2), "fp8_e4m3", one)
    with pytest.raises(RuntimeError, match="not supported"):
        fp8.scaled_mm(q, q, one, one, path="scaled_mm")  # forced: the error shows
    monkeypatch.delattr(torch, "_scaled_mm")
    with pytest.raises(ValueError, match="no torch._scaled_mm"):
        fp8.scaled_mm(q, q, one, one, path="scaled_mm")
    assert fp8.scaled_mm(q, q, one, one)[1] == "dequantized"


def _linear_bound(x, ex, w, ew):
    """|fp8 x @ w.T - x @ w.T| allowed (fp64), from elementwise operand errors ex, ew:
    |xq wq - x w| <= ex |w| + |x| ew + ex ew per product, then the GEMM's own
    rounding (_gemm_bound, bf16 out)."""
    e = ex @ w.abs().t() + x.abs() @ ew.t() + ex @ ew.t()
    xq, wq = x.abs() + ex, w.abs() + ew
    return e + _gemm_bound(xq, wq.t(), torch.bfloat16) + 2.0 ** -8 * e


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_float8_linear_matches_linear_within_format_bounds(scaling):
    gen = torch.Generator().manual_seed(4)
    lin = nn.Linear(32, 48, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 32, generator=gen) * 0.1)
        lin.bias.copy_(torch.randn(48, generator=gen))
    f8 = f8l.Float8Linear(32, 48, scaling=scaling)
    with torch.no_grad():
        f8.weight.copy_(lin.weight)
        f8.bias.copy_(lin.bias)
    x = torch.randn(2, 10, 32, generator=gen)
    G = torch.randn(2, 10, 48, generator=gen)  # the upstream gradient, exact
    xd = x.double().requires_grad_()
    (lin(xd) * G.double()).sum().backward()
    xf = x.clone().requires_grad_()
    y = f8(xf)
    (y * G).sum().backward()
    assert f8.recipe.paths.total() == 3  # forward, grad_x, grad_w
    if HAS_SCALED_MM:
        assert f8.recipe.paths["scaled_mm"] == 3
    x2, g2, w = x.reshape(-1, 32).double(), G.reshape(-1, 48).double(), \
        lin.weight.detach()
    row = scaling == "row"
    e4, e5 = "fp8_e4m3", "fp8_e5m2"

    def s(t, fmt, dim):  # the scale rule: max / amax, per row along dim or per tensor
        return fp8.choose_scale(fp8.amax(t, dim) if row else fp8.amax(t), fmt)

    # forward: y = x @ w.T, x per row (token), w per row (output feature); + bias
    ex, ew = error_bound(x2, e4, s(x2, e4, -1)), error_bound(w, e4, s(w, e4, -1))
    bound = _linear_bound(x2, ex, w, ew) + 2.0 ** -24 * (x2 @ w.t()).abs()
    diff = (y.reshape(-1, 48).double() - lin(x2).detach()).abs()
    assert (diff <= bound).all(), (diff / bound).max()
    # grad_x = G @ w: G (E5M2) per row, w per column.
    eg, ew0 = error_bound(g2, e5, s(g2, e5, -1)), error_bound(w, e4, s(w, e4, 0))
    bound = _linear_bound(g2, eg, w.t(), ew0.t())
    diff = (xf.grad.reshape(-1, 32).double() - xd.grad.reshape(-1, 32)).abs()
    assert (diff <= bound).all(), (diff / bound).max()
    # grad_w = G.T @ x: G per column, x per column.
    eg0, ex0 = error_bound(g2, e5, s(g2, e5, 0)), error_bound(x2, e4, s(x2, e4, 0))
    bound = _linear_bound(g2.t(), eg0.t(), x2.t(), ex0.t())
    diff = (f8.weight.grad.double() - lin.weight.grad).abs()
    assert (diff <= bound).all(), (diff / bound).max()
    # The bias's gradient never enters FP8: G summed over 20 tokens in fp32.
    torch.testing.assert_close(f8.bias.grad.double(), lin.bias.grad,
                               rtol=20 * 2.0 ** -24, atol=20 * 2.0 ** -24 * 5)


def test_delayed_first_step_is_current_scaling_then_uses_history():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(16, 8, generator=gen)
    x = torch.randn(4, 8, generator=gen)
    outs = {}
    for scaling in ("tensor", "delayed"):
        lin = f8l.Float8Linear(8, 16, bias=False, scaling=scaling, history=2)
        with torch.no_grad():
            lin.weight.copy_(w)
        outs[scaling] = [lin(x * k).detach() for k in (1.0, 100.0)]
        if scaling == "delayed":
            assert len(lin.recipe.histories["x"].amaxes) == 2
    assert torch.equal(outs["tensor"][0], outs["delayed"][0])
    # Second call: input 100x larger, delayed scaling still uses the first amax:
    # everything above it saturates, so the output is far smaller than current's.
    assert outs["delayed"][1].abs().max() < outs["tensor"][1].abs().max() / 5


def test_swap_linears_keeps_the_head_and_ties():
    model = build_gpt(size("tiny"))
    n_params = sum(p.numel() for p in model.parameters())
    swapped = f8l.swap_linears(model, scaling="row")
    assert "head" not in swapped and len(swapped) == 4 * size("tiny").n_layers
    assert type(model.head) is nn.Linear
    assert model.head.weight is model.tok_emb.weight  # still tied
    assert all(isinstance(model.get_submodule(n), f8l.Float8Linear) for n in swapped)
    assert sum(p.numel() for p in model.parameters()) == n_params
    _, loss = model(*token_batch(size("tiny"), 2))
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].fc.weight.grad is not None
    everything = f8l.swap_linears(build_gpt(size("tiny-untied")),
                                  filter_fn=lambda name, mod: True)
    assert "head" in everything


@pytest.mark.parametrize("call, match", [
    (lambda: fp8.fp8_max("fp8_e3m4"), "fmt"),
    (lambda: f8l.Float8Linear(4, 4, scaling="block"), "scaling"),
    (lambda: f8l.Float8Linear(4, 4, path="fast"), "path"),
    (lambda: fp8.scaled_mm(torch.zeros(1), torch.zeros(1), torch.tensor(1.0),
                           torch.tensor(1.0), path="gpu"), "path"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fsdp_fp8_allgather_bytes_counted_from_the_model():
    from dtlib.chapters.ch07_mixed_precision.fp8 import fsdp_allgather_bytes

    cfg = size("bench-ddp")
    out = fsdp_allgather_bytes(cfg, 8)
    h = cfg.hidden
    # Swapped weights per block: qkv 3h x h, proj h x h, fc 4h x h, fc_proj h x 4h.
    assert out["fp8_params"] == 12 * h * h * cfg.n_layers
    assert out["params"] == sum(p.numel() for p in build_gpt(cfg).parameters())
    share = 7 / 8  # a rank receives the other 7 shards
    assert out["bf16_bytes"] == share * 2 * out["params"]
    assert out["fp8_bytes"] == share * (2 * out["params"] - out["fp8_params"])
    assert out["amax_bytes"] == 4 * 4 * cfg.n_layers
    with pytest.raises(ValueError, match="world_size"):
        fsdp_allgather_bytes(cfg, 1)


def test_linear_roofline_limits():
    from dtlib.chapters.ch07_mixed_precision.fp8 import H100, linear_roofline, \
        step_speedup

    big = linear_roofline(16384, 8192, 8192)
    m, k, n = 16384, 8192, 8192
    # Compute-bound: bf16 time is FLOPs / peak, FP8's GEMMs twice as fast; the cast
    # reads 2 + 2 bytes and writes 1 per element of x, w and the output gradient.
    assert big["bf16_s"] == 6 * m * k * n / H100["bf16_flops"]
    assert big["cast_s"] == 5 * (m * k + k * n + m * n) / H100["hbm_bytes"]
    assert 1.0 < big["speedup"] < H100["fp8_flops"] / H100["bf16_flops"]
    assert linear_roofline(64, 32, 128)["speedup"] < 1.0  # small: casts dominate
    assert step_speedup(0.0, 2.0) == 1.0 and step_speedup(1.0, 2.0) == 2.0
    assert step_speedup(0.5, 2.0) == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="gemm_share"):
        step_speedup(1.5, 2.0)
    with pytest.raises(ValueError, match="tokens"):
        linear_roofline(0, 1, 1)


def test_fp8_training_runs_every_recipe_through_the_loop():
    from dtlib.chapters.ch07_mixed_precision.fp8 import RECIPES, fp8_training

    out = fp8_training(steps=2)
    assert set(out["losses"]) == set(RECIPES)
    n_layers = len(out["swapped"])
    for label, scaling in RECIPES.items():
        assert len(out["losses"][label]) == 2
        # Three GEMMs per swapped layer per step, none for bf16.
        assert out["paths"][label].total() == (0 if scaling is None
                                               else 3 * n_layers * 2)
    # Step 0: the same weights and batch. Cross-entropy moves by at most twice the
    # largest change of a logit (its gradient in the logits has L1 norm <= 2); at
    # initialisation (weights of std 0.02) the logits are far below 1, and 8-bit
    # GEMMs (2**-4 relative per operand) or bf16 move them by well under 0.05.
    base = out["losses"]["bf16"][0]
    assert all(abs(v[0] - base) < 0.1 for v in out["losses"].values())
    with pytest.raises(ValueError, match="steps"):
        fp8_training(steps=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_float8_linear_on_cuda_matches_the_dequantized_path(scaling):
    from dtlib.runtime.dist import world

    device = world().device
    if device.type != "cuda":
        pytest.skip("the world's device is not CUDA")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(64, 32, generator=gen).to(device)  # dims divisible by 16
    w = (torch.randn(48, 32, generator=gen) * 0.1).to(device)
    outs = {}
    for path in ("auto", "dequantized"):
        lin = f8l.Float8Linear(32, 48, bias=False, scaling=scaling, path=path,
                               device=device)
        with torch.no_grad():
            lin.weight.copy_(w)
        xi = x.clone().requires_grad_()
        y = lin(xi)
        y.sum().backward()
        outs[path] = (y.detach(), xi.grad, lin.weight.grad, lin.recipe.paths)
    assert outs["auto"][3].total() == 3
    if torch.cuda.get_device_capability(device) >= (8, 9) and scaling == "tensor":
        assert outs["auto"][3]["scaled_mm"] >= 1  # E4M3 x E4M3 runs on FP8 units
    # Same fp8 operands and scales in both paths; the products are exact in fp32,
    # each path's sum over K rounds at most K times (K 2**-24 of the sum of
    # |products|, which an operand's fp8 rounding makes at most (1 + 2**-3)**2 times
    # the sum of |exact products|; + 2 for the dequantised path's q / s), then each
    # rounds to bf16 (2**-8 relative): the two differ by at most twice both.
    ones = torch.ones(64, 48, device=device)
    sums = (x.abs() @ w.abs().t(), ones @ w.abs(), ones.t() @ x.abs())
    for got, ref, mag, k in zip(outs["auto"][:3], outs["dequantized"][:3], sums,
                                (32, 48, 64)):
        tol = (2 * 2.0 ** -8 * ref.abs().float()
               + 2 * (k + 2) * 2.0 ** -24 * 1.27 * mag)
        assert ((got.float() - ref.float()).abs() <= tol * (1 + 2.0 ** -7)).all()
