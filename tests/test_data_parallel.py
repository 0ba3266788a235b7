"""Chapter 3: every DDP (three teaching ones and torch's) equals one process.

Tolerance: the ranks sum the same per-sample gradient contributions as one process, but
in a different order (each rank sums its micro-batch, then the all-reduce sums the ranks;
one process sums the whole batch at once). float32 addition is not associative, so
gradients agree to rounding, ~1e-7 relative; after 5 AdamW steps, where the update
m/(sqrt(v)+eps) divides by gradient magnitudes, tiny gradient entries can amplify that
rounding, so parameters are compared with rtol=1e-4, atol=1e-5 (lr=1e-3: a real bug,
such as a missing division by world_size or a skipped all-reduce, moves them by ~1e-3).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.runtime import launch
from dtlib.collectives.accounting import count_comms
from dtlib.data_parallel.buckets import build_buckets
from dtlib.data_parallel.ddp import MODES, DataParallel
from dtlib.chapters.ch03_data_parallel.runs import TINY, grads_of, reference_training, train_replica
from dtlib.models.gpt import MLP

# count_comms(functional=False): DataParallel only calls dist.*, and the dispatch mode
# would import DTensor in every fresh rank (seconds each on this machine).
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 5
MICRO_BATCH = 2


@pytest.fixture(scope="module")
def references() -> dict[int, dict]:
    return {n: reference_training(TINY, n * MICRO_BATCH, STEPS) for n in (2, 4)}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", [*MODES, "torch"])
def test_ddp_equals_one_process(variant: str, world_size: int, references) -> None:
    results = launch.spawn(train_replica, world_size, TINY, variant, MICRO_BATCH, STEPS,
                           bucket_cap_mb=0.02, stream=False, timeout=120)
    ref = references[world_size]
    for rank, res in enumerate(results):
        for name in ref["grads"]:
            torch.testing.assert_close(res["grads"][name], ref["grads"][name],
                                       **GRAD_TOL, msg=f"rank {rank}, grad of {name}")
        for name in ref["params"]:
            torch.testing.assert_close(res["params"][name], ref["params"][name],
                                       **PARAM_TOL, msg=f"rank {rank}, param {name}")


def _no_sync_step(mode: str) -> dict:
    """Two micro-batches: the first inside no_sync (counted), the second synchronised."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DataParallel(MLP((8, 16, 4)), mode=mode, bucket_cap_mb=0.001)
    x = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(1))
    mine = x.view(2, world_size, 8)[:, rank]  # micro-batch k of this rank: row k
    with count_comms(functional=False) as quiet:
        with model.no_sync():
            model(mine[:1]).pow(2).mean().backward()
    local = grads_of(model.module)
    with count_comms(functional=False) as synced:
        model(mine[1:]).pow(2).mean().backward()
    return ({"quiet_bytes": quiet.total_bytes(), "quiet_calls": quiet.calls(),
            "synced_calls": synced.calls("all_reduce"), "local": local,
            "grads": grads_of(model.module), "state": model.module.state_dict()})


@pytest.mark.parametrize("mode", MODES)
def test_no_sync_sends_nothing_then_averages_the_sum(mode: str) -> None:
    world_size = 2
    results = launch.spawn(_no_sync_step, world_size, mode, stream=False)
    # The single-process truth: sum of both micro-batch gradients, averaged over ranks.
    model = MLP((8, 16, 4))
    model.load_state_dict(results[0]["state"])
    x = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(1))
    for k in range(2):
        for rank in range(world_size):
            (model(x.view(2, world_size, 8)[k, rank:rank + 1]).pow(2).mean()
             / world_size).backward()
    for res in results:
        assert res["quiet_bytes"] == 0 and res["quiet_calls"] == 0
        assert res["synced_calls"] > 0
        for name, p in model.named_parameters():
            torch.testing.assert_close(res["grads"][name], p.grad, **GRAD_TOL)
    # Inside no_sync the ranks really held different (local) gradients.
    assert not torch.allclose(results[0]["local"]["layers.0.weight"],
                              results[1]["local"]["layers.0.weight"])


def _wrap_different_inits(mode: str) -> dict:
    torch.manual_seed(dist.get_rank())  # a different model on every rank
    module = MLP((8, 16, 4))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    DataParallel(module, mode=mode)
    return ({"before": before, "after": module.state_dict()})


@pytest.mark.parametrize("mode", ["naive", "overlapped"])
def test_wrapping_makes_replicas_equal(mode: str) -> None:
    results = launch.spawn(_wrap_different_inits, 4, mode, stream=False)
    w = "layers.0.weight"
    assert not torch.equal(results[0]["before"][w], results[1]["before"][w])
    for res in results:
        for name, value in res["after"].items():
            torch.testing.assert_close(value, results[0]["before"][name], rtol=0, atol=0)


