"""Chapter 6: pipeline parallelism against the single process.

Teaching GPipe and 1F1B, and torch.distributed.pipelining (manual PipelineStage with
ScheduleGPipe and Schedule1F1B, and the pipeline() tracer with ScheduleGPipe), each
train the untied GPT for a few steps of SGD with momentum on 2 and 4 ranks through
the one loop (``run_steps``); every rank compares its stage with one process
training the whole model on the whole batch (computed once, here). One launch per
world size runs everything, planted defects included.
"""

from __future__ import annotations

import io
import itertools
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.chapters.ch06_pipeline_parallel.runs import (LR, OPTIMIZER, PP_GPT,
                                                       SPLIT_VARIANTS, VARIANTS,
                                                       compare_all, lm_loss, reference,
                                                       train_pipeline)
from dtlib.chapters.ch06_pipeline_parallel.seed import (UnmaskedSelfAttention,
                                                       future_influence,
                                                       token_future_influence)
from dtlib.exercises import WrongAnswer, pipeline_parallel as ex
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.pipeline_parallel import parallelism
from dtlib.pipeline_parallel.schedules import (bubble_fraction, idle_fractions,
                                               in_flight_peak, pipeline_step,
                                               schedule_order, simulate)
from dtlib.pipeline_parallel.parallelism import PipelineParallel
from dtlib.pipeline_parallel.zero_bubble import gpt_w_bytes
from dtlib.pipeline_parallel.split import (balance, balanced_layers, gpt_layer_costs,
                                           layers_from_split_points, split_gpt,
                                           stage_costs)
from dtlib.runtime import launch

CFG = GPTConfig(**PP_GPT)
STEPS = 4
#: micro-batches per world size: never equal to the number of stages.
MICRO = {2: 3, 4: 6}
# What one process and a pipeline can differ by (fp32, unit roundoff u = 2^-24): the
# same arithmetic in another order. A length-n sum or dot product in any order is
# within n*u (relative to the sum of the terms' magnitudes) of the exact value
# (Higham's gamma_n). The forward passes each value through at most n_layers + 1
# dot products of length <= 4 * hidden (the micro-batch's rows may be blocked
# differently from the full batch's); the loss then averages batch * seq_len terms,
# split into micro-batch means. The backward repeats the depth once more and a
# weight gradient sums the batch's rows in micro-batch order.
U = 2.0 ** -24
DEPTH = (CFG.n_layers + 1) * 4 * CFG.hidden


def loss_rel(batch: int) -> float:
    return U * (DEPTH + batch * CFG.seq_len)


def grad_rel(batch: int) -> float:
    return U * (2 * DEPTH + batch * CFG.seq_len)


def param_atol(batch: int, steps: int, grad_scale: float) -> float:
    """SGD with momentum 0.9: after K steps a parameter has moved by lr times a sum
    of at most K(K+1)/2 gradients (sum over steps k of sum_{j<=k} 0.9^(k-j) <= k+1),
    so it differs by at most lr * K(K+1)/2 * the gradient bound; twice that for the
    parameter differences feeding back into later gradients (a few steps of a small
    lr: the curvature term lr * |H| stays well below 1)."""
    return 2 * LR * steps * (steps + 1) / 2 * grad_rel(batch) * grad_scale


def _scale(ref) -> float:
    """The largest gradient entry of the model: the magnitude the rounding bounds are
    relative to (a near-zero gradient, e.g. the key bias's, is a sum of terms of
    this size that cancel)."""
    return max(g.abs().max().item() for g in ref["grads"].values())


class DropFirstMicroBatch:
    """A planted defect: micro-batch 0's loss is counted but sends no gradient."""

    def __init__(self, m: int) -> None:
        self.m, self.calls = m, 0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, targets)
        self.calls += 1
        return loss.detach() + 0 * loss if self.calls % self.m == 1 else loss


class NoMeanOverMicroBatches:
    """A planted defect: the loss of each micro-batch is not divided by m."""

    def __init__(self, m: int) -> None:
        self.m = m

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets) * self.m


