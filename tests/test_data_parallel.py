"""Chapter 3: every DDP (three teaching ones and torch's) equals one process.

One launch per world size runs everything the tests compare (every variant trained
with SGD + momentum, three planted defects, and on 2 ranks the no_sync, unused
parameter, call count and validation cases); the one-process reference is computed
once per world size.

Tolerances (derived in ``fp32_tolerance.py``, never read off this CPU):

- gradients: the ranks add the same per-token contributions as one process, in
  another order (each rank its ``b * s`` tokens, then the all-reduce the ``N``
  partial sums; the kernels may also block a ``b``-row product differently from a
  ``N * b``-row one, so any reduction on the path may be reordered). The longest
  reduction is ``4h = 128`` terms (fc_proj), a gradient sums ``N * b * s`` tokens of
  mixed sign, and it passes ~4 reductions per block forward and backward over 2
  blocks (8): ``GRAD_REL = reorder_rel(128, 8, N * b * s)``, about 5e-4 (N=2) to
  7e-4 (N=4) of each tensor's largest element. A DDP that forgets the 1/N is off by
  ``(N - 1)`` times the gradient itself; one that never synchronises by the
  difference between half the batch's gradient and the whole batch's (tens of
  percent): both fail by orders of magnitude (tested below).
- losses: a mean over ``N * b * s`` positive token losses (no cancellation), 8
  reductions on the path, doubled for the feedback of slightly different parameters
  into later steps: ``2 * reorder_rel(N * b * s, 8)`` of the loss.
- parameters after ``STEPS`` steps of SGD with momentum (an update linear in the
  gradient): ``lr * momentum_gain * GRAD_REL * max|g|`` (the model's largest step-0
  gradient), doubled for the feedback of slightly different parameters into later
  gradients, plus one rounding of each update per step (``STEPS * u * max|p|``). An
  optimizer that never zeroes its gradients (a stale gradient in every step after
  the first) passes the gradient check and fails this one (tested below).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fp32_tolerance import assert_all_scaled, reorder_rel, sgd_param_scale
from dtlib.chapters.ch03_data_parallel.runs import (TINY, reference_gpt_run,
                                                    train_variants)
from dtlib.collectives.accounting import count_comms
from dtlib.data_parallel import (TEACHING_VARIANTS, VARIANTS, DataParallel,
                                 DataParallelism, build_buckets, parallelism,
                                 rows_of_rank)
from dtlib.models.gpt import MLP, build_gpt
from dtlib.models.reference import gpt_batches, grads_of
from dtlib.models.run import RunConfig, RunResult, run_steps
from dtlib.runtime import launch

# count_comms(): DataParallel only calls dist.*, and the dispatch mode
# would import DTensor in every fresh rank (seconds each on this machine).
STEPS, MICRO_BATCH, LR, MOMENTUM, CAP_MB = 5, 2, 0.05, 0.9, 0.02
SGD = dict(lr=LR, optimizer_class=torch.optim.SGD, momentum=MOMENTUM)
WORLD_SIZES = (2, 4)


def tokens(world_size: int) -> int:
    """Tokens of one global batch: ``N * b * s``."""
    return world_size * MICRO_BATCH * TINY.seq_len


def grad_rel(world_size: int) -> float:
    return reorder_rel(max(4 * TINY.hidden, world_size), 8, tokens(world_size))


def loss_rel(world_size: int) -> float:
    return 2 * reorder_rel(tokens(world_size), 8)


def param_bound(world_size: int, ref: RunResult) -> float:
    """The largest parameter difference rounding can make (see the module docstring)."""
    return sgd_param_scale(grad_rel(world_size), ref.grads, ref.params, LR, STEPS,
                           MOMENTUM)


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def grad_excess(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                rel: float) -> float:
    """How many times its tolerance the worst tensor's gradient difference is."""
    return max((got[k].double() - w.double()).abs().max().item()
               / (rel * w.abs().max().item()) for k, w in want.items())


