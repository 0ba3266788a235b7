"""Chapter 8: gradient accumulation equals the large batch, on 1, 2 and 4 ranks.

Tolerance: accumulating micro-batch gradients sums the same per-token contributions as
one large-batch backward, in a different order (per micro-batch, then across
micro-batches and, under DDP, across ranks), so float32 gradients agree to rounding
(measured ~2e-7 relative): compared with rtol=1e-5, atol=1e-7. After 5 AdamW steps
(lr=1e-3), whose update divides by gradient magnitudes, parameters are compared with
rtol=1e-4, atol=1e-5, as in Chapter 3. The defects the chapter teaches (mean of means,
a per-rank token count, the remainder divided by accum_steps) move gradients by > 1e-2
relative and parameters by ~1e-3, far outside these tolerances; tests check that too.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from dtlib.runtime import launch
from dtlib.accumulation.micro_batches import (EpochStats, accumulate_gradients, count_tokens,
                                make_grad_scaler, micro_batch_groups, token_loss_sum,
                                train_epoch)
from dtlib.chapters.ch08_gradient_accumulation.runs import (TINY, ddp_suite, global_groups,
                                        large_batch_grads, pad_collate,
                                        reference_steps, relative_error,
                                        variable_length_batches,
                                        variable_length_dataset)
from dtlib.chapters.ch08_gradient_accumulation.seed import (SEED_BATCH_SIZE, scaler_with_bf16,
                                     seed_accumulate, seed_epoch, seed_rebuilt_loader)
from dtlib.chapters.ch03_data_parallel.runs import grads_of, params_of
from dtlib.exercises import WrongAnswer
from dtlib.exercises.accumulation import check_allreduce_calls
from dtlib.models.gpt import build_gpt, token_batch

GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A tiny model on a loaded 2-core machine: a second thread only contends."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _assert_all_close(got: dict, want: dict, tol: dict, what: str) -> None:
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=f"{what} {name}")


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
    stats = accumulate_gradients(model, group)
    assert stats.micro_batches == k and stats.tokens == 8 * TINY.seq_len
    _assert_all_close(grads_of(model), truth, GRAD_TOL, "grad")


def test_variable_length_token_normalised_matches_mean_of_means_does_not() -> None:
    group = variable_length_batches(TINY, 4, 2, seed=1)
    counts = [count_tokens(mb) for mb in group]
    assert len(set(counts)) > 1, "the test needs unequal token counts"
    model = build_gpt(TINY)
    truth = large_batch_grads(model, group)
    accumulate_gradients(model, group)
    ours = grads_of(model)
    model.zero_grad(set_to_none=True)
    seed_accumulate(model, group, accum_steps=len(group))
    seed = grads_of(model)
    _assert_all_close(ours, truth, GRAD_TOL, "grad")
    assert relative_error(ours, truth) < 1e-5
    assert relative_error(seed, truth) > 1e-2


@pytest.mark.parametrize("remainder", [1, 3])
def test_remainder_group(remainder: int) -> None:
    accum_steps = 4
    idx, targets = token_batch(TINY, remainder, seed=5)  # equal token counts
    group = list(zip(idx.split(1), targets.split(1)))
    model = build_gpt(TINY)
    truth = large_batch_grads(model, group)
    accumulate_gradients(model, group)
    _assert_all_close(grads_of(model), truth, GRAD_TOL, "grad")
    model.zero_grad(set_to_none=True)
    seed_accumulate(model, group, accum_steps)
    # The seed's remainder gradient is remainder / accum_steps of the right one.
    for name, g in grads_of(model).items():
        torch.testing.assert_close(g, truth[name] * remainder / accum_steps,
                                   **GRAD_TOL)


def test_train_epoch_equals_large_batch_steps_with_a_remainder() -> None:
    accum_steps, micro_batch = 3, 2
    data = variable_length_dataset(TINY, 13 * micro_batch, seed=7)  # 13 micro-batches
    loader = DataLoader(data, batch_size=micro_batch, collate_fn=pad_collate)
    groups = list(micro_batch_groups(loader, accum_steps))
    assert [len(g) for g in groups] == [3, 3, 3, 3, 1]
    ref = reference_steps(TINY, groups)
    model = build_gpt(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = train_epoch(model, opt, loader, accum_steps)
    assert stats.optimizer_steps == 5 and stats.micro_batches == 13
    assert stats.tokens == sum(count_tokens(mb) for g in groups for mb in g)
    _assert_all_close(params_of(model), ref["params"], PARAM_TOL, "param")
    # The seed's division of the remainder by accum_steps ends elsewhere.
    model = build_gpt(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for g in groups:
        seed_accumulate(model, g, accum_steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert relative_error(params_of(model), ref["params"]) > 1e-4


def test_empty_loader() -> None:
    model = build_gpt(TINY)
    before = params_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = train_epoch(model, opt, [], 4)
    assert stats.optimizer_steps == 0 and stats.micro_batches == 0
    assert stats.loss != stats.loss  # nan: nothing was measured
    _assert_all_close(params_of(model), before, dict(rtol=0, atol=0), "param")
    with pytest.raises(NameError):
        seed_epoch(model, opt, [], 4)
    with pytest.raises(ValueError, match="group"):
        accumulate_gradients(model, [])


def test_train_epoch_reads_the_callers_loader() -> None:
    data = variable_length_dataset(TINY, 40, seed=2)
    loader = DataLoader(data, batch_size=4, collate_fn=pad_collate)
    sizes: list[int] = []

    def recording_loss(model, micro_batch):  # noqa: ANN001, ANN202
        sizes.append(micro_batch[0].shape[0])
        return token_loss_sum(model, micro_batch)

    model = build_gpt(TINY)
    stats = train_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, 4,
                        loss_fn=recording_loss)
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
    stats = train_epoch(model, opt, loader, 2, dtype=torch.bfloat16, max_grad_norm=1.0)
    assert isinstance(stats, EpochStats) and stats.optimizer_steps == 2
    assert torch.isfinite(torch.tensor(stats.loss))


def test_train_epoch_fp16_steps_through_a_grad_scaler() -> None:
    loader = variable_length_batches(TINY, 4, 2, seed=4)
    model = build_gpt(TINY)
    before = params_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        stats = train_epoch(model, opt, loader, 2, dtype=torch.float16)
    except RuntimeError as exc:  # older torch: no float16 autocast/scaler on this device
        pytest.skip(f"float16 autocast with GradScaler unsupported here: {exc}")
    assert stats.optimizer_steps == 2
    moved = max((p - before[n]).abs().max().item() for n, p in params_of(model).items())
    # Two AdamW steps of lr=1e-3 move the largest entry by ~2e-3; a scaler that skipped
    # both steps (inf/nan gradients) would leave the parameters where they were.
    assert 1e-3 < moved < 3e-3


ACCUM = 3
RUNS = [dict(variant=v, method=m, use_no_sync=ns)
        for v, m, ns in [("torch", "tokens", True), ("torch", "tokens", False),
                         ("bucketed", "tokens", True), ("bucketed", "tokens", False),
                         ("overlapped", "tokens", True), ("torch", "seed", False),
                         ("bucketed", "local_tokens", True),
                         ("overlapped", "trainer", True)]]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_accumulation_equals_large_batch(world_size: int) -> None:
    runs = [dict(cfg=TINY, accum_steps=ACCUM, micro_batch=2, steps=STEPS, **r)
            for r in RUNS]
    results = launch.spawn(ddp_suite, world_size, runs, stream=False, timeout=180)
    ref = reference_steps(TINY, global_groups(TINY, world_size, ACCUM, 2, STEPS))
    by_run = {(r["variant"], r["method"], r["use_no_sync"]): [res[i] for res in results]
              for i, r in enumerate(RUNS)}
    # Ranks really held different numbers of tokens (else a per-rank count is right).
    assert len({res["tokens"][0] for res in by_run["torch", "tokens", True]}) > 1
    for key, per_rank in by_run.items():
        for rank, res in enumerate(per_rank):
            if key[1] == "trainer":
                assert res["stats"].optimizer_steps == STEPS
                _assert_all_close(res["params"], ref["params"], PARAM_TOL,
                                  f"{key} param")
            elif key[1] == "tokens":
                _assert_all_close(res["grads"], ref["grads"], GRAD_TOL, f"{key} grad")
                _assert_all_close(res["params"], ref["params"], PARAM_TOL,
                                  f"{key} param")
                assert res["count_allreduces"] == [1] * STEPS  # one int per group
            else:
                assert relative_error(res["grads"], ref["grads"]) > 1e-2, key
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
