"""The planner (dtlib.planner) against published runs.

- Narayanan et al. 2021, Table 1: every (t, p, d) fits by the memory model, and the
  FLOPs per iteration are Eq. 3, asserted as exact integers.
- Narayanan et al. 2021, Table 2: PTD-P beats ZeRO-3 at every GPU count, and
  ZeRO-3's TFLOP/s per GPU falls as GPUs grow at a fixed batch.
- Dubey et al. 2024, Table 4: Llama 3 405B's configurations fit on H100-80GB.
"""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction

import pytest

from dtlib.planner import ClusterSpec, ModelSpec, ParallelConfig, estimate, search
from dtlib.planner import published as pub
from dtlib.planner.counts import flops_per_iteration, megatron_eq3, param_count
from dtlib.planner.footprint import layer_activation_bytes
from dtlib.planner.search import candidates as search_candidates

# Eq. 3 of Narayanan et al. 2021 for each Table 1 row, computed once by hand-checked
# integer arithmetic (96Bslh^2 + 16Bs^2lh + 6BshV) and typed here, so that a change
# to the formula in the code fails.
EQ3_TABLE1 = {
    1.7: 15466830067924992,
    3.6: 32655495344947200,
    7.5: 67184558503624704,
    18.4: 324839715310141440,
    39.1: 1021226399878348800,
    76.1: 2302047495074611200,
    145.6: 5641682123048878080,
    310.1: 11194006936108400640,
    529.6: 22215941676859392000,
    1008.0: 51390513775273574400,
}


def gpt(row) -> ModelSpec:
    return ModelSpec(row.n_layers, row.hidden, row.n_heads, pub.GPT_VOCAB,
                     pub.GPT_SEQ_LEN)


def megatron_2021(dp: int, tp: int, pp: int, **kw) -> ParallelConfig:
    """How Narayanan et al. ran: full recomputation, no sequence parallelism."""
    return ParallelConfig(dp=dp, tp=tp, pp=pp, recompute="full",
                          sequence_parallel=False, **kw)


def table2_estimate(row):
    model = ModelSpec(vocab_size=pub.GPT_VOCAB, seq_len=pub.GPT_SEQ_LEN,
                      **pub.TABLE2_SHAPES[row.params_b])
    if row.scheme == "PTD-P":
        tp, pp, zero = 8, row.model_parallel // 8, 0
    else:
        tp, pp, zero = 1, 1, 3
    config = megatron_2021(row.n_gpus // (tp * pp), tp, pp, zero_stage=zero,
                           micro_batch=row.micro_batch)
    return estimate(model, ClusterSpec.preset("A100-80GB", row.n_gpus), config,
                    row.batch)


