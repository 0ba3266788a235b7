"""Chapter 15: gradient compression as a DDP communication hook, proven.

One launch per world size (2 and 4 gloo ranks) trains Chapter 3's tiny GPT with SGD
with momentum through the one loop in every configuration below; the tests compare.

- Ours is torch's: ``powersgd_hook`` on torch DDP and torch's own ``powerSGD_hook``
  with the same rank, schedule, seed and ``min_compression_rate`` train the same
  model bit for bit (Gram-Schmidt at r = 1, QR with every vector compressed at
  r = 4; warm start and error feedback on). So do the 16-bit hooks and torch's
  ``bf16_compress_hook``/``fp16_compress_hook``.
- One hook, two DDPs: ours on Chapter 3's DataParallel (bucketed, overlapped) is
  ours on torch DDP, bit for bit, when the buckets are the same (one parameter
  each; ``find_unused_parameters=True`` keeps torch's from being regrouped after
  step 1, so step 1's all-reduces cut the same buffers too: with 4 ranks another
  cut sums in another order).
- At full rank PowerSGD is the average (tolerance derived in :func:`full_rank_rel`);
  at rank 1 it is not (the proof is not vacuous).
- Bytes: what the one observer (``count_comms``) sees per bucket is
  ``powersgd_elements``: the uncompressed tensors, ``sum n r`` and ``sum m r``.
- 16-bit: the average within the dtype's rounding bound (:func:`low_precision_bound`),
  half the bytes.
- A run stopped after step 3 and resumed from saved model, optimizer and PowerSGD
  state (through ``torch.save``/``torch.load(weights_only=True)``) is the same run,
  bit for bit, on Chapter 3's DDP with warm start and without (a fresh seed per
  step: the generator's state travels too), and on torch DDP (buckets settled
  before the hook is registered).
"""

import io
import math
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel

from dtlib.chapters.ch03_data_parallel.runs import TINY
from dtlib.collectives.accounting import CountComms
from dtlib.data_parallel import DataParallel, DataParallelism
from dtlib.data_parallel.parallelism import settle_ddp_buckets
from dtlib.low_comm import (LowPrecisionState, PowerSGDState, low_precision_hook,
                            powersgd_bytes, powersgd_elements, powersgd_hook)
from dtlib.models.gpt import build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.run import RunConfig, RunResult, TrainState, run_steps
from dtlib.runtime import launch

STEPS, START, MICRO_BATCH, CAP_MB = 5, 2, 2, 0.02
SGD = {"lr": 0.05, "momentum": 0.9}
ONE_EACH = 1e-6  # MiB: every parameter its own bucket
U32 = 2.0 ** -24
#: (DDP, warm start) of the resumed runs: without warm start a new seed is drawn
#: every step, so the generator's state must travel too.
RESUMES = (("overlapped", True), ("overlapped", False), ("torch", True))


def _config(steps: int = STEPS, start: int = 0, **kw: Any) -> RunConfig:
    return RunConfig(steps, start=start, optimizer_class=torch.optim.SGD,
                     optimizer_kwargs=SGD, **kw)


def _batches() -> Callable[[int], Any]:
    return gpt_batches(TINY, MICRO_BATCH * dist.get_world_size())


def _train(variant: str, hook: Any = None, state: Any = None, cap: float = 25.0,
           steps: int = STEPS, callbacks: tuple = ()) -> RunResult:
    par = DataParallelism(variant, bucket_cap_mb=cap, comm_hook=hook,
                          comm_state=state)
    return run_steps(par, build_gpt(TINY, seed=0), _batches(), _config(steps),
                     callbacks=callbacks)


def _same(a: RunResult, b: RunResult) -> bool:
    return a.losses == b.losses and a.params.keys() == b.params.keys() and all(
        torch.equal(a.params[k], b.params[k]) for k in a.params)


# torch refuses hooks *named* bf16_compress_hook on CPU (it asks for NCCL); gloo
# sums bfloat16 fine, so torch's own function is called under another name.
def torch_bf16(group: Any, bucket: dist.GradBucket
               ) -> torch.futures.Future[torch.Tensor]:
    return default_hooks.bf16_compress_hook(group, bucket)


