"""Chapter 12: context parallelism (load-balanced shards, ring attention) is exact.

Reference: full attention on one process, ``scaled_dot_product_attention`` (and the
explicit softmax formula, which SDPA is checked against first).
Tolerance: rtol=1e-5, atol=1e-6 in float32. The ring sums the softmax over ``cp``
blocks with the log-sum-exp rescaling where one process sums a row at once; float32
addition is not associative, so results agree to rounding (~1e-7 relative). A wrong
mask, a missing correction or a block sent to the wrong rank changes outputs and
gradients by O(1e-1). Parameters after AdamW steps: rtol=1e-4, atol=1e-5, for the
reason given in test_tensor_parallel.py (a key bias whose true gradient is exactly
zero; Adam normalises its rounding noise into steps of ~1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dtlib.chapters.ch12_long_sequences.runs import (attention_inputs,
                                                     attention_reference, ring_check,
                                                     train_cp, ulysses_check)
from dtlib.context_parallel import cp_shard, cp_volume, ring_attention
from dtlib.context_parallel.ring_attention import block_backward, block_forward, merge
from dtlib.context_parallel.sharding import (causal_pairs_per_rank, positions,
                                             shard_for, unshard_from)
from dtlib.models.reference import reference_gpt_run
from dtlib.models.sizes import size
from dtlib.runtime import launch

TOL = dict(rtol=1e-5, atol=1e-6)
B, A, S, D = 2, 3, 16, 8  # batch, heads, full sequence, head dim


def _qkv_dout() -> list[torch.Tensor]:
    return attention_inputs((B, A, S, D))


def _explicit(q, k, v, causal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        n = q.size(-2)
        causal_mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
        s = s.masked_fill(~causal_mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def _reference(causal: bool) -> dict[str, torch.Tensor]:
    return attention_reference(causal, (B, A, S, D))


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
        torch.testing.assert_close(F.scaled_dot_product_attention(
            q, k, v, is_causal=causal), _explicit(q, k, v, causal), **TOL)


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
        torch.testing.assert_close(unshard_from(shards, 2), ref[name], **TOL)


def test_single_process_ring_attention_is_plain_attention() -> None:
    q, k, v, dout = _qkv_dout()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ring_attention(q, k, v).backward(dout)
    ref = _reference(True)
    torch.testing.assert_close(q.grad, ref["dq"], **TOL)
    torch.testing.assert_close(v.grad, ref["dv"], **TOL)


# ---- several ranks -----------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_full_attention(world_size: int, causal: bool) -> None:
    res = launch.spawn(ring_check, world_size, causal, stream=False, timeout=120)
    ref = _reference(causal)
    vol = cp_volume(B, S, A * D, world_size, n_heads=A)
    for rank, r in enumerate(res):
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(r[name], ref[name], **TOL, msg=f"{name} r{rank}")
        # every byte the ring sends is in the formula, and nothing else is sent
        assert r["fwd_bytes"] == r["fwd_recv"] == vol.ring_forward
        assert r["bwd_bytes"] == vol.ring_backward
        assert r["bad"] is not None and "x has" in r["bad"]


@pytest.mark.parametrize("world_size,causal", [(2, True), (4, True), (4, False)])
def test_ulysses_equals_full_attention_and_its_volume(world_size: int,
                                                       causal: bool) -> None:
    shape = (2, 4, 16, 8)  # 4 heads: divisible by cp = 2 and 4
    res = launch.spawn(ulysses_check, world_size, causal, shape, stream=False,
                       timeout=120)
    ref = attention_reference(causal, shape)
    vol = cp_volume(shape[0], shape[2], shape[1] * shape[3], world_size,
                    n_heads=shape[1])
    for r in res:
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(r[name], ref[name], **TOL, msg=name)
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

PARAM_TOL = dict(rtol=1e-4, atol=1e-5)  # as Chapter 5: Adam amplifies rounding noise


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt_trained_with_context_parallelism_equals_one_process(world_size: int
                                                                 ) -> None:
    cfg, batch, steps = size("tiny"), 2, 3
    ref = reference_gpt_run(cfg, batch, steps)
    res = launch.spawn(train_cp, world_size, cfg, batch, steps, stream=False,
                       timeout=120)
    for r in res:
        torch.testing.assert_close(torch.tensor(r["losses"]),
                                   torch.tensor(ref["losses"]), **TOL)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, **TOL, msg=name)
        for name, p in ref["params"].items():
            torch.testing.assert_close(r["params"][name], p, **PARAM_TOL, msg=name)


def test_gpt_rejects_a_position_per_token_mismatch() -> None:
    from dtlib.models.gpt import build_gpt

    cfg = size("tiny")
    idx = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="pos has shape"):
        build_gpt(cfg)(idx, pos=torch.arange(4))
