"""Chapter 8: gradient accumulation equals the large batch, on 1, 2 and 4 ranks.

Tolerances (derived in ``fp32_tolerance.py``, never read off this CPU):

- gradients: accumulating micro-batch gradients sums the same per-token
  contributions as one large-batch backward, in another order (per micro-batch, then
  across micro-batches and, under DDP, across ranks), and the kernels may block a
  micro-batch's products differently from the large batch's. The longest reduction
  is ``4h = 128`` terms (fc_proj), a gradient sums at most ``T`` target positions of
  mixed sign (every position of the accumulated batch, all ranks), through ~4
  reductions per block forward and backward over 2 blocks (8):
  ``reorder_rel(128, 8, T)`` of each tensor's largest element.
- parameters after ``STEPS`` steps of SGD with momentum (an update linear in the
  gradient): ``lr * momentum_gain * rel * max|g|`` (the model's largest step-0
  gradient), doubled for the feedback of slightly different parameters into later
  gradients, plus one rounding of each update per step (``STEPS * u * max|p|``).
- The defects the chapter teaches (mean of means, a per-rank token count, the
  remainder divided by ``accum_steps``) are off by more than 10 times these bounds;
  the tests check that too.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader

from fp32_tolerance import assert_all_scaled, reorder_rel, sgd_param_scale
from dtlib.accumulation import (EpochStats, accumulate_gradients, accumulation_step,
                                count_tokens, make_grad_scaler, micro_batch_groups,
                                token_loss_sum, train_epoch)
from dtlib.chapters.ch08_gradient_accumulation.runs import (
    TINY, ddp_suite, global_groups, large_batch_grads, pad_collate, reference_steps,
    variable_length_batches, variable_length_dataset)
from dtlib.chapters.ch08_gradient_accumulation.seed import (
    SEED_BATCH_SIZE, scaler_with_bf16, seed_accumulate, seed_epoch,
    seed_rebuilt_loader)
from dtlib.exercises import WrongAnswer
from dtlib.exercises.accumulation import check_allreduce_calls
from dtlib.models.gpt import build_gpt, token_batch
from dtlib.models.reference import grads_of, params_of
from dtlib.models.run import Parallelism, RunConfig, RunResult, run_steps
from dtlib.runtime import launch

STEPS, LR, MOMENTUM = 5, 0.05, 0.9
SGD = dict(lr=LR, optimizer_class=torch.optim.SGD, momentum=MOMENTUM)
ONE = Parallelism()  # one process


def grad_rel(positions: int) -> float:
    """Scale-relative gradient bound for ``positions`` targets summed (docstring)."""
    return reorder_rel(4 * TINY.hidden, 8, positions)


def positions(groups: list) -> int:
    """Target positions (padding included: an upper bound) of one step's batch."""
    return max(sum(mb[1].numel() for mb in g) for g in groups)


def param_bound(rel: float, ref: RunResult) -> float:
    return sgd_param_scale(rel, ref.grads, ref.params, LR, STEPS, MOMENTUM)


def max_diff(got: dict, want: dict) -> float:
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def grad_excess(got: dict, want: dict, rel: float) -> float:
    """How many times its tolerance the worst tensor's gradient difference is."""
    return max((got[k].double() - w.double()).abs().max().item()
               / (rel * w.abs().max().item()) for k, w in want.items())


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A tiny model on a loaded 2-core machine: a second thread only contends (unless
    OMP_NUM_THREADS asks for more: the proofs must hold for any thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    yield
    torch.set_num_threads(before)


def test_pad_collate_and_token_count() -> None:
    samples = [(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4])),
               (torch.tensor([5]), torch.tensor([6]))]
    idx, targets = pad_collate(samples)
    assert idx.tolist() == [[1, 2, 3], [5, 0, 0]]
    assert targets.tolist() == [[2, 3, 4], [6, -100, -100]]
    assert count_tokens((idx, targets)) == 4
    with pytest.raises(ValueError, match="micro_batch"):
        count_tokens((idx,))


def test_groups_keep_the_remainder_and_survive_an_empty_loader() -> None:
    assert [len(g) for g in micro_batch_groups(range(10), 4)] == [4, 4, 2]
    assert [len(g) for g in micro_batch_groups(range(8), 4)] == [4, 4]
    assert list(micro_batch_groups([], 4)) == []
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="accum_steps"):
            list(micro_batch_groups(range(3), bad))


