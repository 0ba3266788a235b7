"""Chapter 12: context parallelism (load-balanced shards, ring attention) is exact.

Reference: full attention on one process, ``scaled_dot_product_attention`` (and the
explicit softmax formula, which SDPA is checked against first). Every multi-rank
result comes from one launch per world size (module-scoped fixtures).

Tolerances, derived (``fp32_tolerance.py``), relative to each tensor's largest
element:

- attention: a row's scores are sums over ``D`` head dimensions, its softmax and
  output sums over ``S`` keys (the ring folds them in ``cp`` blocks with a
  log-sum-exp rescaling, a few roundings per block); forward and backward pass about
  6 such sums, and dK/dV sum ``S`` queries of mixed sign:
  ``ATTN_REL = reorder_rel(S + D, 6, S)`` (~3e-5). Measured: ~1e-6. A wrong mask, a
  missing correction or a block sent to the wrong rank is off by O(1e-1).
- the GPT: as Chapter 5's (``reorder_rel(4h, 8, b * s)``); parameters after SGD
  with momentum, whose update is linear in the gradient: ``lr * momentum_gain``
  times the gradient bound, doubled for feedback, plus a rounding per update. A
  missing 1/cp in the gradient average doubles gradients (planted, must fail).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp32_tolerance import (U32, U64, assert_all_scaled, assert_scaled,
                            reorder_rel, sgd_param_scale)
from dtlib.chapters.ch12_long_sequences.runs import (attention_checks,
                                                     attention_inputs,
                                                     attention_reference, train_cp)
from dtlib.context_parallel import (ContextParallel, cp_shard, cp_unshard, cp_volume,
                                    ring_attention)
from dtlib.context_parallel.ring_attention import block_backward, block_forward, merge
from dtlib.context_parallel.sharding import (causal_pairs_per_rank, positions,
                                             shard_for, unshard_from)
from dtlib.models.gpt import build_gpt
from dtlib.models.reference import gpt_batches, reference_gpt_run
from dtlib.models.run import RunConfig, RunResult, run_steps, unwrap
from dtlib.models.sizes import size
from dtlib.runtime import dist as ddist
from dtlib.runtime import launch

B, A, S, D = 2, 4, 16, 8  # batch, heads, full sequence, head dim
SHAPE = (B, A, S, D)
ATTN_REL = reorder_rel(S + D, 6, S)
ATTN_REL64 = ATTN_REL * U64 / U32  # the same sums, float64's unit roundoff (~6e-14)
CFG, BATCH, STEPS, LR, MOMENTUM = size("tiny"), 2, 3, 0.05, 0.9
SGD = dict(optimizer_class=torch.optim.SGD, momentum=MOMENTUM)
GPT_REL = reorder_rel(4 * CFG.hidden, 8, BATCH * CFG.seq_len)


def _qkv_dout() -> list[torch.Tensor]:
    return attention_inputs(SHAPE)


def _explicit(q, k, v, causal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        n = q.size(-2)
        causal_mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
        s = s.masked_fill(~causal_mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def _reference(causal: bool) -> dict[str, torch.Tensor]:
    return attention_reference(causal, SHAPE)


# ---- single process: the layout and the block math --------------------------------

def test_shard_layout_and_round_trip() -> None:
    x = torch.arange(16).reshape(1, 16)
    assert shard_for(x, 1, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_for(x, 1, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    for cp in (1, 2, 4):
        shards = [shard_for(x, -1, r, cp) for r in range(cp)]
        assert torch.equal(unshard_from(shards, -1), x)
        for r in range(cp):
            assert torch.equal(positions(16 // cp, r, cp), shards[r][0])


def test_bad_sequence_length_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"x has 6 positions.*2 \* cp = 4"):
        shard_for(torch.zeros(1, 6), 1, 0, 2)
    with pytest.raises(ValueError, match="dim=3"):
        cp_shard(torch.zeros(1, 6), 3)
    q = torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError, match="local_seq=3"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match="seq_len=6"):
        cp_volume(1, 6, 8, 2, n_heads=2)


def test_load_balance_evens_the_causal_work() -> None:
    contiguous = causal_pairs_per_rank(64, 4, balanced=False)
    balanced = causal_pairs_per_rank(64, 4, balanced=True)
    assert sum(contiguous) == sum(balanced) == 64 * 65 // 2
    assert len(set(balanced)) == 1 and contiguous[-1] > 6 * contiguous[0]


def test_sdpa_equals_the_explicit_formula() -> None:
    q, k, v, _ = _qkv_dout()
    for causal in (True, False):
        assert_scaled(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                      _explicit(q, k, v, causal), ATTN_REL, f"causal={causal}")


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_block_math_simulated_ring(cp: int, causal: bool) -> None:
    """Every rank's blocks folded by merge / block_backward, on one process."""
    q, k, v, dout = _qkv_dout()
    ref = _reference(causal)
    outs, lses, grads = [], [], {"dq": [], "dk": [], "dv": []}
    sh = [[shard_for(t, 2, r, cp) for r in range(cp)] for t in (q, k, v, dout)]
    n, scale = S // cp, 1 / math.sqrt(D)
    pos = [positions(n, r, cp) if causal else None for r in range(cp)]
    for r in range(cp):
        o = torch.zeros(B, A, n, D)
        lse = torch.full((B, A, n), float("-inf"))
        for src in range(cp):
            o_b, lse_b = block_forward(sh[0][r], sh[1][src], sh[2][src], pos[r],
                                       pos[src], scale)
            o, lse = merge(o, lse, o_b, lse_b)
        outs.append(o)
        lses.append(lse)
    dk = [torch.zeros(B, A, n, D) for _ in range(cp)]
    dv = [torch.zeros(B, A, n, D) for _ in range(cp)]
    for r in range(cp):
        delta = (sh[3][r] * outs[r]).sum(-1)
        dq = torch.zeros(B, A, n, D)
        for src in range(cp):
            g = block_backward(sh[0][r], sh[1][src], sh[2][src], pos[r], pos[src],
                               scale, sh[3][r], lses[r], delta)
            dq += g[0]
            dk[src] += g[1]
            dv[src] += g[2]
        grads["dq"].append(dq)
    got = {"out": outs, "dq": grads["dq"], "dk": dk, "dv": dv}
    for name, shards in got.items():
        assert_scaled(unshard_from(shards, 2), ref[name], ATTN_REL, name)