def _stale_gradients(batch: int, m: int, steps: int) -> dict:
    """A planted defect: the optimizer never zeroes the gradients (stale ones add)."""
    from dtlib.models.reference import gpt_batches
    from dtlib.models.run import RunConfig, run_steps
    from dtlib.pipeline_parallel.parallelism import PipelineParallel
    from dtlib.runtime.dist import world

    class Stale(PipelineParallel):
        def make_optimizer(self, wrapped, optimizer_class, **kwargs):
            opt = optimizer_class(wrapped.parameters(), **kwargs)
            opt.zero_grad = lambda set_to_none=True: None
            return opt

    opt = dict(OPTIMIZER)
    device = world().device
    res = run_steps(Stale("1f1b", m), build_gpt(CFG, seed=0).to(device),
                    gpt_batches(CFG, batch, device),
                    RunConfig(steps, optimizer_class=opt.pop("optimizer_class"),
                              optimizer_kwargs=opt))
    return {"losses": res.losses, "grads": res.grads, "params": res.params}


def _frozen_first_stage(schedule: str) -> list[torch.Tensor]:
    """Stage 0 frozen (fine-tuning): its output does not require grad."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4) for _ in range(p)]
    stages[0].requires_grad_(False)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipeline_step(stages[rank], x, y, n_microbatches=4, act_shape=(2, 4),
                  loss_fn=nn.functional.mse_loss, schedule=schedule)
    return [q.grad for q in stages[rank].parameters()]


def _pack(obj) -> bytes:
    """The references travel to the ranks as one byte string: as arguments of the
    new processes, each tensor would take a file descriptor (torch's shared-memory
    reduction), more than a process may pass."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def all_runs(packed_refs: bytes) -> dict:
    """On every rank: every variant with m != p; the frozen first stage; on
    2 ranks the planted defects, on 4 ranks m < p and two 2-stage pipelines in
    sub-groups {0, 1} and {2, 3}."""
    refs = _unpack(packed_refs)
    ws = dist.get_world_size()
    m = MICRO[ws]
    out = {"main": compare_all(PP_GPT, batch=2 * m, n_microbatches=m, steps=STEPS,
                               variants=VARIANTS + SPLIT_VARIANTS, ref=refs["main"]),
           "frozen": {s: _frozen_first_stage(s) for s in ("gpipe", "1f1b", "zb-h1")}}
    if ws == 2:
        out["drop"] = train_pipeline(PP_GPT, 2 * m, m, 1, loss=DropFirstMicroBatch(m))
        out["no_mean"] = train_pipeline(PP_GPT, 2 * m, m, 1,
                                        loss=NoMeanOverMicroBatches(m))
        out["stale"] = _stale_gradients(2 * m, m, STEPS)
    if ws == 4:
        out["few_mb"] = compare_all(PP_GPT, batch=4, n_microbatches=2, steps=2,
                                    variants=("ours-gpipe", "ours-1f1b"),
                                    ref=refs["few_mb"])
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        out["subgroup"] = train_pipeline(PP_GPT, 8, 4, 2, "ours-1f1b",
                                         group=groups[dist.get_rank() // 2])
    return out


def _refs(world_size: int) -> dict:
    m = MICRO[world_size]
    refs = {"main": reference(PP_GPT, 2 * m, STEPS)}
    if world_size == 4:
        refs["few_mb"] = reference(PP_GPT, 4, 2)
        refs["subgroup"] = reference(PP_GPT, 8, 2)
    return refs


@pytest.fixture(scope="module")
def launched() -> dict:
    """One launch per world size (run lazily, the first time a test asks)."""
    cache: dict = {}

    def get(world_size: int) -> tuple[dict, list[dict]]:
        if world_size not in cache:
            refs = _refs(world_size)
            cache[world_size] = refs, launch.spawn(all_runs, world_size, _pack(refs),
                                                   stream=False, timeout=400)
        return cache[world_size]
    return get


def _check(res: dict, ref, batch: int, steps: int) -> None:
    g = _scale(ref)
    assert res["loss_diff"] <= loss_rel(batch) * max(ref["losses"]), res
    assert res["grad_diff"] <= grad_rel(batch) * g, res
    assert res["param_diff"] <= param_atol(batch, steps, g), res
    # training moved the parameters far more than the tolerance: not vacuous
    assert res["moved"] > 100 * param_atol(batch, steps, g), res


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS + SPLIT_VARIANTS)
def test_matches_single_process(launched, world_size, variant):
    refs, per_rank = launched(world_size)
    m = MICRO[world_size]
    for rank, r in enumerate(per_rank):
        _check(r["main"][variant], refs["main"], 2 * m, STEPS)
    # every parameter of the model is on exactly one stage
    total = sum(r["main"][variant]["n_params"] for r in per_rank)
    assert total == sum(p.numel() for p in build_gpt(CFG).parameters())


@pytest.mark.parametrize("world_size", [2, 4])
def test_library_agrees_with_teaching(launched, world_size):
    refs, per_rank = launched(world_size)
    m = MICRO[world_size]
    tol = param_atol(2 * m, STEPS, _scale(refs["main"]))
    for r in per_rank:
        # same accumulation order (forward order) as the teaching 1F1B: bitwise equal
        assert r["main"]["torch-1f1b"]["vs_teaching"] == 0.0
        assert r["main"]["torch-gpipe"]["vs_teaching"] <= tol
        assert r["main"]["tracer-gpipe"]["vs_teaching"] <= tol


def test_fewer_microbatches_than_stages_and_subgroups(launched):
    refs, per_rank = launched(4)
    for r in per_rank:
        for variant in ("ours-gpipe", "ours-1f1b"):
            _check(r["few_mb"][variant], refs["few_mb"], 4, 2)
    ref = refs["subgroup"]
    for r in per_rank:  # each pair trains the whole model: every stage gathered
        sub = r["subgroup"]
        assert sub["params"].keys() == ref["params"].keys()
        tol = param_atol(8, 2, _scale(ref))
        for n, q in sub["params"].items():
            torch.testing.assert_close(q, ref["params"][n], rtol=0, atol=tol, msg=n)


def _compare(run: dict, ref, batch: int, steps: int) -> None:
    """The test's comparison, on every stage's gathered tensors."""
    g = _scale(ref)
    assert run["grads"].keys() == ref["grads"].keys()
    for n, t in run["grads"].items():
        torch.testing.assert_close(t, ref["grads"][n], rtol=0,
                                   atol=grad_rel(batch) * g, msg=f"grad {n}")
    for n, t in run["params"].items():
        torch.testing.assert_close(t, ref["params"][n], rtol=0,
                                   atol=param_atol(batch, steps, g), msg=f"param {n}")
    torch.testing.assert_close(run["losses"], ref["losses"][:len(run["losses"])],
                               rtol=loss_rel(batch), atol=0, msg="losses")


def test_tolerances_catch_planted_defects(launched):
    """Each defect fails the comparison the proofs above pass."""
    refs, per_rank = launched(2)
    m = MICRO[2]
    one_step = reference(PP_GPT, 2 * m, 1)
    for r in per_rank:
        # micro-batch 0's gradient dropped: its loss still counted, the gradients off
        # by about 1/m of their size
        with pytest.raises(AssertionError, match="grad"):
            _compare(r["drop"], one_step, 2 * m, 1)
        # no 1/m: the loss and every gradient m times too large
        with pytest.raises(AssertionError):
            _compare(r["no_mean"], one_step, 2 * m, 1)
        # stale gradients: step 0 is right, the trajectory is not
        stale = r["stale"]
        torch.testing.assert_close(stale["losses"][0], refs["main"]["losses"][0],
                                   rtol=loss_rel(2 * m), atol=0)
        with pytest.raises(AssertionError, match="param"):
            _compare(stale, refs["main"], 2 * m, STEPS)


@pytest.mark.parametrize("world_size", [2, 4])
def test_measured_in_flight(launched, world_size):
    m = MICRO[world_size]
    _, per_rank = launched(world_size)
    assert per_rank[0]["main"]["ours-gpipe"]["peak_in_flight"] == m
    assert per_rank[0]["main"]["ours-1f1b"]["peak_in_flight"] == world_size < m
    for s, r in enumerate(per_rank):
        assert r["main"]["ours-1f1b"]["peak_in_flight"] == world_size - s
        # ZB-H1: every stage holds p micro-batches (W needs their activations)
        assert r["main"]["ours-zb-h1"]["peak_in_flight"] == world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_backward_is_the_fused_one_on_ranks(launched, world_size):
    """ZB-H1 runs each W in micro-batch order, as 1F1B runs its backwards: the same
    kernels on the same operands, added in the same order, so the parameters after
    every step are bitwise 1F1B's; and each stage held, for its deferred W's, the
    output gradients the chapter counts (gpt_w_bytes) times the W's held at once."""
    m = MICRO[world_size]
    per_rank = launched(world_size)[1]
    for s, r in enumerate(per_rank):
        zb = r["main"]["ours-zb-h1"]
        assert zb["vs_1f1b"] == 0.0, (s, zb["vs_1f1b"])
        order = schedule_order("zb-h1", s, world_size, m)
        held = peak = 0
        for kind, _ in order:
            held += {"B": 1, "W": -1}.get(kind, 0)
            peak = max(peak, held)
        per_mb = gpt_w_bytes(CFG.hidden, CFG.seq_len, 2, CFG.n_layers // world_size,
                             first=s == 0, last=s == world_size - 1,
                             vocab=CFG.vocab_size)
        assert zb["w_bytes_peak"] == peak * per_mb, (s, zb["w_bytes_peak"], peak)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_first_stage(launched, schedule, world_size):
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4) for _ in range(world_size)]
    stages[0].requires_grad_(False)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    nn.functional.mse_loss(nn.Sequential(*stages)(x), y).backward()
    got = [r["frozen"][schedule] for r in launched(world_size)[1]]
    assert got[0] == [None, None]  # the frozen stage has no gradients
    # fp32, 8 rows of a 4-wide chain through <= 4 layers: a few ulps; 1e-6 absolute
    # on gradients of size ~0.1-1
    for stage, grads in zip(stages[1:], got[1:]):
        for want, g in zip(stage.parameters(), grads):
            torch.testing.assert_close(g, want.grad, rtol=0, atol=1e-6)


