"""Chapter 6, "Splitting the backward": B and W apart, and the ZB-H1 schedule.

On one process the split backward (B now, W later) gives bitwise the gradients of
``loss.backward()``; its deferred W holds the output gradients the chapter counts.
ZB-H1's action lists are valid and hold p micro-batches; on the ideal clock its step
is the paper's formula where the paper's assumptions hold (m >= p, t_W <= t_F, t_B)
and longer where they do not. The rank runs (2 and 4 gloo ranks against one process,
and bitwise against 1F1B) are in ``tests/test_pipeline_parallel.py``; the messages'
order in ``tests/test_p2p_order.py``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn as nn

from dtlib.chapters.ch06_pipeline_parallel.runs import PP_GPT
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.pipeline_parallel import lm_loss
from dtlib.pipeline_parallel.schedules import (bubble_fraction, idle_fractions,
                                               in_flight_peak, pipeline_step,
                                               schedule_order, simulate, zb_h1_bubble)
from dtlib.pipeline_parallel.split import split_gpt
from dtlib.pipeline_parallel.zero_bubble import (backward_input, backward_weight,
                                                 gpt_w_bytes, weight_sites)

CFG = GPTConfig(**PP_GPT)


def _two_stage_runs(m: int):
    """The same model trained one micro-batch at a time, fused and split."""
    fused, split = build_gpt(CFG, seed=0), build_gpt(CFG, seed=0)
    fa, sa = split_gpt(fused, 2), split_gpt(split, 2)
    idx, tgt = token_batch(CFG, 2 * m, seed=1)
    held = []
    for i in range(m):
        x, y = idx[2 * i:2 * i + 2], tgt[2 * i:2 * i + 2]
        h = fa[0](x)
        h1 = h.detach().requires_grad_(True)
        (lm_loss(fa[1](h1), y) / m).backward()
        h.backward(h1.grad)
        with weight_sites(sa[0]) as s0:
            hb = sa[0](x)
        hb1 = hb.detach().requires_grad_(True)
        with weight_sites(sa[1]) as s1:
            out = sa[1](hb1)
        gx, d1 = backward_input(lm_loss(out, y) / m, None, hb1, s1)
        assert torch.equal(gx, h1.grad)  # B's input gradient: the fused one, bitwise
        _, d0 = backward_input(hb, gx, None, s0)
        held.append((d0, d1))
    return fused, split, held


def test_split_backward_is_bitwise_the_fused_one():
    m = 3
    fused, split, held = _two_stage_runs(m)
    # after B only, no weight has a gradient yet: W really is deferred
    assert all(p.grad is None for p in split.parameters())
    per_mb = [gpt_w_bytes(CFG.hidden, CFG.seq_len, 2, CFG.n_layers // 2, first=True),
              gpt_w_bytes(CFG.hidden, CFG.seq_len, 2, CFG.n_layers // 2, last=True,
                          vocab=CFG.vocab_size)]
    for d0, d1 in held:
        assert [d0.nbytes, d1.nbytes] == per_mb
    for d0, d1 in held:  # W, in micro-batch order as the fused backwards ran
        backward_weight(d1)
        backward_weight(d0)
    ref = dict(fused.named_parameters())
    for name, p in split.named_parameters():
        assert torch.equal(p.grad, ref[name].grad), name


def test_a_missing_w_is_seen():
    """The comparison can fail: skip one micro-batch's W and the gradients differ."""
    fused, split, held = _two_stage_runs(2)
    for d0, d1 in held[1:]:
        backward_weight(d1)
        backward_weight(d0)
    ref = dict(fused.named_parameters())
    assert any(not torch.equal(p.grad, ref[n].grad) for n, p in split.named_parameters())


def test_weight_sites_refuse_a_reused_parameter():
    lin = nn.Linear(3, 3)
    twice = nn.Sequential(lin, nn.ReLU(), lin)
    with pytest.raises(ValueError, match="tied or reused"):
        with weight_sites(twice):
            twice(torch.randn(2, 3))

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w, x

    pair = Pair()
    with pytest.raises(TypeError, match="returned tuple"):
        with weight_sites(pair):
            pair(torch.ones(3))


def test_single_stage_zb_h1_equals_plain_backward():
    a, b = build_gpt(CFG), build_gpt(CFG)
    idx, tgt = token_batch(CFG, 6)
    res = pipeline_step(split_gpt(a, 1)[0], idx, tgt, n_microbatches=3,
                        act_shape=(2, CFG.seq_len, CFG.hidden), loss_fn=lm_loss,
                        schedule="zb-h1")
    loss = lm_loss(b(idx), tgt)
    loss.backward()
    assert res.loss == pytest.approx(loss.item(), rel=1e-5)
    ref = dict(b.named_parameters())
    scale = max(p.grad.abs().max().item() for p in b.parameters())
    for n, p in a.named_parameters():
        # three micro-batch means against one batch mean: a reordered sum
        torch.testing.assert_close(p.grad, ref[n].grad, rtol=0, atol=1e-5 * scale)