def test_equal_length_micro_batches_equal_one_big_batch() -> None:
    model = build_gpt(TINY)
    idx, targets = token_batch(TINY, 8, seed=3)
    model(idx, targets)[1].backward()
    truth = grads_of(model)
    model.zero_grad(set_to_none=True)
    k = 4
    group = list(zip(idx.chunk(k), targets.chunk(k)))
    stats = accumulate_gradients(ONE, model, group)
    assert stats.micro_batches == k and stats.tokens == 8 * TINY.seq_len
    assert stats.global_tokens == stats.tokens
    assert isinstance(stats.loss_sum, torch.Tensor)  # no host read per micro-batch
    assert_all_scaled(grads_of(model), truth, grad_rel(8 * TINY.seq_len), "grad")


def test_variable_length_token_normalised_matches_mean_of_means_does_not() -> None:
    group = variable_length_batches(TINY, 4, 2, seed=1)
    counts = [count_tokens(mb) for mb in group]
    assert len(set(counts)) > 1, "the test needs unequal token counts"
    model = build_gpt(TINY)
    truth = large_batch_grads(model, group)
    accumulate_gradients(ONE, model, group)
    ours = grads_of(model)
    model.zero_grad(set_to_none=True)
    seed_accumulate(model, group, accum_steps=len(group))
    seed = grads_of(model)
    rel = grad_rel(positions([group]))
    assert_all_scaled(ours, truth, rel, "grad")
    assert grad_excess(seed, truth, rel) > 10


@pytest.mark.parametrize("remainder", [1, 3])
def test_remainder_group(remainder: int) -> None:
    accum_steps = 4
    idx, targets = token_batch(TINY, remainder, seed=5)  # equal token counts
    group = list(zip(idx.split(1), targets.split(1)))
    model = build_gpt(TINY)
    truth = large_batch_grads(model, group)
    accumulate_gradients(ONE, model, group)
    rel = grad_rel(remainder * TINY.seq_len)
    assert_all_scaled(grads_of(model), truth, rel, "grad")
    model.zero_grad(set_to_none=True)
    seed_accumulate(model, group, accum_steps)
    # The seed's remainder gradient is remainder / accum_steps of the right one.
    seed = grads_of(model)
    assert_all_scaled(seed, {k: g * remainder / accum_steps for k, g in truth.items()},
                      rel, "seed grad")
    assert grad_excess(seed, truth, rel) > 10


def _seed_step(accum_steps: int) -> Callable[..., torch.Tensor]:
    def step(par, model, group, loss_fn, scaler=None):  # noqa: ANN001, ANN202
        seed_accumulate(model, group, accum_steps)
        return torch.zeros(())
    return step


def test_train_epoch_equals_large_batch_steps_with_a_remainder() -> None:
    accum_steps, micro_batch = 3, 2
    data = variable_length_dataset(TINY, 13 * micro_batch, seed=7)  # 13 micro-batches
    loader = DataLoader(data, batch_size=micro_batch, collate_fn=pad_collate)
    groups = list(micro_batch_groups(loader, accum_steps))
    assert [len(g) for g in groups] == [3, 3, 3, 3, 1]
    ref = reference_steps(TINY, groups, **SGD)
    bound = param_bound(grad_rel(positions(groups)), ref)
    model = build_gpt(TINY)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    stats = train_epoch(ONE, model, opt, loader, accum_steps)
    assert stats.optimizer_steps == 5 and stats.micro_batches == 13
    assert stats.tokens == sum(count_tokens(mb) for g in groups for mb in g)
    err = max_diff(params_of(model), ref.params)
    assert err <= bound, f"params: max |diff| {err:.3e} > {bound:.3e}"
    for got, want in zip(stats.losses, ref.losses):  # T positive terms, 8 sums
        assert abs(got - want) <= 2 * reorder_rel(positions(groups), 8) * want
    # The seed's division of the remainder by accum_steps ends elsewhere: the one
    # loop with the seed's accumulation as its step.
    seed = run_steps(ONE, build_gpt(TINY), groups.__getitem__,
                     RunConfig(len(groups), optimizer_class=torch.optim.SGD,
                               optimizer_kwargs=dict(lr=LR, momentum=MOMENTUM),
                               step_fn=_seed_step(accum_steps), local_batches=True))
    assert max_diff(seed.params, ref.params) > 10 * bound