def test_public_api_and_no_torch():
    code = ("import sys\nfrom dtlib.planner import ModelSpec, ClusterSpec, "
            "ParallelConfig, estimate, search\nassert 'torch' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('torch'))[:3]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_typed_tables_are_self_consistent():
    # A typo in a typed row shows up as a mismatch between its own columns.
    for row in pub.TABLE1:
        assert row.n_gpus % (row.tp * row.pp) == 0
        aggregate = row.n_gpus * row.tflops_per_gpu / 1000
        assert aggregate == pytest.approx(row.aggregate_pflops, rel=0.01), row
        assert round(100 * row.tflops_per_gpu / 312) == row.percent_of_peak, row
    for row in pub.TABLE4_LLAMA3:
        assert row.tp * row.cp * row.pp * row.dp == row.n_gpus
        assert row.global_batch * row.seq_len == row.tokens_per_batch


def test_table1_parameter_counts_match_eq2():
    for row in pub.TABLE1:
        assert round(param_count(gpt(row)) / 1e9, 1) == row.params_b


def test_table1_flops_equal_eq3_exactly():
    for row in pub.TABLE1:
        b, s, l, h, v = row.batch, pub.GPT_SEQ_LEN, row.n_layers, row.hidden, 51200
        # The paper's form, in exact rationals.
        paper = 96 * b * s * l * h * h * (1 + Fraction(s, 6 * h)
                                          + Fraction(v, 16 * l * h))
        assert paper == megatron_eq3(b, s, l, h, v) == EQ3_TABLE1[row.params_b]
        assert flops_per_iteration(gpt(row), b, "full") == EQ3_TABLE1[row.params_b]
        est = estimate(gpt(row), ClusterSpec.preset("A100-80GB", row.n_gpus),
                       megatron_2021(row.dp, row.tp, row.pp), b)
        assert est.flops_per_iteration == EQ3_TABLE1[row.params_b]


def test_an_altered_eq3_is_rejected():
    # 72 instead of 96: the FLOPs without recomputation, a common slip.
    def altered(b, s, l, h, v):
        return 72 * b * s * l * h * h + 12 * b * s * s * l * h + 6 * b * s * h * v

    wrong = [row.params_b for row in pub.TABLE1
             if altered(row.batch, 2048, row.n_layers, row.hidden, 51200)
             != EQ3_TABLE1[row.params_b]]
    assert wrong == [row.params_b for row in pub.TABLE1]
    row = pub.TABLE1[0]
    assert flops_per_iteration(gpt(row), row.batch, "none") == altered(
        row.batch, 2048, row.n_layers, row.hidden, 51200) == 11785665138130944


def test_recomputation_orders_flops():
    model = gpt(pub.TABLE1[4])
    none, sel, full = (flops_per_iteration(model, 64, r)
                       for r in ("none", "selective", "full"))
    s, l, h = model.seq_len, model.n_layers, model.hidden
    assert sel - none == 4 * 64 * s * s * h * l  # the attention core, once more
    assert none < sel < full


def test_table1_every_published_configuration_fits():
    for row in pub.TABLE1:
        est = estimate(gpt(row), ClusterSpec.preset("A100-80GB", row.n_gpus),
                       megatron_2021(row.dp, row.tp, row.pp), row.batch)
        assert est.fits, (row, est.memory_per_gpu_bytes / 1e9)
        # Without recomputation the 145.6B model does not fit: the reason
        # Megatron recomputes.
    row = pub.TABLE1[6]
    est = estimate(gpt(row), ClusterSpec.preset("A100-80GB", row.n_gpus),
                   ParallelConfig(row.dp, row.tp, row.pp, sequence_parallel=False),
                   row.batch)
    assert not est.fits and est.breakdown.dominant == "memory"


def test_table1_throughput_within_25_percent():
    # The planner's one calibration is compute_efficiency = 0.6 of peak.
    for row in pub.TABLE1:
        est = estimate(gpt(row), ClusterSpec.preset("A100-80GB", row.n_gpus),
                       megatron_2021(row.dp, row.tp, row.pp), row.batch)
        assert est.tflops_per_gpu == pytest.approx(row.tflops_per_gpu, rel=0.25)


def test_table2_ptdp_wins_at_every_gpu_count():
    rows = {(r.scheme, r.params_b, r.n_gpus): r for r in pub.TABLE2}
    pairs = [(174.6, 384, 384), (174.6, 768, 768), (174.6, 1536, 1536),
             (529.6, 560, 640), (529.6, 1120, 1120), (529.6, 2240, 2240)]
    for size, n_ptdp, n_zero in pairs:
        ptdp, zero = rows[("PTD-P", size, n_ptdp)], rows[("ZeRO-3", size, n_zero)]
        assert ptdp.tflops_per_gpu > zero.tflops_per_gpu  # published
        planned_ptdp, planned_zero = table2_estimate(ptdp), table2_estimate(zero)
        assert planned_ptdp.fits and planned_zero.fits
        assert planned_ptdp.tflops_per_gpu > planned_zero.tflops_per_gpu, size


def test_table2_zero3_falls_with_gpus_at_fixed_batch():
    for size in (174.6, 529.6):
        rows = [r for r in pub.TABLE2 if r.scheme == "ZeRO-3" and r.params_b == size]
        published = [r.tflops_per_gpu for r in rows]
        planned = [table2_estimate(r).tflops_per_gpu for r in rows]
        assert published == sorted(published, reverse=True)
        assert planned == sorted(planned, reverse=True)
        # Falls to about a third: ZeRO-3's gathers per GPU do not shrink with
        # more GPUs while each GPU's compute does.
        assert planned[-1] / planned[0] == pytest.approx(
            published[-1] / published[0], abs=0.25)
        assert table2_estimate(rows[-1]).breakdown.dominant == "dp"
        for row in rows:
            assert table2_estimate(row).tflops_per_gpu == pytest.approx(
                row.tflops_per_gpu, rel=0.25)


def llama(row) -> tuple[ModelSpec, ClusterSpec, ParallelConfig]:
    model = ModelSpec(seq_len=row.seq_len, **pub.LLAMA3_405B)
    # Dubey et al. 2024 §3.3.2: FSDP shards optimizer state and gradients and does
    # not reshard the parameters after forward, so a GPU holds what ZeRO-2 holds;
    # no activation checkpointing at 8K; FlashAttention does not store the scores,
    # which is what "selective" models.
    config = ParallelConfig(dp=row.dp, tp=row.tp, pp=row.pp, cp=row.cp,
                            zero_stage=2, recompute="selective")
    return model, ClusterSpec.preset("H100-80GB", row.n_gpus), config


def test_llama3_405b_published_configurations_fit():
    for row in pub.TABLE4_LLAMA3:
        model, cluster, config = llama(row)
        est = estimate(model, cluster, config, row.global_batch)
        assert est.fits, (row, est.memory_per_gpu_bytes / 1e9)
        assert est.memory_per_gpu_bytes > 60e9  # and they use most of the GPU
    assert round(param_count(ModelSpec(seq_len=8192, **pub.LLAMA3_405B)) / 1e9) == 406


def test_llama3_planner_agrees_at_8k_and_prefers_more_cp_at_128k():
    for row in pub.TABLE4_LLAMA3:
        model, cluster, config = llama(row)
        ranked = search(model, cluster, row.global_batch)
        assert config in [c for c, _ in ranked]
        best = ranked[0][0]
        if row.cp == 1:
            assert (best.tp, best.pp, best.dp, best.cp) == (8, 16, row.dp, 1)
        else:  # the planner has no interleaved schedule: it fights the bubble
            assert best.cp > row.cp and best.pp < row.pp


def test_search_is_ranked_and_empty_when_nothing_fits():
    model = gpt(pub.TABLE1[2])
    ranked = search(model, ClusterSpec.preset("A100-80GB", 16), 64)
    times = [e.step_time_s for _, e in ranked]
    assert ranked and times == sorted(times) and all(e.fits for _, e in ranked)
    assert search(gpt(pub.TABLE1[-1]), ClusterSpec.preset("A100-80GB", 8), 8) == []


def test_breakdown_names_what_dominates():
    est = table2_estimate(pub.TABLE2[2])  # ZeRO-3 on 1536 GPUs
    assert est.breakdown.dominant == "dp"
    assert "data-parallel gradient traffic" in est.breakdown.explain()
    assert est.step_time_s == pytest.approx(sum(est.breakdown.time_s.values()))
    assert est.bubble_fraction == 0


def test_gpt_activations_are_chapter1s():
    from dtlib.memory.formulas import activation_bytes

    model = gpt(pub.TABLE1[3])
    for r in ("none", "selective", "full"):
        assert layer_activation_bytes(model, 2, tp=8, recompute=r) == \
            activation_bytes(2048, 2, model.hidden, model.n_heads, 1, tp=8,
                             sequence_parallel=True, recompute=r)


@pytest.mark.parametrize("make, field", [
    (lambda: ModelSpec(2, 100, 3, 10, 8), "n_heads"),
    (lambda: ModelSpec(2, 96, 8, 10, 8, n_kv_heads=3), "n_kv_heads"),
    (lambda: ClusterSpec.preset("A100-80GB", 12), "n_gpus"),
    (lambda: ClusterSpec.preset("V100", 8), "name"),
    (lambda: ParallelConfig(1, 1, 1, recompute="some"), "recompute"),
    (lambda: ParallelConfig(1, 1, 1, zero_stage=4), "zero_stage"),
    (lambda: ParallelConfig(0, 1, 1), "dp"),
    (lambda: estimate(ModelSpec(2, 96, 8, 10, 8), ClusterSpec.preset("A100-80GB", 8),
                      ParallelConfig(2, 2, 1), 4), "n_gpus"),
    (lambda: estimate(ModelSpec(2, 96, 8, 10, 8), ClusterSpec.preset("A100-80GB", 8),
                      ParallelConfig(4, 2, 1), 6), "global_batch"),
    (lambda: estimate(ModelSpec(2, 96, 6, 10, 8), ClusterSpec.preset("A100-80GB", 8),
                      ParallelConfig(1, 8, 1), 6), "tp"),
])
def test_bad_input_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


# ---- the pipeline's schedule -----------------------------------------------------

@pytest.mark.parametrize("p", range(1, 9))
def test_the_schedules_bubble_is_chapter_6s_ideal_clock(p):
    # F, B and W a third of a micro-batch each (1F1B's backward is B + W): the idle
    # over the ideal compute of 3m thirds; sums of whole slots and halves, exact
    from dtlib.pipeline_parallel.schedules import simulate
    from dtlib.pipeline_parallel.zero_bubble_v import play_v, step_time, zbv_orders
    from dtlib.planner.estimate import pipeline_bubble

    for m in range(1, 3 * p + 2):
        clock = {"1f1b": max(e.end for e in simulate("1f1b", p, m, 1.0, 2.0)),
                 "zb-h1": max(e.end for e in simulate("zb-h1", p, m, 1.0, 1.0, 1.0)),
                 "zb-v": step_time(play_v(zbv_orders(p, m)))}
        for schedule, step in clock.items():
            assert pipeline_bubble(schedule, p, m) == pytest.approx(
                (step - 3 * m) / (3 * m), rel=1e-12, abs=0), (schedule, p, m)


def test_the_zero_bubble_schedules_trade_idle_for_memory_and_messages():
    model = ModelSpec(n_layers=32, hidden=4096, n_heads=32, vocab_size=50257,
                      seq_len=2048)
    cluster = ClusterSpec.preset("A100-80GB", 64)
    est = {s: estimate(model, cluster, ParallelConfig(dp=2, tp=8, pp=4, schedule=s,
                                                      recompute="selective"), 16)
           for s in ("1f1b", "zb-h1", "zb-v")}
    bubble = {s: e.breakdown.time_s["bubble"] for s, e in est.items()}
    assert bubble["1f1b"] > bubble["zb-h1"] > bubble["zb-v"] > 0
    m = est["1f1b"].n_micro
    assert bubble["zb-h1"] == pytest.approx(bubble["1f1b"] / 3)  # m = 8 >= p
    assert est["zb-v"].bubble_fraction == pytest.approx((4 - 1) / 2 / (3 * m))
    pp = {s: e.breakdown.time_s["pp"] for s, e in est.items()}
    assert pp["zb-h1"] == pp["1f1b"] and pp["zb-v"] == pytest.approx(2 * pp["1f1b"])
    # the held W's output gradients: 16-bit, (4h + 2kv + f) a token, per layer and
    # waiting micro-batch (min(pp, m) of them) on tp ranks
    per_w = 2 * 2048 * (4 * 4096 + 2 * 4096 + 4 * 4096) / 8
    extra = 4 * 8 * per_w  # min(pp, m) = 4 waiting, 8 layers a stage
    for s in ("zb-h1", "zb-v"):
        got = est[s].breakdown.memory_bytes["activations"]
        assert got - est["1f1b"].breakdown.memory_bytes["activations"] == \
            pytest.approx(extra)
    assert "zb-v" in est["zb-v"].config.label()
    with pytest.raises(ValueError, match="schedule='zb-v2' is not one of"):
        ParallelConfig(dp=1, tp=1, pp=2, schedule="zb-v2")
    with pytest.raises(ValueError, match="ZB-V: two stages a rank"):
        estimate(ModelSpec(n_layers=4, hidden=64, n_heads=4, vocab_size=64,
                           seq_len=16), ClusterSpec.preset("A100-80GB", 4),
                 ParallelConfig(dp=1, tp=1, pp=4, schedule="zb-v"), 4)


def test_search_tries_a_schedule_only_where_it_fits():
    model = ModelSpec(n_layers=4, hidden=512, n_heads=8, vocab_size=1024,
                      seq_len=512)
    cluster = ClusterSpec.preset("A100-80GB", 8)
    configs = list(search_candidates(model, cluster, 16))
    assert {c.schedule for c in configs} == {"1f1b"}
    with_zb = list(search_candidates(model, cluster, 16,
                                     schedules=("1f1b", "zb-h1", "zb-v")))
    assert all(c.schedule == "1f1b" for c in with_zb if c.pp == 1)
    assert all(c.pp <= 2 for c in with_zb if c.schedule == "zb-v")
    assert {c.schedule for c in with_zb if c.pp == 2} == {"1f1b", "zb-h1", "zb-v"}
    assert {c.schedule for c in with_zb if c.pp == 4} == {"1f1b", "zb-h1"}