def _unused_parameter(mode: str) -> dict:
    """A parameter nobody uses keeps grad None; the others are still averaged."""
    torch.manual_seed(0)
    module = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 2),
                                  "unused": torch.nn.Linear(4, 2)})
    model = DataParallel(module, mode=mode, bucket_cap_mb=1e-5)
    x = torch.full((1, 4), float(dist.get_rank() + 1))
    model.module["used"](x).sum().backward()
    return ({"unused": module["unused"].weight.grad,
                     "used": module["used"].weight.grad})


@pytest.mark.parametrize("mode", MODES)
def test_parameters_without_gradient(mode: str) -> None:
    results = launch.spawn(_unused_parameter, 2, mode, stream=False)
    for res in results:
        assert res["unused"] is None
        # d(sum(W x))/dW = x per output row; mean of x over ranks = (1 + 2) / 2 = 1.5
        torch.testing.assert_close(res["used"], torch.full((2, 4), 1.5))


def _count_calls(mode: str) -> tuple[int, int, int]:
    model = DataParallel(MLP((8, 16, 16, 4)), mode=mode, bucket_cap_mb=0.001)
    with count_comms(functional=False) as log:
        model(torch.randn(2, 8)).sum().backward()
    return log.calls("all_reduce"), len(model.params), len(model.buckets)


def test_call_counts_per_mode() -> None:
    for mode in MODES:
        calls, n_tensors, n_buckets = launch.spawn(_count_calls, 2, mode, stream=False)[0]
        assert calls == (n_tensors if mode == "naive" else n_buckets), mode
        assert n_buckets < n_tensors


def test_buckets_reverse_order_and_cap() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 200, 300, 50)]
    buckets = build_buckets(params, bucket_cap_mb=1200 / 2**20)  # 300 floats per bucket
    assert [[p.numel() for p in b.params] for b in buckets] == [[50], [300], [200, 100]]
    assert [b.nbytes for b in buckets] == [200, 1200, 1200]
    one = build_buckets(params, bucket_cap_mb=1.0)
    assert len(one) == 1 and one[0].params[0] is params[-1]


def _bad_args() -> list[str]:
    errors = []
    for kwargs in ({"mode": "fast"}, {"bucket_cap_mb": 0}, {"bucket_cap_mb": -1}):
        try:
            DataParallel(MLP(), **kwargs)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_validation() -> None:
    errors = launch.spawn(_bad_args, 1, stream=False)[0]
    assert len(errors) == 3
    assert "mode='fast'" in errors[0] and "bucket_cap_mb=0" in errors[1]
    with pytest.raises(ValueError, match="process group"):
        DataParallel(MLP())  # no process group in the test process


# ---- exercise checkers: each accepts the right answer and rejects wrong ones ----------

def good_hook(group, bucket):
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def summing_hook(group, bucket):
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def silent_hook(group, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def test_bucket_hook_checker(capsys) -> None:
    from dtlib.exercises import WrongAnswer
    from dtlib.exercises.data_parallel import check_bucket_hook

    check_bucket_hook(good_hook)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="world_size times too large"):
        check_bucket_hook(summing_hook)
    with pytest.raises(WrongAnswer, match="0 all-reduce calls"):
        check_bucket_hook(silent_hook)


def test_epoch_orders_checker(capsys) -> None:
    from torch.utils.data import DistributedSampler

    from dtlib.exercises import WrongAnswer
    from dtlib.exercises.data_parallel import check_epoch_orders

    def right(n, world_size, rank, epochs):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank)
        out = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            out.append(list(sampler))
        return out

    def forgot_set_epoch(n, world_size, rank, epochs):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank)
        return [list(sampler) for _ in range(epochs)]

    def no_rank(n, world_size, rank, epochs):
        return right(n, 1, 0, epochs)

    check_epoch_orders(right)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="set_epoch"):
        check_epoch_orders(forgot_set_epoch)
    with pytest.raises(WrongAnswer, match="every sample once"):
        check_epoch_orders(no_rank)


def test_sampler_padding_counts_a_sample_twice() -> None:
    from dtlib.data_parallel import sampling

    padded = sampling.shards(10, 4)
    assert [len(s) for s in padded] == [3, 3, 3, 3]
    assert sum(sampling.duplicated(padded).values()) == 12 - 10 + 2
    values = torch.arange(10.0)
    assert sampling.sharded_mean(values, padded) != pytest.approx(4.5)
    exact = sampling.eval_shards(10, 4)
    assert sampling.duplicated(exact) == {}
    assert sampling.sharded_mean(values, exact) == pytest.approx(4.5)
    # Without set_epoch, every epoch is the same order.
    same = sampling.epoch_orders(10, 2, 0, 3, set_epoch=False)
    assert same[0] == same[1] == same[2]
    assert sampling.epoch_orders(10, 2, 0, 3)[0] != sampling.epoch_orders(10, 2, 0, 3)[1]