def test_factory_rejects_bad_arguments():
    with pytest.raises(ValueError, match="schedule"):
        parallelism("zero-bubble", 2)
    with pytest.raises(ValueError, match="n_micro"):
        parallelism("1f1b", 0)
    with pytest.raises(ValueError, match="variant"):
        parallelism("1f1b", 2, variant="deepspeed")
    with pytest.raises(ValueError, match="micro_batch"):
        parallelism("gpipe", 2, variant="tracer")
    with pytest.raises(ValueError, match="schedule='zb-h1' splits"):
        PipelineParallel("zb-h1", 2, wrap_stage=lambda st: st)
    with pytest.raises(ValueError, match="schedule='zb-h1' with variant='torch'"):
        parallelism("zb-h1", 2, variant="torch")


def test_in_flight_bound_and_orders():
    for p, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 5, 8, 16)):
        for s in range(p):
            for name in ("gpipe", "1f1b"):
                order = schedule_order(name, s, p, m)
                assert sorted(order) == sorted([("F", i) for i in range(m)] +
                                               [("B", i) for i in range(m)])
                # backward of i after its forward
                assert all(order.index(("F", i)) < order.index(("B", i))
                           for i in range(m))
            assert in_flight_peak(schedule_order("gpipe", s, p, m)) == m
            assert in_flight_peak(schedule_order("1f1b", s, p, m)) == min(p - s, m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_bubble_is_the_formula(schedule):
    for p, m in itertools.product((1, 2, 4, 8), (1, 3, 4, 16)):
        events = simulate(schedule, p, m, t_fwd=1.0, t_bwd=2.0)
        assert max(e.end for e in events) == pytest.approx((m + p - 1) * 3.0)
        for idle in idle_fractions(events, p):
            assert idle == pytest.approx(bubble_fraction(p, m))


def test_single_stage_step_equals_plain_backward():
    cfg = CFG
    a, b = build_gpt(cfg), build_gpt(cfg)
    idx, tgt = token_batch(cfg, 6)
    res = pipeline_step(split_gpt(a, 1)[0], idx, tgt, n_microbatches=3,
                        act_shape=(2, cfg.seq_len, cfg.hidden), loss_fn=lm_loss)
    loss = lm_loss(b(idx), tgt)
    loss.backward()
    assert res.loss == pytest.approx(loss.item(), abs=1e-6)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-5, msg=n)