def test_zb_h1_orders():
    for p, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 5, 8, 16)):
        for s in range(p):
            order = schedule_order("zb-h1", s, p, m)
            assert sorted(order) == sorted((k, i) for k in "FBW" for i in range(m))
            pos = {a: j for j, a in enumerate(order)}
            assert all(pos["F", i] < pos["B", i] < pos["W", i] for i in range(m))
            # each kind in micro-batch order (W's accumulate as 1F1B's backwards)
            for k in "FBW":
                assert [i for kk, i in order if kk == k] == list(range(m))
            # F, B as 1F1B's; the W's go between them
            assert [a for a in order if a[0] != "W"] == schedule_order("1f1b", s, p, m)
            assert in_flight_peak(order) == min(p, m)


def test_zb_h1_bubble_on_the_ideal_clock():
    rng = random.Random(0)
    quarters = [0.25 * k for k in range(1, 13)]
    checked = longer = 0
    for _ in range(400):
        tf, tb, tw = rng.choice(quarters), rng.choice(quarters), rng.choice(quarters)
        p, m = rng.choice((2, 3, 4, 5, 8)), rng.choice((1, 2, 3, 5, 8, 12, 16))
        events = simulate("zb-h1", p, m, tf, tb, tw)
        step = max(e.end for e in events)
        busy = m * (tf + tb + tw)
        formula = busy + (p - 1) * (tf + tb - tw)  # the paper's step
        if m >= p and tw <= min(tf, tb):
            assert step == pytest.approx(formula), (tf, tb, tw, p, m)
            for idle in idle_fractions(events, p):
                assert idle == pytest.approx(zb_h1_bubble(p, m, tf, tb, tw))
            checked += 1
        else:
            assert step >= formula - 1e-9
            longer += step > formula + 1e-9
        # never slower than 1F1B with the same backward (B + W fused)
        fused = max(e.end for e in simulate("1f1b", p, m, tf, tb, tw))
        assert step <= fused + 1e-9
    assert checked > 50 and longer > 50
    # equal times: a third of 1F1B's bubble time
    p, m = 4, 8
    assert zb_h1_bubble(p, m) / (1 - zb_h1_bubble(p, m)) * 3 == pytest.approx(
        bubble_fraction(p, m) / (1 - bubble_fraction(p, m)))


def test_zb_h1_bubble_rejects_bad_times():
    with pytest.raises(ValueError, match="t_w"):
        zb_h1_bubble(4, 8, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="n_microbatches"):
        zb_h1_bubble(4, 0)
    with pytest.raises(ValueError, match="t_w=3.0 is longer than t_fwd"):
        zb_h1_bubble(4, 8, 1.0, 1.0, 3.0)


def test_w_waiting_peak_counts_the_held_ws_and_one_process_split_is_bitwise():
    from dtlib.chapters.ch06_pipeline_parallel.runs import split_backward_one_process
    from dtlib.pipeline_parallel.schedules import w_waiting_peak

    assert w_waiting_peak([("F", 0), ("B", 0), ("W", 0)]) == 1
    assert w_waiting_peak([("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 0),
                           ("W", 1)]) == 2
    # ZB-H1: stage s holds back s + 1 W's at its most (each W after the B of k + s)
    for p, m in ((2, 4), (4, 8), (4, 4)):
        assert [w_waiting_peak(schedule_order("zb-h1", s, p, m)) for s in range(p)] \
            == [s + 1 for s in range(p)]
    one = split_backward_one_process(batch=2)
    assert one["after_b"] == 0 and one["bitwise"] == one["n_params"] > 0
    assert one["w_bytes"] == one["w_bytes_counted"]


def test_the_step_time_models_closed_form_is_the_simulated_zb_h1_step():
    from dtlib.planner.step_time import zb_h1_step

    rng = random.Random(5)
    for _ in range(200):
        p, m = rng.randint(2, 8), rng.randint(1, 12)
        tf, tb = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)
        tw = rng.uniform(0.05, min(tf, tb))
        step = max(e.end for e in simulate("zb-h1", p, m, tf, tb, tw))
        assert zb_h1_step(p, m, tf, tb, tw) == pytest.approx(step, rel=1e-12)
    with pytest.raises(ValueError, match="t_w="):
        zb_h1_step(4, 8, 1.0, 1.0, 1.5)