def assert_equals_one_process(res: RunResult, ref: RunResult, world_size: int,
                              what: str) -> None:
    assert_all_scaled(res.grads, ref.grads, grad_rel(world_size), f"{what} grad")
    for k, (got, want) in enumerate(zip(res.losses, ref.losses)):
        assert abs(got - want) <= loss_rel(world_size) * abs(want), \
            f"{what} loss of step {k}: {got} != {want}"
    assert set(res.params) == set(ref.params)
    err, bound = max_diff(res.params, ref.params), param_bound(world_size, ref)
    assert err <= bound, f"{what} params: max |diff| {err:.3e} > {bound:.3e}"


# ---- planted defects: each must fail the comparison that is meant to catch it ------

class SummingDDP(DataParallelism):
    """A DDP that sums the ranks' gradients: the missing 1/N."""

    def forward_backward(self, wrapped: nn.Module, batch: Any, loss_fn: Any,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        return super().forward_backward(wrapped, batch, loss_fn,
                                        scale=scale * self.dp_size, scaler=scaler)


class UnsyncedDDP(DataParallelism):
    """A DDP that never synchronises: each rank steps its own gradient."""

    def grad_sync(self, wrapped: nn.Module, on: bool) -> ContextManager[None]:
        return wrapped.no_sync()


class StaleDDP(DataParallelism):
    """Right gradients, but the optimizer never zeroes them: from the second step
    on every step adds the earlier steps' (stale) gradients."""

    def make_optimizer(self, wrapped: nn.Module, optimizer_class: type,
                       **kwargs: Any) -> torch.optim.Optimizer:
        opt = super().make_optimizer(wrapped, optimizer_class, **kwargs)
        opt.zero_grad = lambda set_to_none=True: None  # the defect
        return opt


DEFECTS: dict[str, Callable[..., DataParallelism]] = {
    "summed": SummingDDP, "unsynced": UnsyncedDDP, "stale": StaleDDP}


# ---- what the ranks run: one launch per world size ----------------------------------

def _no_sync_step(variant: str) -> dict:
    """Two micro-batches: the first inside no_sync (counted), the second synced."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DataParallel(MLP((8, 16, 4)), variant=variant, bucket_cap_mb=0.001)
    x = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(1))
    mine = x.view(2, world_size, 8)[:, rank]  # micro-batch k of this rank: row k
    with count_comms() as quiet:
        with model.no_sync():
            model(mine[:1]).pow(2).mean().backward()
    local = grads_of(model.module)
    with count_comms() as synced:
        model(mine[1:]).pow(2).mean().backward()
    return ({"quiet_bytes": quiet.total_bytes(), "quiet_calls": quiet.calls(),
            "synced_calls": synced.calls("all_reduce"), "local": local,
            "grads": grads_of(model.module), "state": model.module.state_dict()})


def _wrap_different_inits(variant: str) -> dict:
    torch.manual_seed(dist.get_rank())  # a different model on every rank
    module = MLP((8, 16, 4))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    DataParallel(module, variant=variant)
    return ({"before": before, "after": module.state_dict()})


def _unused_parameter(variant: str) -> dict:
    """A parameter nobody uses keeps grad None; the others are still averaged."""
    torch.manual_seed(0)
    module = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 2),
                                  "unused": torch.nn.Linear(4, 2)})
    model = DataParallel(module, variant=variant, bucket_cap_mb=1e-5)
    x = torch.full((1, 4), float(dist.get_rank() + 1))
    model.module["used"](x).sum().backward()
    return ({"unused": module["unused"].weight.grad,
             "used": module["used"].weight.grad})


def _count_calls(variant: str) -> tuple[int, int, int]:
    model = DataParallel(MLP((8, 16, 16, 4)), variant=variant, bucket_cap_mb=0.001)
    with count_comms() as log:
        model(torch.randn(2, 8)).sum().backward()
    return log.calls("all_reduce"), len(model.params), len(model.buckets)


def _bad_args() -> list[str]:
    errors = []
    for make in (lambda: DataParallel(MLP(), variant="fast"),
                 lambda: DataParallel(MLP(), bucket_cap_mb=0),
                 lambda: DataParallel(MLP(), bucket_cap_mb=-1),
                 lambda: parallelism("fast"),
                 lambda: parallelism("torch", bucket_cap_mb=0),
                 lambda: parallelism("torch", timeline=True)):
        try:
            make()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def _suite() -> dict[str, Any]:
    n = dist.get_world_size()
    out: dict[str, Any] = {"variants": train_variants(
        TINY, MICRO_BATCH, STEPS, bucket_cap_mb=CAP_MB, **SGD)}
    opt = dict(optimizer_class=torch.optim.SGD,
               optimizer_kwargs=dict(lr=LR, momentum=MOMENTUM))
    out["defects"] = {}
    for name, make in DEFECTS.items():
        dist.barrier()
        out["defects"][name] = run_steps(
            make("bucketed", bucket_cap_mb=CAP_MB), build_gpt(TINY),
            gpt_batches(TINY, n * MICRO_BATCH), RunConfig(STEPS, **opt))
    if n == 2:
        out["no_sync"] = {v: _no_sync_step(v) for v in TEACHING_VARIANTS}
        out["unused"] = {v: _unused_parameter(v) for v in TEACHING_VARIANTS}
        out["calls"] = {v: _count_calls(v) for v in TEACHING_VARIANTS}
        out["bad_args"] = _bad_args()
        par = parallelism("naive")
        out["dp"] = (par.dp_size, par.dp_group, par.name)
    else:
        out["inits"] = {v: _wrap_different_inits(v) for v in ("naive", "overlapped")}
    return out


@pytest.fixture(scope="module")
def suite() -> Callable[[int], list[dict[str, Any]]]:
    """``suite(n)``: every rank's results of the one launch on ``n`` ranks."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(n: int) -> list[dict[str, Any]]:
        if n not in cache:
            cache[n] = launch.spawn(_suite, n, stream=False, timeout=300)
        return cache[n]
    return get


@pytest.fixture(scope="module")
def reference() -> Callable[[int], RunResult]:
    """``reference(n)``: one process on the ``n``-rank run's global batch."""
    cache: dict[int, RunResult] = {}

    def get(n: int) -> RunResult:
        if n not in cache:
            cache[n] = reference_gpt_run(TINY, n * MICRO_BATCH, STEPS, **SGD)
        return cache[n]
    return get


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_ddp_equals_one_process(variant: str, world_size: int, suite,
                                reference) -> None:
    ref = reference(world_size)
    for rank, res in enumerate(suite(world_size)):
        assert_equals_one_process(res["variants"][variant], ref, world_size,
                                  f"{variant}, rank {rank}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_tolerances_catch_planted_defects(world_size: int, suite,
                                              reference) -> None:
    ref = reference(world_size)
    rel = grad_rel(world_size)
    for rank, res in enumerate(suite(world_size)):
        defects = res["defects"]
        # A missing 1/N: every gradient N times too large, far outside the tolerance.
        assert grad_excess(defects["summed"].grads, ref.grads, rel) > 100, rank
        # ... and exactly that defect: N times the right gradient, to rounding.
        assert_all_scaled(defects["summed"].grads,
                          {k: world_size * g for k, g in ref.grads.items()}, rel,
                          "summed grad")
        # No synchronisation: this rank's rows only.
        assert grad_excess(defects["unsynced"].grads, ref.grads, rel) > 100, rank
        # A stale gradient: step 0 is right, the trajectory is not.
        assert_all_scaled(defects["stale"].grads, ref.grads, rel, "stale grad")
        err = max_diff(defects["stale"].params, ref.params)
        assert err > 100 * param_bound(world_size, ref), (rank, err)
        with pytest.raises(AssertionError):
            assert_equals_one_process(defects["stale"], ref, world_size, "stale")


def test_the_factory() -> None:
    """The agreed factory's shape: rows of rank r, one name per variant."""
    batch = (torch.arange(8).reshape(8, 1), torch.arange(8), "meta")
    rows = rows_of_rank(batch, 1, 4)
    assert rows[0].flatten().tolist() == [2, 3] and rows[1].tolist() == [2, 3]
    assert rows[2] == "meta"
    with pytest.raises(ValueError, match="world_size=3"):
        rows_of_rank(batch, 0, 3)
    assert VARIANTS == ("naive", "bucketed", "overlapped", "torch")


def test_no_sync_sends_nothing_then_averages_the_sum(suite) -> None:
    world_size = 2
    results = suite(world_size)
    # The single-process truth: sum of both micro-batch gradients, averaged over ranks.
    model = MLP((8, 16, 4))
    model.load_state_dict(results[0]["no_sync"]["naive"]["state"])
    x = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(1))
    for k in range(2):
        for rank in range(world_size):
            (model(x.view(2, world_size, 8)[k, rank:rank + 1]).pow(2).mean()
             / world_size).backward()
    truth = {n: p.grad for n, p in model.named_parameters()}
    # 4 samples summed in another order; reductions of at most 16 terms, 2 layers
    # forward and backward (4) on the path.
    rel = reorder_rel(16, 4, 4)
    for variant in TEACHING_VARIANTS:
        for res in (r["no_sync"][variant] for r in results):
            assert res["quiet_bytes"] == 0 and res["quiet_calls"] == 0
            assert res["synced_calls"] > 0
            assert_all_scaled(res["grads"], truth, rel, variant)
        # Inside no_sync the ranks really held different (local) gradients.
        local = [r["no_sync"][variant]["local"]["layers.0.weight"] for r in results]
        assert not torch.allclose(local[0], local[1])