def test_empty_loader() -> None:
    model = build_gpt(TINY)
    before = params_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = train_epoch(ONE, model, opt, [], 4)
    assert stats.optimizer_steps == 0 and stats.micro_batches == 0
    assert stats.loss != stats.loss  # nan: nothing was measured
    for name, p in params_of(model).items():
        assert torch.equal(p, before[name]), name
    with pytest.raises(NameError):
        seed_epoch(model, opt, [], 4)
    with pytest.raises(ValueError, match="group"):
        accumulate_gradients(ONE, model, [])


def test_train_epoch_reads_the_callers_loader() -> None:
    data = variable_length_dataset(TINY, 40, seed=2)
    loader = DataLoader(data, batch_size=4, collate_fn=pad_collate)
    sizes: list[int] = []

    def recording_loss(model, idx, targets):  # noqa: ANN001, ANN202
        sizes.append(idx.shape[0])
        return token_loss_sum(model, idx, targets)

    model = build_gpt(TINY)
    stats = train_epoch(ONE, model, torch.optim.SGD(model.parameters(), lr=0.1),
                        loader, 4, loss_fn=recording_loss)
    assert sizes == [4] * 10 and stats.optimizer_steps == 3
    assert next(iter(seed_rebuilt_loader(loader)))[0].shape[0] == SEED_BATCH_SIZE


def test_grad_scaler_only_for_fp16() -> None:
    assert make_grad_scaler(None) is None
    assert make_grad_scaler(torch.float32) is None
    assert make_grad_scaler(torch.bfloat16) is None
    assert isinstance(make_grad_scaler(torch.float16), torch.amp.GradScaler)
    with pytest.raises(ValueError, match="dtype"):
        make_grad_scaler(torch.int8)
    demo = scaler_with_bf16(build_gpt(TINY), token_batch(TINY, 4))
    assert demo["max_abs_diff"] == 0.0 and demo["scale"] > 1
    assert demo["below_bf16"] == 0