def test_split_balance_and_names():
    assert balanced_layers(8, 4) == [2, 2, 2, 2]
    assert balanced_layers(10, 4) == [2, 3, 3, 2]
    assert balanced_layers(7, 3) == [2, 3, 2]
    model = build_gpt(GPTConfig(**dict(PP_GPT, n_layers=10)))
    stages = split_gpt(model, 4)
    assert [len(s.blocks) for s in stages] == [2, 3, 3, 2]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    assert layers_from_split_points(24, [5, 11, 17]) == [5, 6, 6, 7]


def test_balance_is_optimal_and_beats_seed_split():
    rng = random.Random(0)
    for _ in range(30):
        n, p = rng.randint(2, 7), rng.randint(1, 4)
        if p > n:
            continue
        costs = [rng.random() * 3 for _ in range(n + 2)]
        best = min(max(stage_costs(costs, list(c)))
                   for c in itertools.product(range(1, n + 1), repeat=p) if sum(c) == n)
        assert max(stage_costs(costs, balance(costs, p))) == pytest.approx(best)
    cfg = GPTConfig(vocab_size=50257, seq_len=1024, n_layers=24, hidden=1024,
                    n_heads=16, tie_weights=False)
    costs = gpt_layer_costs(cfg)
    seed = max(stage_costs(costs, layers_from_split_points(24, [5, 11, 17])))
    assert max(stage_costs(costs, balance(costs, 4))) < 0.85 * seed