def test_wrapping_makes_replicas_equal(suite) -> None:
    results = suite(4)
    w = "layers.0.weight"
    for variant in ("naive", "overlapped"):
        runs = [r["inits"][variant] for r in results]
        assert not torch.equal(runs[0]["before"][w], runs[1]["before"][w])
        for res in runs:
            for name, value in res["after"].items():
                torch.testing.assert_close(value, runs[0]["before"][name],
                                           rtol=0, atol=0)


def test_parameters_without_gradient(suite) -> None:
    for variant in TEACHING_VARIANTS:
        for res in (r["unused"][variant] for r in suite(2)):
            assert res["unused"] is None
            # d(sum(W x))/dW = x per output row; mean of x over ranks = (1 + 2) / 2
            # = 1.5, exact in float32 (small integers and halves).
            torch.testing.assert_close(res["used"], torch.full((2, 4), 1.5),
                                       rtol=0, atol=0)


def test_call_counts_per_variant(suite) -> None:
    for variant, (calls, n_tensors, n_buckets) in suite(2)[0]["calls"].items():
        assert calls == (n_tensors if variant == "naive" else n_buckets), variant
        assert n_buckets < n_tensors


def test_buckets_reverse_order_and_cap() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 200, 300, 50)]
    buckets = build_buckets(params, bucket_cap_mb=1200 / 2**20)  # 300 floats per bucket
    assert [[p.numel() for p in b.params] for b in buckets] == [[50], [300], [200, 100]]
    assert [b.nbytes for b in buckets] == [200, 1200, 1200]
    one = build_buckets(params, bucket_cap_mb=1.0)
    assert len(one) == 1 and one[0].params[0] is params[-1]


def test_validation(suite) -> None:
    errors = suite(2)[0]["bad_args"]
    assert len(errors) == 6
    assert "variant='fast'" in errors[0] and "bucket_cap_mb=0" in errors[1]
    assert "bucket_cap_mb=-1" in errors[2] and "variant='fast'" in errors[3]
    assert "bucket_cap_mb=0" in errors[4] and "timeline" in errors[5]
    assert suite(2)[0]["dp"] == (2, None, "ddp/naive")
    with pytest.raises(ValueError, match="process group"):
        DataParallel(MLP())  # no process group in the test process
    with pytest.raises(ValueError, match="process group"):
        parallelism("torch")


# ---- exercise checkers: each accepts the right answer and rejects wrong ones ------

# The bucket hook and the sampler checkers: tests/test_exercises_ch03_ch04.py.


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
    orders = sampling.epoch_orders(10, 2, 0, 3)
    assert orders[0] != orders[1]
