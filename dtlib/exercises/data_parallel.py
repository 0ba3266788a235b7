"""Checkers for Chapter 3, "Data parallel".

How the learner's hook reaches the ranks: a function defined in a notebook cell
cannot be imported by the processes :func:`dtlib.runtime.launch.spawn` starts (they
do not run the notebook). So the checker sends the function's *source*
(``inspect.getsource``; IPython keeps every cell's text) and each rank ``exec``s it
in a fresh namespace holding ``torch`` and ``dist``. The hook must therefore be
self-contained: no names from other cells besides ``torch`` and ``dist``.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtlib.runtime import launch
from dtlib.exercises import WrongAnswer, checker, passed

MICRO_BATCH = 2
BUCKET_CAP_MB = 0.02  # several buckets for the tiny GPT


def _rel(world_size: int, cfg: Any) -> float:
    """How far (relative to a gradient's largest element) DDP's gradient may be from
    one process's by float32 rounding alone: the ranks sum the same token
    contributions in another order. A reordered sum of ``n`` terms moves by about
    ``n * u`` of the terms' magnitudes (``u = 2**-24``); the longest reduction of the
    tiny GPT is ``4h`` terms, a gradient passes ~8 of them (4 per block,
    forward and backward, 2 blocks) and sums ``world_size * b * s`` tokens of mixed
    sign (magnitudes ~ sqrt of that times the result). A wrong hook is off by the
    gradient itself (a sum: ``world_size - 1`` times it; no reduction: a different
    half batch), hundreds of times this bound.
    """
    tokens = world_size * MICRO_BATCH * cfg.seq_len
    return 4 * cfg.hidden * 2.0 ** -24 * 8 * tokens ** 0.5


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    """``max|got - want| <= rel * max|want|``: judged on the scale of ``want``."""
    return bool((got - want).abs().max() <= rel * want.abs().max())


def _source_of(fn: Callable[..., Any]) -> tuple[str, str]:
    if not callable(fn) or not hasattr(fn, "__name__"):
        raise WrongAnswer(f"expected a function, got {type(fn).__name__}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise WrongAnswer(f"cannot read the source of {fn.__name__}: define it with "
                          "`def` in a notebook cell or a file") from None
    return source, fn.__name__


class _WatchedWork:
    """An async all-reduce's Work that notes a ``wait()`` made inside the hook."""

    def __init__(self, work: Any, notes: dict[str, int]) -> None:
        self._work, self._notes = work, notes

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self._notes["in_hook"]:
            self._notes["waits"] += 1
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _run_hook(source: str, name: str) -> Any:
    """On each rank: torch DDP on the tiny GPT with the learner's comm hook.

    Two backward passes: DDP's first puts every gradient in one bucket and then
    rebuilds its buckets in the order gradients arrived; the second (measured) pass
    runs with several buckets. Every ``dist.all_reduce`` the hook issues is watched:
    a blocking one, or a ``wait()`` inside the hook, makes the hook synchronous.
    """
    from torch.nn.parallel import DistributedDataParallel

    from dtlib.chapters.ch03_data_parallel.runs import TINY, grads_of
    from dtlib.models.gpt import build_gpt, token_batch

    namespace: dict[str, Any] = {"torch": torch, "dist": dist}
    exec(compile(source, f"<your {name}>", "exec"), namespace)
    learner_hook = namespace[name]
    notes = {"in_hook": 0, "calls": 0, "blocking": 0, "waits": 0}
    buckets: list[int] = []
    real_all_reduce = dist.all_reduce

    def watched_all_reduce(tensor, *args, **kwargs):  # noqa: ANN001, ANN202
        notes["calls"] += 1
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        work = real_all_reduce(tensor, *args, **kwargs)
        if not async_op:
            notes["blocking"] += 1
            return work
        return _WatchedWork(work, notes)

    # No annotations: DDP rejects a hook whose annotations are not GradBucket/Future.
    def counting_hook(state, bucket):  # noqa: ANN001, ANN202
        buckets.append(bucket.buffer().numel())
        notes["in_hook"] += 1
        try:
            return learner_hook(state, bucket)
        finally:
            notes["in_hook"] -= 1

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(build_gpt(TINY), bucket_cap_mb=BUCKET_CAP_MB)
    model.register_comm_hook(None, counting_hook)
    idx, targets = token_batch(TINY, world_size * MICRO_BATCH, seed=0)
    rows = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    local = build_gpt(TINY)
    local(idx[rows], targets[rows])[1].backward()
    dist.all_reduce = watched_all_reduce
    try:
        model(idx[rows], targets[rows])[1].backward()  # DDP rebuilds its buckets
        model.zero_grad(set_to_none=True)
        buckets.clear()
        notes.update(calls=0, blocking=0, waits=0)
        model(idx[rows], targets[rows])[1].backward()
    finally:
        dist.all_reduce = real_all_reduce
    return {"grads": grads_of(model.module), "local": grads_of(local),
            "calls": notes["calls"], "buckets": len(buckets),
            "blocking": notes["blocking"], "waits": notes["waits"]}


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for _, g in sorted(grads.items())])