def _float64_ring() -> dict[str, torch.Tensor]:
    """Ring attention on float64 chunks, forward and backward, unsharded on CPU."""
    device = ddist.world().device
    q, k, v, dout = (cp_shard(t.double().to(device), 2) for t in _qkv_dout())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, causal=True)
    out.backward(dout)
    return {name: cp_unshard(t, 2).cpu() for name, t in
            (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def _float64_reference() -> dict[str, torch.Tensor]:
    q, k, v, dout = (t.double() for t in _qkv_dout())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _assert_float64(got: dict[str, torch.Tensor], msg: str) -> None:
    ref = _float64_reference()
    for name in ("out", "dq", "dk", "dv"):
        assert got[name].dtype == torch.float64, f"{msg} {name}: {got[name].dtype}"
        assert_scaled(got[name], ref[name], ATTN_REL64, f"{msg} {name}")


def test_float64_ring_attention_is_float64_accurate_on_one_process() -> None:
    """Accumulating in float32 would miss the float64 bound by ~1e9 (2**29)."""
    _assert_float64(_float64_ring(), "cp=1")


def test_single_process_ring_attention_is_plain_attention() -> None:
    q, k, v, dout = _qkv_dout()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ring_attention(q, k, v).backward(dout)
    ref = _reference(True)
    assert_scaled(q.grad, ref["dq"], ATTN_REL, "dq")
    assert_scaled(v.grad, ref["dv"], ATTN_REL, "dv")


# ---- several ranks: one launch per world size ------------------------------------

class SumNotMean(ContextParallel):
    """A planted defect: gradients all-reduced but not divided by cp (no 1/N)."""

    @contextlib.contextmanager
    def grad_sync(self, wrapped: torch.nn.Module, on: bool) -> Iterator[None]:
        yield
        if on:
            for p in unwrap(wrapped).parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)


def _suite() -> dict:
    device = ddist.world().device
    no_mean = run_steps(SumNotMean(), build_gpt(CFG, 0).to(device),
                        gpt_batches(CFG, BATCH, device),
                        RunConfig(1, record_params=False))
    return {"attention": {c: attention_checks(c, SHAPE) for c in (True, False)},
            "float64": _float64_ring(),
            "gpt": train_cp(CFG, BATCH, STEPS, lr=LR, **SGD), "no_mean": no_mean}


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    return launch.spawn(_suite, request.param, stream=False, timeout=300)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_full_attention(ranks: list[dict], causal: bool) -> None:
    world_size = len(ranks)
    ref = _reference(causal)
    vol = cp_volume(B, S, A * D, world_size, n_heads=A)
    for rank, res in enumerate(ranks):
        r = res["attention"][causal]["ring"]
        for name in ("out", "dq", "dk", "dv"):
            assert_scaled(r[name], ref[name], ATTN_REL, f"{name} r{rank}")
        # every byte the ring sends is in the formula, and nothing else is sent
        assert r["fwd_bytes"] == r["fwd_recv"] == vol.ring_forward
        assert r["bwd_bytes"] == vol.ring_backward
        assert r["bad"] is not None and "x has" in r["bad"]


def test_float64_ring_attention_is_float64_accurate(ranks: list[dict]) -> None:
    for rank, res in enumerate(ranks):
        _assert_float64(res["float64"], f"cp={len(ranks)} r{rank}")


def test_a_wrong_mask_fails_the_attention_proof(ranks: list[dict]) -> None:
    """Causal ring output against non-causal truth: the tolerance must not hide it."""
    r = ranks[0]["attention"][True]["ring"]
    with pytest.raises(AssertionError, match="out"):
        assert_scaled(r["out"], _reference(False)["out"], ATTN_REL, "out")


@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_equals_full_attention_and_its_volume(ranks: list[dict],
                                                       causal: bool) -> None:
    world_size = len(ranks)
    ref = attention_reference(causal, SHAPE)
    vol = cp_volume(B, S, A * D, world_size, n_heads=A)
    for res in ranks:
        r = res["attention"][causal]["ulysses"]
        for name in ("out", "dq", "dk", "dv"):
            assert_scaled(r[name], ref[name], ATTN_REL, name)
        # torch counts each all-to-all's whole input; (cp-1)/cp of it leaves the rank
        assert r["fwd_bytes"] * (world_size - 1) // world_size == vol.ulysses_forward
        assert r["bwd_bytes"] * (world_size - 1) // world_size == vol.ulysses_backward


def test_volume_formula_ring_grows_ulysses_is_bounded() -> None:
    v2 = cp_volume(1, 4096, 1024, 2, n_heads=16, element_size=2)
    v8 = cp_volume(1, 4096, 1024, 8, n_heads=16, element_size=2)
    tokens = 4096 // 2
    assert v2.ring_forward == 2 * 1 * tokens * 1024 * 2  # one hop of K and V
    assert v2.ulysses_forward == 4 * tokens * 1024 * 2 // 2
    assert v8.ring_forward / v8.ulysses_forward == pytest.approx(8 / 2)


# ---- the whole GPT -----------------------------------------------------------------

@pytest.fixture(scope="module")
def reference() -> RunResult:
    return reference_gpt_run(CFG, BATCH, STEPS, lr=LR, **SGD)


def test_gpt_trained_with_context_parallelism_equals_one_process(
        ranks: list[dict], reference: RunResult) -> None:
    scale = sgd_param_scale(GPT_REL, reference.grads, reference.params, LR, STEPS,
                            MOMENTUM)
    for rank, res in enumerate(ranks):
        r = res["gpt"]
        assert_scaled(torch.tensor(r.losses), torch.tensor(reference.losses), GPT_REL,
                      f"losses r{rank}")
        assert_all_scaled(r.grads, reference.grads, GPT_REL, f"grad r{rank}")
        assert set(r.params) == set(reference.params)
        for name, p in reference.params.items():
            assert_scaled(r.params[name], p, 1.0, f"param {name}", scale=scale)
    start = build_gpt(CFG, 0).state_dict()  # not vacuous: training moved them
    assert max((reference.params[n] - start[n]).abs().max().item()
               for n in reference.params) > 100 * scale


def test_a_missing_one_over_cp_fails_the_gpt_proof(ranks: list[dict],
                                                   reference: RunResult) -> None:
    for res in ranks:
        with pytest.raises(AssertionError, match="no 1/cp grad"):
            assert_all_scaled(res["no_mean"].grads, reference.grads, GPT_REL,
                              "no 1/cp grad")


def test_gpt_rejects_a_position_per_token_mismatch() -> None:
    cfg = size("tiny")
    idx = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="pos has shape"):
        build_gpt(cfg)(idx, pos=torch.arange(4))
