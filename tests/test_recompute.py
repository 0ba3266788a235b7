"""Chapter 12: fused attention and activation recomputation, measured to the byte.

Memory: bytes autograd saves for one block (``measure_activations``, de-duplicated by
storage) equal the term-by-term formula exactly (fp32, no dropout, CPU), for every
recomputation mode and both attention cores. FLOPs: ``FlopCounterMode`` matmul counts
equal Korthikanti et al.'s recomputation cost exactly, with checkpointing's early stop
off (the paper's count) and on (torch's default, which skips each region's last
matmul). Results: the fused core equals the explicit one to rounding (the kernel
sums in another order; derived in ``fp32_tolerance.py`` as for the whole GPT: the
longest reduction ``4h`` terms, ``b * s`` tokens per weight gradient, ~8 reductions
on the path, relative to each tensor's largest element); recomputation changes
nothing at all (bit-for-bit: the same ops run again on the same inputs).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fp32_tolerance import assert_all_scaled, assert_scaled, reorder_rel
from dtlib.memory.recompute import (RECOMPUTE_MODES, apply_recompute,
                                    measure_recompute_flops, measure_recompute_layer,
                                    recompute_activation_terms, recompute_extra_flops)
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.reference import grads_of
from dtlib.models.sizes import size

CFG = size("tiny")
REL = reorder_rel(4 * CFG.hidden, 8, 2 * CFG.seq_len)


def _run(cfg: GPTConfig, mode: str = "none") -> tuple[torch.Tensor, dict]:
    model = apply_recompute(build_gpt(cfg, seed=0), mode)
    idx, targets = token_batch(cfg, 2, seed=0)
    logits, loss = model(idx, targets)
    loss.backward()
    return logits.detach(), grads_of(model)


def test_sdpa_attention_equals_explicit() -> None:
    out_e, g_e = _run(CFG)
    out_f, g_f = _run(replace(CFG, attention="sdpa"))
    assert_scaled(out_f, out_e, REL, "logits")
    assert_all_scaled(g_f, g_e, REL, "grad")


def test_default_attention_is_explicit_and_bad_choice_is_named() -> None:
    assert GPTConfig().attention == "explicit"
    with pytest.raises(ValueError, match="attention='flash'"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="mode='some'"):
        apply_recompute(build_gpt(CFG), "some")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_changes_no_result(mode: str) -> None:
    out0, g0 = _run(CFG)
    out1, g1 = _run(CFG, mode)
    assert torch.equal(out0, out1)
    assert all(torch.equal(g1[n], g) for n, g in g0.items())


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_saved_bytes_match_the_formula_exactly(attention: str, mode: str) -> None:
    cfg = replace(CFG, attention=attention)
    terms = recompute_activation_terms(cfg.seq_len, 2, cfg.hidden, cfg.n_heads, mode,
                                       attention=attention)
    assert measure_recompute_layer(cfg, 2, mode) == sum(terms.values())


def test_fused_attention_drops_the_quadratic_term() -> None:
    s, b, h, a = 64, 1, 32, 4
    none = recompute_activation_terms(s, b, h, a, "none")
    fused = recompute_activation_terms(s, b, h, a, "none", attention="sdpa")
    # softmax output (e a s^2 b) and causal mask (s^2) gone; fp32 lse (4 b a s) added
    assert sum(none.values()) - sum(fused.values()) == 4 * a * s * s * b + s * s \
        - 4 * b * a * s


@pytest.mark.parametrize("early_stop", [False, True])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_extra_flops_match_the_formula_exactly(mode: str, early_stop: bool) -> None:
    predicted = recompute_extra_flops(CFG.seq_len, 2, CFG.hidden, CFG.n_layers, mode,
                                      early_stop)
    assert predicted > 0
    assert measure_recompute_flops(CFG, 2, mode, early_stop) == predicted
