"""Chapter 14: mixture of experts, one process and expert parallel, equal.

One process: the layer against a token-by-token loop, capacity and dropping, the
auxiliary losses, and the cost formulas against the module (parameters, FLOPs
counted by torch's ``FlopCounterMode``) and against Hugging Face's Mixtral.
Multi-rank: one launch per world size (module-scoped fixtures) runs every variant
(k = 1, 2; with and without dropping; a router that starves every rank but rank 0)
of the layer and of the MoE GPT trained with SGD and momentum, and on 4 ranks
ep 2 x dp 2 too.

Tolerances, derived (``fp32_tolerance.py``), relative to each tensor's largest
element:

- the layer: an output element sums ``f = 4h`` products in the expert's second
  matmul (``h`` in its first, ``h`` in the router), about 6 sums forward and
  backward; an expert's weight gradient sums the tokens routed to it (at most
  ``ep * TOKENS`` of mixed sign): ``LAYER_REL = reorder_rel(4 * HIDDEN, 6, ep *
  TOKENS)``. The parallel run computes the same sums on other batch shapes (rows
  from several ranks in one matmul), and sums the router's gradient over ranks.
- the GPT: as Chapter 5's (``reorder_rel(4h, 8, b * s)``); parameters after SGD
  with momentum, linear in the gradient (``sgd_param_scale``).
Routing is discrete: a rounding could flip a near-tie between two experts. The
seeds' top-k margins are far above the tolerances, and a flip would fail loudly.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fp32_tolerance import (assert_all_scaled, assert_scaled, reorder_rel,
                            sgd_param_scale)
from dtlib.chapters.ch14_experts.runs import (HIDDEN, TOKENS, VARIANTS, build_moe,
                                              ep_checks, layer_inputs,
                                              layer_reference, reference_moe_run)
from dtlib.expert_parallel import MoE, MoEConfig, capacity, moe_gpt, route
from dtlib.expert_parallel.counts import (MixtralSpec, a2a_elements, ep_a2a_bytes,
                                          ep_grad_bytes,
                                          ep_memory_bytes, expert_params,
                                          moe_layer_flops, moe_layer_params)
from dtlib.expert_parallel.gpt import MoEBlock
from dtlib.expert_parallel.moe import expert_mlp
from dtlib.models.sizes import size
from dtlib.runtime import launch

CFG, BATCH, STEPS, LR, MOMENTUM = size("tiny"), 4, 3, 0.05, 0.9
MOE = MoEConfig(n_experts=8, z_loss_coef=1e-3)
GPT_REL = reorder_rel(4 * CFG.hidden, 8, BATCH * CFG.seq_len)


def layer_rel(ep: int) -> float:
    return reorder_rel(4 * HIDDEN, 6, ep * TOKENS)


# ---- one process --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(n_experts=0), "n_experts=0"), (dict(top_k=3, n_experts=2), "top_k=3"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef=-1.0"), (dict(groups=0), "groups=0")])
def test_config_rejects_bad_values(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MoEConfig(**kwargs)


@pytest.mark.parametrize("k", [1, 2])
def test_layer_equals_a_token_by_token_loop(k: int) -> None:
    """Each token: sum over its top-k experts of gate * expert(token)."""
    moe = build_moe(MoEConfig(n_experts=4, top_k=k))
    x, _ = layer_inputs(12)
    got = moe(x)
    for t in range(12):
        probs = torch.softmax(moe.router(x[t]), -1)
        gate, chosen = probs.topk(k)
        gate = gate / gate.sum() if k > 1 else gate
        want = sum(g * moe.experts[int(e)](x[t:t + 1])[0] for g, e in zip(gate, chosen))
        assert_scaled(got[t], want.detach(), reorder_rel(4 * HIDDEN, 4), f"token {t}")


def test_capacity_keeps_first_choices_then_earlier_tokens() -> None:
    # 4 tokens, 2 experts, k = 2: every token's first choice is expert 0
    logits = torch.tensor([[2.0, 1.0]] * 4)
    cfg = MoEConfig(n_experts=2, top_k=2, capacity_factor=0.75)
    assert capacity(cfg, 4) == 3  # ceil(0.75 * 2 * 4 / 2)
    r = route(logits, cfg)
    assert r.expert.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert r.token.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert r.kept.tolist() == [True, True, True, False, True, True, True, False]
    assert r.counts(2).tolist() == [3, 3]


def test_a_fully_dropped_token_leaves_the_layer_as_zero_and_the_residual_carries_it(
        ) -> None:
    cfg = MoEConfig(n_experts=4, top_k=1, capacity_factor=0.25)  # 1 slot per expert
    moe = build_moe(cfg)
    x, _ = layer_inputs(8)
    out = moe(x)
    r = route(moe.router(x), cfg)
    dropped = r.token[~r.kept]
    assert len(dropped) == 8 - int(moe.counts.sum()) > 0
    assert out[dropped].abs().max().item() == 0.0
    block = MoEBlock(moe_gpt(CFG, cfg).blocks[0], moe)  # x + moe(ln(x)): x survives
    assert isinstance(block.moe, MoE)


def test_aux_loss_is_one_at_uniform_probabilities_and_e_when_collapsed() -> None:
    cfg = MoEConfig(n_experts=4, aux_loss_coef=1.0)
    assert route(torch.zeros(6, 4), cfg).aux_loss.item() == pytest.approx(1.0)
    collapsed = torch.tensor([[30.0, 0, 0, 0]] * 6)
    assert route(collapsed, cfg).aux_loss.item() == pytest.approx(4.0, rel=1e-6)
    z = route(torch.zeros(6, 4), replace(cfg, aux_loss_coef=0.0, z_loss_coef=1.0))
    assert z.aux_loss.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)


@pytest.mark.parametrize("k", [1, 2])
def test_parameter_counts_equal_the_module(k: int) -> None:
    moe = MoE(HIDDEN, MoEConfig(n_experts=8, top_k=k))
    counts = moe_layer_params(HIDDEN, 8, k)
    assert counts["total"] == sum(p.numel() for p in moe.parameters())
    one = sum(p.numel() for p in expert_mlp(HIDDEN).parameters())
    assert one == expert_params(HIDDEN)
    assert counts["active"] == k * one + moe.router.weight.numel()


@pytest.mark.parametrize("k, cf", [(1, None), (2, None), (2, 0.5)])
def test_flops_formula_equals_torch_flop_counter(k: int, cf) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    moe = build_moe(MoEConfig(n_experts=8, top_k=k, capacity_factor=cf))
    x, _ = layer_inputs(TOKENS * 4)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        moe(x)
    kept = int(moe.counts.sum())
    assert (kept == k * TOKENS * 4) == (cf is None)
    assert counter.get_total_flops() == moe_layer_flops(TOKENS * 4, HIDDEN, 8, kept)


def test_mixtral_formula_equals_hugging_face_and_the_published_counts() -> None:
    transformers = pytest.importorskip("transformers", reason="needs the .[hf] extra")
    tiny = MixtralSpec(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                       num_local_experts=4, num_experts_per_tok=2)
    hf = transformers.MixtralConfig(**{k: getattr(tiny, k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "num_local_experts",
        "num_experts_per_tok")})
    model = transformers.MixtralForCausalLM(hf)
    assert tiny.params()["total"] == sum(p.numel() for p in model.parameters())
    # Mixtral 8x7B from its model card's config (the defaults of MixtralSpec):
    # Jiang et al. 2024 report 47B parameters, 13B active per token
    big = MixtralSpec().params()
    assert round(big["total"] / 1e9) == 47 and round(big["active"] / 1e9) == 13
    assert MixtralSpec().hidden_size == transformers.MixtralConfig().hidden_size


def test_formulas_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="ep=3"):
        ep_grad_bytes(10, 10, 1, 8, 3)
    with pytest.raises(ValueError, match="rows=-1"):
        a2a_elements(-1, 4)
    with pytest.raises(ValueError, match="num_experts_per_tok=3"):
        MixtralSpec(num_local_experts=2, num_experts_per_tok=3)


# ---- on 2 and 4 ranks ---------------------------------------------------------------

@pytest.fixture(scope="module")
def launches() -> dict[int, list[dict]]:
    """world size -> the ranks' results, one launch each (the 4-rank launch also
    trains ep 2 x dp 2)."""
    return {}


def _launch(launches: dict, world: int) -> list[dict]:
    if world not in launches:
        ep_dp = (2, 2) if world == 4 else None
        launches[world] = launch.spawn(ep_checks, world, CFG, MOE, BATCH, STEPS, ep_dp,
                                       stream=False, timeout=300)
    return launches[world]


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ranks(request, launches) -> list[dict]:
    return _launch(launches, request.param)


@pytest.mark.parametrize("k, cf", VARIANTS)
@pytest.mark.parametrize("starved", [False, True], ids=["spread", "starved"])
def test_expert_parallel_layer_equals_one_process(ranks, k, cf, starved) -> None:
    ep = len(ranks)
    cfg = replace(MOE, top_k=k, capacity_factor=cf)
    ref = layer_reference(cfg, ep, starved)
    got = [r["layer"][k, cf, starved] for r in ranks]
    rel = layer_rel(ep)
    assert_scaled(torch.cat([g["out"] for g in got]), ref["out"], rel, "out")
    assert_scaled(torch.cat([g["dx"] for g in got]), ref["dx"], rel, "dx")
    assert_scaled(torch.tensor(sum(g["loss"] for g in got)), torch.tensor(ref["loss"]),
                  rel, "loss")
    grads = {n: t for g in got for n, t in g["grads"].items() if n != "router.weight"}
    grads["router.weight"] = sum(g["grads"]["router.weight"] for g in got)
    assert_all_scaled(grads, ref["grads"], rel, "grad")
    kept = sum(g["kept"] for g in got)
    assert kept == sum(g["received"] for g in got) == int(ref["counts"].sum())
    assert (kept < k * ep * TOKENS) == (cf is not None)  # dropping happened, or not
    if starved:  # experts 0 and 1 live on rank 0: every other rank receives nothing
        assert [g["received"] for g in got][1:] == [0] * (ep - 1)
    # bytes: the counts (E int64), the kept rows out and the received rows back,
    # forward and backward
    for g in got:
        assert g["a2a_calls"] == 5
        assert g["a2a_bytes"] == ep_a2a_bytes(g["kept"], g["received"], HIDDEN,
                                              MOE.n_experts)


def test_a_router_gradient_not_summed_over_ranks_fails(ranks) -> None:
    ref = layer_reference(MOE, len(ranks))
    with pytest.raises(AssertionError, match="router"):
        assert_scaled(ranks[0]["layer"][1, None, False]["grads"]["router.weight"],
                      ref["grads"]["router.weight"], layer_rel(len(ranks)), "router")


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


def _reference(references: dict, k: int, cf, groups: int):
    key = (k, cf, groups)
    if key not in references:
        references[key] = reference_moe_run(
            CFG, replace(MOE, top_k=k, capacity_factor=cf), BATCH, STEPS, groups)
    return references[key]


def _assert_run_equal(run, ref, what: str) -> None:
    scale = sgd_param_scale(GPT_REL, ref.grads, ref.params, LR, STEPS, MOMENTUM)
    assert_scaled(torch.tensor(run.losses), torch.tensor(ref.losses), GPT_REL,
                  f"{what} losses")
    assert_all_scaled(run.grads, ref.grads, GPT_REL, f"{what} grad")
    assert set(run.params) == set(ref.params)
    for name, p in ref.params.items():
        assert_scaled(run.params[name], p, 1.0, f"{what} param {name}", scale=scale)
    start = moe_gpt(CFG, MOE).state_dict()  # not vacuous: training moved them
    assert max((ref.params[n] - start[n]).abs().max().item()
               for n in ref.params) > 100 * scale


def _layer_bytes(run) -> int:
    """Token all-to-all bytes of step 0 from its kept assignments (every layer)."""
    return sum(ep_a2a_bytes(sum(c), got, CFG.hidden, MOE.n_experts)
               for c, got in zip(run["counts"][0], run["received"][0]))


@pytest.mark.parametrize("k, cf", VARIANTS)
def test_moe_gpt_with_expert_parallelism_equals_one_process(ranks, references, k,
                                                            cf) -> None:
    ref = _reference(references, k, cf, len(ranks))
    for rank, res in enumerate(ranks):
        run = res["gpt"][k, cf]
        _assert_run_equal(run, ref, f"ep={len(ranks)} r{rank}")
        assert run.comms.total_bytes("all_to_all") == _layer_bytes(run)


def _dense_and_expert() -> tuple[int, int]:
    model = moe_gpt(CFG, MOE)
    total = sum(p.numel() for p in model.parameters())
    return total - CFG.n_layers * MOE.n_experts * expert_params(CFG.hidden), \
        expert_params(CFG.hidden)


def test_ep2_dp2_equals_one_process_with_bytes_per_group(launches, references
                                                        ) -> None:
    ranks = _launch(launches, 4)
    ref = _reference(references, MOE.top_k, MOE.capacity_factor, 4)
    dense, expert = _dense_and_expert()
    want = ep_grad_bytes(dense, expert, CFG.n_layers, MOE.n_experts, 2)
    memory = ep_memory_bytes(dense, expert, CFG.n_layers, MOE.n_experts, 2, 4)
    for rank, res in enumerate(ranks):
        run = res["ep_dp"]
        _assert_run_equal(run, ref, f"ep2xdp2 r{rank}")
        edp = (rank % 2, rank % 2 + 2)  # the ranks holding the same experts
        by_group: dict[tuple[int, ...], int] = {}
        for rec in run.comms.records:
            if rec.op == "all_reduce":
                by_group[rec.ranks] = by_group.get(rec.ranks, 0) + rec.bytes
        assert by_group == {(0, 1, 2, 3): want["world"], edp: want["edp"]}
        assert run.comms.total_bytes("all_to_all") == _layer_bytes(run)
        assert run["local_numel"] * 4 == memory["total"]


def test_one_expert_parallel_rank_without_a_process_group_is_the_layer() -> None:
    """ep = 1 (no torch.distributed): no collective runs, the layer is unchanged."""
    from dtlib.expert_parallel import ExpertParallelMoE

    moe = build_moe(MOE)
    x, _ = layer_inputs(TOKENS)
    assert torch.equal(ExpertParallelMoE(moe)(x), moe(x))


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_planner_ep_plan_agrees_with_the_checked_formulas(ep: int) -> None:
    from dtlib.planner.moe import ep_plan
    from dtlib.planner.specs import ClusterSpec

    spec, tokens = MixtralSpec(), 8192
    p = spec.params()
    assert p["total"] == p["dense"] + spec.num_hidden_layers * 8 * p["expert"]
    plan = ep_plan(spec, ClusterSpec.preset("H100-80GB", 8), ep, tokens)
    layers, rows = spec.num_hidden_layers, spec.num_experts_per_tok * tokens
    assert plan.state_bytes == ep_memory_bytes(p["dense"], p["expert"], layers, 8,
                                               ep)["total"]
    # what leaves the GPU: (ep - 1)/ep of the logged messages (counts aside)
    logged = ep_a2a_bytes(rows, rows, spec.hidden_size, 8, element_size=2) - 8 * 8
    assert plan.a2a_bytes == layers * logged * (ep - 1) / ep
    assert plan.fits is False  # 16 bytes per parameter: beyond 80 GiB at any ep <= 8
    with pytest.raises(ValueError, match="ep=3"):
        ep_plan(spec, ClusterSpec.preset("H100-80GB", 8), 3, tokens)