def torch_fp16(group: Any, bucket: dist.GradBucket
               ) -> torch.futures.Future[torch.Tensor]:
    return default_hooks.fp16_compress_hook(group, bucket)


class Checked:
    """A hook around a hook: before it runs, the exact average of the bucket and
    the mean of its magnitudes (float64 all-reduces); after, what it returned.
    Records every step from ``start`` on, per gradient: ``(shape, got, exact,
    magnitudes)``."""

    def __init__(self, hook: Callable, start: int = 0) -> None:
        self.hook, self.start, self.steps, self.records = hook, start, 0, []

    def __call__(self, state: Any, bucket: dist.GradBucket
                 ) -> torch.futures.Future[torch.Tensor]:
        n = dist.get_world_size()
        local = bucket.buffer().double()
        exact, mags = local.clone(), local.abs()
        dist.all_reduce(exact)
        dist.all_reduce(mags)
        got = self.hook(state, bucket).wait()
        if self.steps >= self.start:
            sizes = [g.numel() for g in bucket.gradients()]
            for g, *parts in zip(bucket.gradients(), *(t.split(sizes) for t in (
                    got.double(), exact / n, mags / n))):
                self.records.append((tuple(g.shape), *parts))
        self.steps += bucket.is_last()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(got)
        return fut


def _ddp_one_each(hook: Callable, state: Any) -> RunResult:
    model = DistributedDataParallel(build_gpt(TINY, seed=0), bucket_cap_mb=ONE_EACH,
                                    find_unused_parameters=True)
    model.register_comm_hook(state, hook)
    return run_steps(DataParallelism("torch"), None, _batches(), _config(),
                     TrainState(wrapped=model))


def _bytes(counted: CountComms) -> list[int]:
    return [r.bytes for r in counted.log.records if r.op == "all_reduce"]


def _resumed(variant: str, warm_start: bool, stop: int, steps: int
             ) -> dict[str, Any]:
    """The whole run, and the run stopped after ``stop`` and resumed. Under torch
    DDP the buckets are settled (regrouped) before the hook is registered, in both
    runs: a fresh DDP's first backward would otherwise use its initial buckets,
    which PowerSGD's memory does not fit."""
    def run(start: int, end: int, saved: bytes | None = None):
        state = PowerSGDState(2, start_iter=START, warm_start=warm_start)
        par = DataParallelism(variant, bucket_cap_mb=CAP_MB)
        wrapped = par.apply(build_gpt(TINY, seed=0))
        if variant == "torch":
            settle_ddp_buckets(wrapped, par.local_batch(_batches()(0))[0])
        wrapped.register_comm_hook(state, powersgd_hook)
        opt = torch.optim.SGD(wrapped.parameters(), **SGD)
        if saved is not None:  # what a checkpoint restores
            ckpt = torch.load(io.BytesIO(saved), weights_only=True)
            wrapped.module.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            state.load_state_dict(ckpt["powersgd"])
        res = run_steps(par, None, _batches(), _config(end, start),
                        TrainState(wrapped=wrapped, optimizer=opt))
        buf = io.BytesIO()
        torch.save({"model": wrapped.module.state_dict(),
                    "optimizer": opt.state_dict(), "powersgd": state.state_dict()},
                   buf)
        return res, buf.getvalue()

    whole, _ = run(0, steps)
    _, saved = run(0, stop)
    resumed, _ = run(stop, steps, saved)
    return {"whole": whole, "resumed": resumed}