def test_train_epoch_bf16_runs_without_scaler() -> None:
    loader = variable_length_batches(TINY, 4, 2, seed=4)
    model = build_gpt(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = train_epoch(ONE, model, opt, loader, 2, dtype=torch.bfloat16,
                        max_grad_norm=1.0)
    assert isinstance(stats, EpochStats) and stats.optimizer_steps == 2
    assert torch.isfinite(torch.tensor(stats.loss))


def test_train_epoch_fp16_steps_through_a_grad_scaler() -> None:
    loader = variable_length_batches(TINY, 4, 2, seed=4)
    model = build_gpt(TINY)
    before = params_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        stats = train_epoch(ONE, model, opt, loader, 2, dtype=torch.float16)
    except RuntimeError as exc:  # older torch: no float16 autocast/scaler here
        pytest.skip(f"float16 autocast with GradScaler unsupported here: {exc}")
    assert stats.optimizer_steps == 2
    moved = max((p - before[n]).abs().max().item() for n, p in params_of(model).items())
    # Two AdamW steps of lr=1e-3 move the largest entry by ~2e-3; a scaler that skipped
    # both steps (inf/nan gradients) would leave the parameters where they were.
    assert 1e-3 < moved < 3e-3


def test_accumulation_step_splits_a_tuple_and_keeps_its_stats() -> None:
    idx, targets = token_batch(TINY, 8, seed=3)
    step = accumulation_step(4)
    assert [mb[0].shape[0] for mb in step.micro_batches((idx, targets))] == [2] * 4
    with pytest.raises(ValueError, match="accum_steps=4"):
        step.micro_batches((idx[:6], targets[:6]))
    with pytest.raises(ValueError, match="accum_steps"):
        accumulation_step(0)
    # The one loop with it equals the whole batch at once (mean loss, same rows).
    sgd = dict(optimizer_class=torch.optim.SGD, optimizer_kwargs={"lr": LR})
    ref = run_steps(ONE, build_gpt(TINY), lambda k: (idx, targets), RunConfig(2, **sgd))
    got = run_steps(ONE, build_gpt(TINY), lambda k: (idx, targets),
                    RunConfig(2, step_fn=step, **sgd))
    assert len(step.stats) == 2 and step.stats[0].micro_batches == 4
    rel = grad_rel(8 * TINY.seq_len)
    assert_all_scaled(got.grads, ref.grads, rel, "grad")
    for a, b in zip(got.losses, ref.losses):  # 128 positive terms, 8 sums, doubled
        assert abs(a - b) <= 2 * reorder_rel(8 * TINY.seq_len, 8) * b


ACCUM, MICRO = 3, 2
RUNS = [dict(variant=v, method=m, use_no_sync=ns)
        for v, m, ns in [("torch", "tokens", True), ("torch", "tokens", False),
                         ("bucketed", "tokens", True), ("bucketed", "tokens", False),
                         ("overlapped", "tokens", True), ("torch", "seed", False),
                         ("bucketed", "local_tokens", True),
                         ("overlapped", "trainer", True)]]


@pytest.fixture(scope="module")
def ddp_runs() -> Callable[[int], tuple[dict[tuple, list[Any]], RunResult, list]]:
    """``ddp_runs(n)``: every configuration on ``n`` ranks (one launch), by key, and
    the one-process reference on the same global groups (computed once)."""
    cache: dict[int, tuple] = {}

    def get(n: int) -> tuple:
        if n not in cache:
            runs = [dict(cfg=TINY, accum_steps=ACCUM, micro_batch=MICRO, steps=STEPS,
                         lr=LR, optimizer_class=torch.optim.SGD,
                         optimizer_kwargs={"momentum": MOMENTUM}, **r) for r in RUNS]
            results = launch.spawn(ddp_suite, n, runs, stream=False, timeout=300)
            groups = global_groups(TINY, n, ACCUM, MICRO, STEPS)
            by_run = {(r["variant"], r["method"], r["use_no_sync"]):
                      [res[i] for res in results] for i, r in enumerate(RUNS)}
            cache[n] = by_run, reference_steps(TINY, groups, **SGD), groups
        return cache[n]
    return get


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_accumulation_equals_large_batch(world_size: int, ddp_runs) -> None:
    by_run, ref, groups = ddp_runs(world_size)
    rel = grad_rel(positions(groups))
    bound = param_bound(rel, ref)
    # Ranks really held different numbers of tokens (else a per-rank count is right).
    assert len({res["tokens"][0] for res in by_run["torch", "tokens", True]}) > 1
    for key, per_rank in by_run.items():
        for rank, res in enumerate(per_rank):
            what = f"{key}, rank {rank}"
            if key[1] in ("tokens", "trainer"):
                err = max_diff(res["params"], ref.params)
                assert err <= bound, f"{what} params: {err:.3e} > {bound:.3e}"
            if key[1] == "trainer":
                assert res["stats"].optimizer_steps == STEPS
            elif key[1] == "tokens":
                assert_all_scaled(res["grads"], ref.grads, rel, f"{what} grad")
                assert res["count_allreduces"] == [1] * STEPS  # one int per group
                for a, b in zip(res.losses, ref.losses):  # positive terms, doubled
                    assert abs(a - b) <= 2 * reorder_rel(positions(groups), 8) * b
            else:  # the chapter's defects fail the same comparison by far
                assert grad_excess(res["grads"], ref.grads, rel) > 10, what
                assert max_diff(res["params"], ref.params) > 10 * bound, what
    for variant in ("torch", "bucketed"):
        quiet = by_run[variant, "tokens", True][0]["grad_allreduces"]
        loud = by_run[variant, "tokens", False][0]["grad_allreduces"]
        n_buckets = quiet[-1]
        assert n_buckets >= 2, "the test needs several buckets"
        # Step 0 of torch DDP uses one bucket before it rebuilds them: skip it.
        assert quiet[1:] == [n_buckets] * (STEPS - 1)
        assert loud[1:] == [ACCUM * n_buckets] * (STEPS - 1)


def test_check_allreduce_calls() -> None:
    check_allreduce_calls(lambda a, n, quiet: n if quiet else a * n)
    for wrong in (lambda a, n, quiet: a * n,  # no_sync ignored
                  lambda a, n, quiet: n,  # never more than one sync
                  lambda a, n, quiet: a if quiet else a * n,
                  lambda a, n, quiet: float(n if quiet else a * n)):
        with pytest.raises(WrongAnswer):
            check_allreduce_calls(wrong)