def test_validation_errors():
    cfg = CFG
    with pytest.raises(ValueError, match="n_stages"):
        split_gpt(build_gpt(cfg), 9)  # 8 layers
    with pytest.raises(ValueError, match="tie_weights"):
        split_gpt(build_gpt(GPTConfig(**dict(PP_GPT, tie_weights=True))), 2)
    with pytest.raises(ValueError, match="layers_per_stage"):
        split_gpt(build_gpt(cfg), 2, [3, 4])
    with pytest.raises(ValueError, match="schedule"):
        schedule_order("zero-bubble", 0, 2, 4)
    with pytest.raises(ValueError, match="stage"):
        schedule_order("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="n_microbatches"):
        bubble_fraction(4, 0)
    idx, tgt = token_batch(cfg, 6)
    with pytest.raises(ValueError, match="must divide the batch"):
        pipeline_step(split_gpt(build_gpt(cfg), 1)[0], idx, tgt, n_microbatches=4,
                      act_shape=(1, cfg.seq_len, cfg.hidden), loss_fn=lm_loss)
    with pytest.raises(ValueError, match="split_points"):
        layers_from_split_points(24, [11, 5])


def test_causal_mask_blocks_the_future():
    torch.manual_seed(0)
    cfg = CFG
    model = build_gpt(cfg)
    causal = model.blocks[0].attn
    x = torch.randn(2, cfg.seq_len, cfg.hidden)
    assert future_influence(causal, x, 10) == 0.0
    unmasked = UnmaskedSelfAttention.from_causal(causal, cfg)
    assert future_influence(unmasked, x, 10) > 1e-3
    mha = nn.MultiheadAttention(cfg.hidden, cfg.n_heads, batch_first=True)
    assert future_influence(lambda t: mha(t, t, t)[0], x, 10) > 1e-3
    mask = nn.Transformer.generate_square_subsequent_mask(cfg.seq_len)
    assert future_influence(lambda t: mha(t, t, t, attn_mask=mask)[0], x, 10) == 0.0
    idx, _ = token_batch(cfg, 2)
    assert token_future_influence(model, idx, 10, cfg.vocab_size) == 0.0
    for block in model.blocks:
        block.attn = UnmaskedSelfAttention.from_causal(block.attn, cfg)
    assert token_future_influence(model, idx, 10, cfg.vocab_size) > 1e-4


def test_first_backward_checker_matches_the_simulation(capsys):
    from dtlib.exercises.tripwires import ShortcutTaken

    # the checker's truth is simulate(); the closed form agrees with it, and a walk
    # over the simulated events is the truth itself, switched off while it runs
    def closed_form(sch, s, p, m, tf, tb):
        return (p - 1 + (m if sch == "gpipe" else 1)) * tf + (p - 1 - s) * tb

    def from_events(sch, s, p, m, tf, tb):
        return min(e.start for e in simulate(sch, p, m, tf, tb)
                   if e.stage == s and e.kind == "B")

    ex.check_first_backward(closed_form)
    with pytest.raises(ShortcutTaken, match="simulate"):
        ex.check_first_backward(from_events)
    with pytest.raises(WrongAnswer):  # GPipe's first backward is not micro-batch 0's
        ex.check_first_backward(lambda sch, s, p, m, tf, tb: p * tf + (p - 1 - s) * tb)
    assert capsys.readouterr().out.count("Correct") == 1