def _suite() -> dict[str, Any]:
    out: dict[str, Any] = {"plain": _train("torch")}
    # ours and torch's on torch DDP (one bucket: torch's hook chains its all-reduces
    # in callbacks, which may interleave with the next bucket's elsewhere)
    for r, rate in ((1, 2.0), (4, 0.0)):
        ours = PowerSGDState(r, start_iter=START, min_compression_rate=rate)
        theirs = torch_psgd.PowerSGDState(None, matrix_approximation_rank=r,
                                          start_powerSGD_iter=START,
                                          min_compression_rate=rate, random_seed=0)
        out[f"ours r={r}"] = _train("torch", powersgd_hook, ours)
        out[f"torch r={r}"] = _train("torch", torch_psgd.powerSGD_hook, theirs)
    for dtype, theirs in ((torch.bfloat16, torch_bf16), (torch.float16, torch_fp16)):
        out[f"ours {dtype}"] = _train("torch", low_precision_hook,
                                      LowPrecisionState(dtype))
        out[f"torch {dtype}"] = _train("torch", theirs, None)
    # one hook, two DDPs, the same buckets
    out["ddp one each"] = _ddp_one_each(powersgd_hook, PowerSGDState(2, START))
    for v in ("bucketed", "overlapped"):
        out[f"{v} one each"] = _train(v, powersgd_hook, PowerSGDState(2, START),
                                      cap=ONE_EACH)
    # full rank (every tensor compressed, r >= min(n, m)) and rank 1
    for r in (max(TINY.hidden, TINY.vocab_size) * 4, 1):
        check = Checked(powersgd_hook, start=START)
        _train("bucketed", check, PowerSGDState(
            r, START, min_compression_rate=0, error_feedback=False), cap=CAP_MB,
            steps=START + 2)
        out[f"records r={r}"] = check.records
    # bytes on the wire, counted: a plain step and a compressed one
    counted = CountComms(1), CountComms(START + 1)
    par = DataParallelism("bucketed", bucket_cap_mb=CAP_MB, comm_hook=powersgd_hook,
                          comm_state=PowerSGDState(2, START))
    wrapped = par.apply(build_gpt(TINY, seed=0))
    run_steps(par, None, _batches(), _config(START + 1), TrainState(wrapped=wrapped),
              counted)
    out["bucket shapes"] = [[tuple(p.shape) for p in b.params]
                            for b in wrapped.buckets]
    out["plain bytes"], out["powersgd bytes"] = map(_bytes, counted)
    for dtype in (torch.bfloat16, torch.float16):
        check, counted16 = Checked(low_precision_hook), CountComms(2)
        _train("overlapped", check, LowPrecisionState(dtype), cap=CAP_MB, steps=2)
        _train("overlapped", low_precision_hook, LowPrecisionState(dtype),
               cap=CAP_MB, steps=2, callbacks=(counted16,))
        out[f"records {dtype}"], out[f"bytes {dtype}"] = check.records, \
            _bytes(counted16)
    for variant, warm in RESUMES:
        out[f"resume {variant} warm={warm}"] = _resumed(variant, warm, 3, STEPS + 1)
    if dist.get_world_size() == 2:
        out["refusals"] = _refusals()
    return out