@checker
def check_bucket_hook(hook: Callable[..., Any], world_size: int = 2) -> None:
    """Check a DDP comm hook ``hook(process_group, bucket) -> Future[Tensor]``.

    It runs as torch DDP's gradient hook on ``world_size`` real ranks over several
    buckets; the gradients must equal one process's on the whole batch, with one
    asynchronous all-reduce per bucket (the hook returns before it completes).
    """
    from dtlib.chapters.ch03_data_parallel.runs import TINY, reference_training

    source, name = _source_of(hook)
    try:
        results = launch.spawn(_run_hook, world_size, source, name, stream=False,
                               timeout=60)
    except launch.LaunchError as exc:
        raise WrongAnswer(f"your hook failed on a rank:\n{exc}\nHint: return a "
                          "torch.futures.Future whose value is the bucket's tensor, "
                          "e.g. dist.all_reduce(..., async_op=True).get_future()"
                          ".then(...)") from None
    truth = _flat(reference_training(TINY, world_size * MICRO_BATCH, 1)["grads"])
    rel = _rel(world_size, TINY)
    for rank, res in enumerate(results):
        got, local = _flat(res["grads"]), _flat(res["local"])
        if res["blocking"] or res["waits"]:
            raise WrongAnswer(
                f"rank {rank}: your hook waits for its all-reduce ("
                + ("a blocking dist.all_reduce" if res["blocking"] else "work.wait()")
                + " inside the hook), so backward stops at every bucket until the "
                "bucket has crossed the network: nothing overlaps.",
                "issue the all-reduce with async_op=True and return the future "
                "right away (work.get_future(), with .then(...) for what follows); "
                "DDP waits on it once, at the end of backward ('Seeing the overlap').")
        if res["calls"] != res["buckets"]:
            raise WrongAnswer(
                f"rank {rank}: {res['calls']} all-reduce calls for {res['buckets']} "
                "buckets. Hint: one dist.all_reduce of bucket.buffer() per hook call.")
        if _close(got, truth * world_size, rel):
            raise WrongAnswer("the gradients are world_size times too large: the "
                              "all-reduce sums. Hint: divide the buffer by "
                              "dist.get_world_size(group) (before or after).")
        if _close(got, local, rel):
            raise WrongAnswer("each rank kept its own gradient: the bucket was not "
                              "all-reduced, or the future does not return the reduced "
                              "buffer.")
        if not _close(got, truth, rel):
            err = (got - truth).abs().max().item()
            raise WrongAnswer(f"rank {rank}: gradients differ from one process's by up "
                              f"to {err:.3g}. Hint: the future's value must be the "
                              "averaged bucket.buffer().")
    if results[0]["buckets"] < 2:
        raise AssertionError("the check ran with one bucket: lower BUCKET_CAP_MB")
    passed(f"your hook averaged each of {results[0]['buckets']} buckets with one "
           f"asynchronous all-reduce; the gradients equal one process's on "
           f"{world_size} ranks")


@checker
def check_epoch_orders(epoch_orders: Callable[[int, int, int, int], list[list[int]]]
                       ) -> None:
    """Check ``epoch_orders(dataset_len, world_size, rank, epochs)``: the indices a
    rank's DistributedSampler (shuffle=True, seed=0) yields in each epoch, for a
    correct training loop."""
    from dtlib.data_parallel import sampling

    dataset_len, world_size, epochs = 12, 2, 3
    answers = []
    for rank in range(world_size):
        got = epoch_orders(dataset_len, world_size, rank, epochs)
        try:
            got = [list(map(int, order)) for order in got]
        except TypeError:
            raise WrongAnswer("return a list (one per epoch) of lists of indices") \
                from None
        if len(got) != epochs:
            raise WrongAnswer(f"rank {rank}: {len(got)} epochs returned, expected "
                              f"{epochs}")
        if all(order == got[0] for order in got):
            raise WrongAnswer(
                f"rank {rank} reads the same order every epoch: {got[0]}. "
                "DistributedSampler shuffles with the generator seed + epoch, and its "
                "epoch stays 0 unless you call sampler.set_epoch(epoch) at the start "
                "of every epoch.")
        answers.append(got)
    for epoch in range(epochs):
        seen = [i for rank in range(world_size) for i in answers[rank][epoch]]
        if sorted(seen) != list(range(dataset_len)):
            raise WrongAnswer(
                f"epoch {epoch}: the ranks together read {sorted(seen)}, not every "
                "sample once. Hint: pass num_replicas=world_size and rank=rank.")
    expected = [sampling.epoch_orders(dataset_len, world_size, r, epochs)
                for r in range(world_size)]
    if answers != expected:
        raise WrongAnswer("the orders change each epoch but are not "
                          "DistributedSampler's (shuffle=True, seed=0, "
                          "set_epoch(epoch)). Hint: create one "
                          "sampler and call set_epoch(epoch) before each pass.")
    passed("a new order every epoch, every sample once per epoch across the ranks")