def _refusals() -> list[str]:
    """Each refusal's ``"Type: message"``."""
    errors = []
    twice = DataParallel(build_gpt(TINY), variant="bucketed")
    twice.register_comm_hook(None, low_precision_hook)
    moved = PowerSGDState(2, START)  # memory of buckets that are not these
    moved.load_state_dict({**moved.state_dict(), "iteration": START,
                           "errors": {"0": torch.zeros(3)}})
    regrouped = DataParallel(build_gpt(TINY), variant="bucketed")
    regrouped.register_comm_hook(moved, powersgd_hook)
    for make in (lambda: DataParallel(build_gpt(TINY)).register_comm_hook(
                     None, low_precision_hook),
                 lambda: twice.register_comm_hook(None, low_precision_hook),
                 lambda: DataParallelism("naive", comm_hook=low_precision_hook),
                 lambda: regrouped(*_batches()(0))[1].backward()):
        try:
            make()
        except (ValueError, RuntimeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def runs(request) -> tuple[int, dict[str, Any]]:
    n = request.param
    return n, launch.spawn(_suite, n, stream=False, timeout=240)[0]


# ---- ours is torch's ----------------------------------------------------------------

@pytest.mark.parametrize("r", [1, 4])
def test_ours_on_torch_ddp_is_torchs_powersgd_bit_for_bit(runs, r) -> None:
    _, out = runs
    assert _same(out[f"ours r={r}"], out[f"torch r={r}"])
    # not vacuous: both compressed (plain DDP trains another model)
    assert not _same(out[f"ours r={r}"], out["plain"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ours_16_bit_hook_is_torchs_bit_for_bit(runs, dtype) -> None:
    _, out = runs
    assert _same(out[f"ours {dtype}"], out[f"torch {dtype}"])
    assert not _same(out[f"ours {dtype}"], out["plain"])


@pytest.mark.parametrize("variant", ["bucketed", "overlapped"])
def test_one_hook_gives_the_same_run_on_both_ddps(runs, variant) -> None:
    _, out = runs
    assert _same(out[f"{variant} one each"], out["ddp one each"])


# ---- full rank is the average --------------------------------------------------------

def full_rank_rel(n: int, m: int, world_size: int) -> float:
    """How far PowerSGD at full rank can be from the exact average, in Frobenius
    norm, relative to ``||A||_F``, ``A = mean_i |M_i|`` (the magnitudes: the ranks'
    gradients cancel, so their sum's rounding scales with A, not with the mean).

    With ``r = min(n, m)``, exact arithmetic gives the average: ``P = sum_i M_i Q``
    spans the columns of the mean ``M`` (Q is square orthogonal when ``r = m``;
    when ``r = n``, P's orthonormal basis is a square orthogonal matrix), so
    ``P P^T M = M`` and the output ``P (M^T P)^T`` is ``M``. Rounding (``u =
    2^-24``; a sum of ``K`` terms is within ``K u`` of its terms' magnitudes,
    Higham §3.1; Householder QR of a ``k x r`` matrix is the exact QR of one within
    ``k r u`` columnwise, its Q within ``sqrt(r) k r u`` of orthonormal, Higham
    Thm 19.4, with the constant taken as 1), with ``k = max(n, m)``:

    - ``P``: ``m`` products, then ``N`` ranks summed: ``(k + N) sqrt(r) u`` (the
      sqrt(r) is ``|| |Q| ||_2 <= ||Q||_F``);
    - its span, through the QR's backward error: ``k r u``; Q's and P's distance
      from orthonormal (each moves the projection by twice it): ``4 sqrt(r) k r u``;
    - ``Q = mean_i M_i^T P``: ``(k + N) sqrt(r) u``; the product ``P Q^T``: ``r
      sqrt(r) u``.

    Summed: ``u (sqrt(r) (2 (k + N) + r + 4 k r) + k r)``: 0.05% to 0.6% for
    the tiny GPT's matrices: a worst case, far above what rounding does, far below
    what any mistake does (a missing 1/N: 50% or more; rank 1: tested below).
    """
    k, r = max(n, m), min(n, m)
    return U32 * (math.sqrt(r) * (2 * (k + world_size) + r + 4 * k * r) + k * r)


def _fro_excess(records: list, world_size: int) -> list[tuple[tuple, float]]:
    """Per compressed gradient: ``||got - exact||_F / (rel ||A||_F)``."""
    out = []
    for shape, got, exact, mags in records:
        n = shape[0] if shape else 1
        m = max(1, got.numel() // n)
        err = torch.linalg.vector_norm(got - exact).item()
        bound = full_rank_rel(n, m, world_size) * torch.linalg.vector_norm(mags).item()
        out.append((shape, err / bound))
    return out


def test_full_rank_powersgd_is_the_average(runs) -> None:
    n, out = runs
    excess = _fro_excess(out[f"records r={max(TINY.hidden, TINY.vocab_size) * 4}"], n)
    assert len(excess) == 2 * sum(1 for _ in build_gpt(TINY).parameters())
    worst = max(excess, key=lambda e: e[1])
    assert worst[1] <= 1.0, f"{worst[0]}: {worst[1]:.2f} times the bound"
    # not vacuous: at rank 1 the matrices' approximations miss by far more
    low = [e for s, e in _fro_excess(out["records r=1"], n) if len(s) == 2]
    assert low and min(low) > 10


# ---- bytes ---------------------------------------------------------------------------

def test_bytes_per_step_are_the_formula(runs) -> None:
    _, out = runs
    shapes = out["bucket shapes"]
    assert out["plain bytes"] == [4 * sum(math.prod(s) for s in b) for b in shapes]
    expected = [4 * e for b in shapes for e in powersgd_elements(b, 2) if e]
    assert out["powersgd bytes"] == expected
    assert sum(expected) == powersgd_bytes(shapes, 2)
    assert sum(expected) < sum(out["plain bytes"]) / 2  # r = 2 on 32-wide matrices


# ---- 16-bit --------------------------------------------------------------------------

def low_precision_bound(dtype: torch.dtype, world_size: int, mags: torch.Tensor
                        ) -> torch.Tensor:
    """Elementwise bound of the 16-bit average against the exact one.

    Each rank's value is rounded to 16 bits (``u_h |x| + eta``: ``u_h`` half the
    dtype's eps, ``eta`` half its subnormal spacing), divided by ``N`` (one more
    rounding), and the ``N`` values summed in 16 bits (``N - 1`` roundings of a
    partial sum at most the magnitudes' sum); the cast back to float32 is exact.
    First order: ``(N + 1) u_h A + 2 N eta`` with ``A = mean_i |x_i|``; ``N + 2``
    covers the second-order terms.
    """
    info = torch.finfo(dtype)
    u_h, eta = info.eps / 2, info.smallest_normal * info.eps / 2
    return (world_size + 2) * u_h * mags + 2 * world_size * eta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_average_is_within_its_rounding_and_sends_half(runs, dtype) -> None:
    n, out = runs
    records = out[f"records {dtype}"]
    for shape, got, exact, mags in records:
        err = (got - exact).abs()
        assert (err <= low_precision_bound(dtype, n, mags)).all(), shape
    # not vacuous: some element is off by more than float32 could be
    assert any(((got - exact).abs() > (n + 2) * U32 * mags).any()
               for _, got, exact, mags in records)
    n_params = sum(p.numel() for p in build_gpt(TINY).parameters())
    assert sum(out[f"bytes {dtype}"]) == 2 * n_params  # float32's: 4 per element


# ---- resume --------------------------------------------------------------------------

@pytest.mark.parametrize("variant,warm", RESUMES)
def test_a_resumed_compressed_run_is_the_same_run(runs, variant, warm) -> None:
    _, out = runs
    r = out[f"resume {variant} warm={warm}"]
    assert r["whole"].losses[3:] == r["resumed"].losses
    for k, q in r["whole"].params.items():
        assert torch.equal(q, r["resumed"].params[k]), k


# ---- refusals ------------------------------------------------------------------------

def test_bad_arguments_name_the_argument(runs) -> None:
    n, out = runs
    if n == 2:
        naive, twice, naive_par, regrouped = out["refusals"]
        assert naive.startswith("ValueError") and "variant='naive'" in naive
        assert naive_par.startswith("ValueError") and "variant='naive'" in naive_par
        assert twice.startswith("ValueError") and "already registered" in twice
        assert regrouped.startswith("RuntimeError") and "buckets changed" in regrouped
    cases = [(dict(matrix_rank=0), "matrix_rank=0"),
             (dict(matrix_rank=2.0), "matrix_rank=2.0"),
             (dict(start_iter=1), "start_iter=1"),
             (dict(start_iter=-1, warm_start=False, error_feedback=False),
              "start_iter=-1"),
             (dict(min_compression_rate=-1), "min_compression_rate=-1"),
             (dict(warm_start=1), "warm_start=1"),
             (dict(seed=-3), "seed=-3")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            PowerSGDState(**kwargs)
    PowerSGDState(1, start_iter=0, warm_start=False, error_feedback=False)  # allowed
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        LowPrecisionState(torch.float32)
    with pytest.raises(ValueError, match="matrix_rank=2"):
        PowerSGDState(2, 2).load_state_dict(PowerSGDState(1, 2).state_dict())
