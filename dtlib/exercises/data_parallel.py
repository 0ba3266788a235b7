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
import random
import textwrap
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtlib.collectives.accounting import count_comms
from dtlib.data_parallel import sampling
from dtlib.exercises import WrongAnswer, checker, passed
from dtlib.exercises.tripwires import guarded
from dtlib.models.gpt import build_gpt, token_batch
from dtlib.models.reference import grads_of, reference_gpt_run
from dtlib.models.sizes import size
from dtlib.runtime import diagnose, launch
from dtlib.runtime.i18n import N_, _

#: the book's tiny GPT, the one chapter 3's runs train
TINY = size("tiny")

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
        raise WrongAnswer(_("expected a function, got {type}").format(
                              type=type(fn).__name__))
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise WrongAnswer(_("cannot read the source of {name}: define it with `def` "
                            "in a notebook cell or a file").format(
                                name=fn.__name__)) from None
    return source, fn.__name__


# How long a hook may stay inside after issuing its all-reduce before it counts as
# waiting on it. Between the call and `return` a right hook runs a few Python
# statements (microseconds); a wrong one waits for a collective whose future, here,
# cannot complete before the hook returns (see _ddp_with_hook). Two seconds is five
# orders of magnitude above the first, so an overloaded machine does not turn a right
# hook into a wrong one; a wrong one costs these seconds once per rank, not per bucket.
STALL_S = 2.0


def _ddp_with_hook(source: str, name: str, group: Any, replica: int, index: int
                   ) -> dict[str, Any]:
    """On one rank: torch DDP on the tiny GPT with the learner's comm hook, over the
    process group ``group`` (replica group number ``replica``, this rank its
    ``index``-th member; each replica group trains its own model on its own rows, so
    a hook that reduces over another group than the one DDP hands it is wrong).

    Two backward passes: DDP's first puts every gradient in one bucket and then
    rebuilds its buckets in the order gradients arrived; the second (measured) pass
    runs with several buckets. The one recorder (:func:`count_comms`) sees every
    collective the hook issues, however it is spelled, and every ``wait()`` on its
    work (a blocking call is an issue and a wait). The future of a collective issued
    inside the hook is held until the hook returns, so a hook that waits on the future
    (``fut.wait()``, ``torch.futures.wait_all``, a polling loop) is still inside when
    :data:`STALL_S` have passed, and is noted; ``fut.value()`` read too early raises,
    as it may on any backend.
    """
    from torch.nn.parallel import DistributedDataParallel

    namespace: dict[str, Any] = {"torch": torch, "dist": dist}
    exec(compile(source, f"<your {name}>", "exec"), namespace)
    learner_hook = guarded(namespace[name], _BUCKET_HOOK_FORBIDS)
    notes: dict[str, Any] = {"in_hook": 0, "issued": [], "waits": 0, "stalled": 0,
                             "gates": [], "error": None}
    buckets: list[int] = []
    lock = threading.Lock()

    def open_gate(gate: Any) -> None:
        with lock:
            if not gate.done():
                gate.set_result(None)

    def stalled(gate: Any) -> None:
        if notes["in_hook"] and not gate.done():
            notes["stalled"] += 1
        open_gate(gate)

    def future_gate(rec: Any) -> Any:
        if not notes["in_hook"]:
            return None
        notes["issued"].append(rec)
        if notes["stalled"]:  # already known to wait: no second stall to sit out
            return None
        gate = torch.futures.Future()
        timer = threading.Timer(STALL_S, stalled, (gate,))
        timer.daemon = True
        timer.start()
        notes["gates"].append((gate, timer))
        return gate

    # No annotations: DDP rejects a hook whose annotations are not GradBucket/Future.
    def counting_hook(state, bucket):  # noqa: ANN001, ANN202
        buckets.append(bucket.buffer().numel())
        notes["in_hook"] += 1
        events_before = len(log.events)
        try:
            return learner_hook(state, bucket)
        except Exception as exc:  # reported by the checker, the backward goes on
            notes["error"] = notes["error"] or f"{type(exc).__name__}: {exc}"
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        finally:
            notes["in_hook"] -= 1
            notes["waits"] += sum(kind == "wait"
                                  for kind, _ in log.events[events_before:])
            for gate, timer in notes["gates"]:
                timer.cancel()
                open_gate(gate)
            notes["gates"].clear()

    model = DistributedDataParallel(build_gpt(TINY, seed=replica),
                                    bucket_cap_mb=BUCKET_CAP_MB, process_group=group)
    model.register_comm_hook(group, counting_hook)
    idx, targets = token_batch(TINY, dist.get_world_size(group) * MICRO_BATCH, seed=0)
    rows = slice(index * MICRO_BATCH, (index + 1) * MICRO_BATCH)
    with count_comms(future_gate=future_gate) as log:
        model(idx[rows], targets[rows])[1].backward()  # DDP rebuilds its buckets
    model.zero_grad(set_to_none=True)
    buckets.clear()
    notes.update(issued=[], waits=0)
    with count_comms(future_gate=future_gate) as log:
        model(idx[rows], targets[rows])[1].backward()
    issued = notes["issued"]
    return {"grads": grads_of(model.module),
            "calls": sum(r.op == "all_reduce" for r in issued),
            "other_ops": sorted({r.op for r in issued} - {"all_reduce"}),
            "buckets": len(buckets), "waits": notes["waits"],
            "stalled": notes["stalled"], "error": notes["error"]}


def replica_groups(world_size: int) -> list[list[int]]:
    """The replica groups the hook checker runs DDP in: the whole world up to 3
    ranks; from 4 on, all ranks but the last, and the last alone. Groups of unequal
    size: a hook that reduces over the world, or divides by the world's size or by a
    constant, is wrong in at least one of them."""
    ranks = list(range(world_size))
    return [ranks] if world_size < 4 else [ranks[:-1], ranks[-1:]]


def _run_hooks(hooks: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """On each rank: every hook in turn, each in a DDP of its own over this rank's
    replica group (:func:`replica_groups`), beside this rank's own gradient without
    DDP (what a hook that does not reduce would leave)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lines = replica_groups(world_size)
    groups = [dist.new_group(line) for line in lines] if len(lines) > 1 \
        else [dist.group.WORLD]  # new_group: every rank calls it for every group
    replica = next(g for g, line in enumerate(lines) if rank in line)
    per, index = len(lines[replica]), lines[replica].index(rank)
    idx, targets = token_batch(TINY, per * MICRO_BATCH, seed=0)
    rows = slice(index * MICRO_BATCH, (index + 1) * MICRO_BATCH)
    local = build_gpt(TINY, seed=replica)
    local(idx[rows], targets[rows])[1].backward()
    own = grads_of(local)  # one object: sent once, however many hooks
    return [{**_ddp_with_hook(source, name, groups[replica], replica, index),
             "local": own, "replica": replica} for source, name in hooks]


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for _, g in sorted(grads.items())])


_ASYNC_HINT = N_("issue the all-reduce with async_op=True and return the future right "
               "away (work.get_future(), with .then(...) for what follows); DDP waits "
               "on it once, at the end of backward ('Seeing the overlap').")


def _judge(res: dict[str, Any], rank: int, world_size: int,
           truths: list[torch.Tensor]) -> WrongAnswer | None:
    """What is wrong with one rank's run of a hook, or None (``truths``: one
    process's gradient for each replica group)."""
    lines = replica_groups(world_size)
    truth, line = truths[res["replica"]], lines[res["replica"]]
    per = len(line)
    where = _("on {world_size} ranks, rank {rank}").format(
                world_size=world_size, rank=rank) + (
        _(" (DDP over ranks {line}, one of the replica groups {lines})").format(
            line=line, lines=lines)
        if len(lines) > 1 else "")
    if res["error"] is not None:
        if "completed()" in res["error"]:
            return WrongAnswer(
                _("{where}: your hook reads the future's value before the all-reduce "
                  "has completed (fut.value() inside the hook).").format(where=where),
                _("read the value inside a callback, fut.then(lambda f: "
                  "f.value()[0]), which runs once the all-reduce is done"))
        return WrongAnswer(_("{where}: your hook raised {res_error}").format(
                               where=where, res_error=res['error']),
                           _("return a torch.futures.Future whose value is the "
                             "bucket's tensor, e.g. dist.all_reduce(..., "
                             "async_op=True).get_future().then(...)"))
    how = (_("a blocking all-reduce, or a wait() on its work") if res["waits"] else
           _("a wait on its future") if res["stalled"] else None)
    if how is not None:
        return WrongAnswer(
            _("{where}: your hook waits for its all-reduce ({how} inside the hook), "
              "so backward stops at every bucket until the bucket has crossed the "
              "network: nothing overlaps.").format(where=where, how=how),
            _(_ASYNC_HINT))
    if res["other_ops"]:
        return WrongAnswer(
            _("{where}: your hook also ran {join}: the exercise asks for one "
              "all-reduce per bucket and nothing else.").format(
                where=where, join=', '.join(res['other_ops'])),
            _("one dist.all_reduce of bucket.buffer() per hook call."))
    if res["calls"] != res["buckets"]:
        return WrongAnswer(
            _("{where}: {res_calls} all-reduce calls for {res_buckets} "
              "buckets.").format(
                where=where, res_calls=res['calls'], res_buckets=res['buckets']), _(
                        "one dist.all_reduce of bucket.buffer() per hook call."))
    got, local = _flat(res["grads"]), _flat(res["local"])
    rel = _rel(world_size, TINY)
    if _close(got, truth, rel):  # right (in a group of one, even a hook that sums)
        return None
    # over the world: its average, or each group's own average summed
    world = (sum(t * len(g) for t, g in zip(truths, lines)) / world_size, sum(truths))
    if len(truths) > 1 and any(_close(got, w, rel) for w in world):
        return WrongAnswer(_("{where}: your hook averaged over every rank of the "
                             "world, not over the group DDP gave it.").format(
                               where=where),
                           _("reduce over the hook's first argument: "
                             "dist.all_reduce(..., group=group), and divide by "
                             "dist.get_world_size(group)"))
    if _close(got, truth * per, rel):
        return WrongAnswer(_("{where}: the gradients are {per} times too large (the "
                             "number of ranks in the hook's group): the all-reduce "
                             "sums.").format(where=where, per=per),
                           _("divide the buffer by dist.get_world_size(group) (before "
                             "or after)."))
    if _close(got, local, rel):
        return WrongAnswer(_("{where}: each rank kept its own gradient: the bucket "
                             "was not all-reduced, or the future does not return the "
                             "reduced buffer.").format(where=where))
    # The average times a constant: a divisor that is not this world's size.
    scale = float(got @ truth / (truth @ truth))
    if _close(got, scale * truth, rel):
        return WrongAnswer(
            _("{where}: the gradients are {scale:.3g} times the average: the sum was "
              "divided by {value:.3g}, not by the number of ranks in the hook's group "
              "({per}).").format(where=where, scale=scale, value=per / scale, per=per),
            _("divide by dist.get_world_size(group): the size of the group DDP hands "
              "the hook, never a constant or the world's size"))
    err = (got - truth).abs().max().item()
    return WrongAnswer(_("{where}: gradients differ from one process's by up to "
                         "{err:.3g}.").format(where=where, err=err), _(
                                 "the future's value must be the averaged "
                                 "bucket.buffer()."))




def hook_verdicts(hooks: list[Callable[..., Any]], world_sizes: tuple[int, ...] = (2, 4)
                  ) -> list[WrongAnswer | None]:
    """Run DDP comm hooks on real ranks and judge each: one launch per world size.

    Every hook runs as torch DDP's gradient hook, over several buckets, in one launch
    of each world size (a hook already wrong on a smaller world is not run on the
    next). On every rank its gradients must equal one process's on the whole batch,
    with one asynchronous all-reduce per bucket that the hook does not wait for.

    Args:
        hooks: functions ``hook(process_group, bucket) -> torch.futures.Future``.
        world_sizes: the worlds to run, smallest first (each needs its ranks).
    Returns:
        For each hook, None if it is right on every world, else the
        :class:`WrongAnswer` of the first rank it is wrong on.

    Taught in: Chapter 3, "Exercises" (the bucketed gradient hook).
    """
    if not world_sizes or any(not isinstance(n, int) or n < 2 for n in world_sizes):
        raise ValueError(f"world_sizes={world_sizes!r}: give integers >= 2 (a hook "
                         "needs peers to average with)")
    sources = [_source_of(hook) for hook in hooks]
    for source, name in sources:  # a hang report shows the hook's own lines
        diagnose.remember_source(f"<your {name}>", source)
    verdicts: list[WrongAnswer | None] = [None] * len(hooks)
    for world_size in world_sizes:
        todo = [i for i, v in enumerate(verdicts) if v is None]
        if not todo:
            break
        lines = replica_groups(world_size)
        try:
            # 60 s as for one hook, plus per further hook one DDP build and two
            # backward passes of the tiny GPT (a second or two on a loaded laptop)
            # and at most one stall
            per_rank = launch.spawn(_run_hooks, world_size,
                                    [sources[i] for i in todo], stream=False,
                                    timeout=60 + (10 + STALL_S) * (len(todo) - 1))
        except launch.LaunchError as exc:
            wrong = WrongAnswer(_("on {world_size} ranks your hook failed on a "
                                  "rank:\n{exc}").format(
                                    world_size=world_size, exc=exc), _(
                                            "return a torch.futures.Future whose "
                                            "value is the bucket's tensor, e.g. "
                                            "dist.all_reduce(..., "
                                            "async_op=True).get_future().then(...)"))
            for i in todo:
                verdicts[i] = wrong
            continue
        truths = [_flat(reference_gpt_run(TINY, len(line) * MICRO_BATCH, 1,
                                          seed=g)["grads"])
                  for g, line in enumerate(lines)]
        for j, i in enumerate(todo):
            if per_rank[0][j]["buckets"] < 2:
                raise AssertionError("the check ran with one bucket: lower "
                                     "BUCKET_CAP_MB")
            verdicts[i] = next((w for rank, ranks in enumerate(per_rank)
                                if (w := _judge(ranks[j], rank, world_size, truths))
                                is not None), None)
    return verdicts


#: What ``check_bucket_hook`` switches off while the learner's function runs.
_BUCKET_HOOK_FORBIDS = {
    'torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook':
        N_("torch's own averaging hook"),
    'torch.distributed.algorithms.ddp_comm_hooks.default_hooks:_allreduce_fut':
        N_("torch's own averaging hook"),
    'dtlib.data_parallel.buckets:allreduce_buckets':
        N_("the book's own bucket all-reduce"),
    'dtlib.data_parallel.buckets:allreduce_grads':
        N_("the book's own gradient all-reduce"),
}


@checker(forbids=_BUCKET_HOOK_FORBIDS)
def check_bucket_hook(hook: Callable[..., Any],
                      world_sizes: tuple[int, ...] = (2, 4)) -> None:
    """Check a DDP comm hook ``hook(process_group, bucket) -> Future[Tensor]``.

    It runs as torch DDP's gradient hook on 2 and then 4 real ranks over several
    buckets (:func:`hook_verdicts`): the gradients must equal one process's on the
    whole batch, with one asynchronous all-reduce per bucket that the hook returns
    before it completes. On 4 ranks DDP runs in two replica groups (ranks 0-2 and
    rank 3, :func:`replica_groups`), each with its own model and rows, so the hook
    must reduce over the group DDP hands it.
    """
    wrong = hook_verdicts([hook], world_sizes)[0]
    if wrong is not None:
        raise wrong
    passed(_("your hook averaged every bucket with one asynchronous all-reduce; the "
             "gradients equal one process's on {join} ranks").format(
               join=' and '.join(map(str, world_sizes))))


# ---- build it: DistributedSampler's indices, from scratch -------------------------

# (dataset_len, world_size, seed, epochs): the chapter's 12 samples on 2 ranks, and
# lengths it does not show: padding that wraps more than once (2 samples, 5 ranks),
# one rank more than samples, another seed.
_SAMPLER_CASES = ((12, 2, 0, 3), (10, 4, 0, 2), (3, 4, 0, 2), (2, 5, 7, 2),
                  (11, 3, 5, 3))


def _contiguous(order: list[int], world_size: int, rank: int) -> list[int]:
    per = -(-len(order) // world_size)
    padded = (order * -(-per * world_size // len(order)))[:per * world_size]
    return padded[rank * per:(rank + 1) * per]


#: What ``check_sampler_indices`` switches off while the learner's function runs.
_SAMPLER_INDICES_FORBIDS = {
    'torch.utils.data.distributed:DistributedSampler.__iter__':
        N_("torch's sampler itself"),
    'dtlib.data_parallel.sampling:shards': N_("the book's own sampler"),
    'dtlib.data_parallel.sampling:epoch_orders': N_("the book's own sampler"),
    'dtlib.data_parallel.sampling:ResumableSampler.__iter__':
        N_("the book's own sampler"),
}


@checker(forbids=_SAMPLER_INDICES_FORBIDS)
def check_sampler_indices(sampler_indices: Callable[[int, int, int, int, int],
                                                    list[int]],
                          seed: int | None = None) -> None:
    """Check ``sampler_indices(dataset_len, world_size, rank, epoch, seed)``, built
    without ``DistributedSampler``: the indices that rank's
    ``DistributedSampler(shuffle=True, drop_last=False, seed=seed)`` yields after
    ``set_epoch(epoch)``.

    The page's cases and three drawn (``seed``): worlds of 1 to 6 ranks, datasets
    from smaller than the world to several times it, any sampler seed and epoch.
    While the function runs, ``DistributedSampler.__iter__`` and the book's own
    sampler raise (:data:`_SAMPLER_INDICES_FORBIDS`).
    """
    rng = random.Random(seed)
    drawn = tuple((rng.randint(1, 40), rng.randint(1, 6), rng.randrange(1000),
                   rng.randint(1, 3)) for _ in range(3))
    cases = _SAMPLER_CASES + drawn
    for n, world_size, sampler_seed, epochs in cases:
        per = -(-n // world_size)
        for epoch in range(epochs):
            want = sampling.shards(n, world_size, epoch=epoch, seed=sampler_seed)
            for rank in range(world_size):
                where = (_("dataset_len={n}, world_size={world_size}, rank={rank}, "
                           "epoch={epoch}, seed={sampler_seed}").format(
                             n=n, world_size=world_size, rank=rank, epoch=epoch,
                             sampler_seed=sampler_seed))
                got = sampler_indices(n, world_size, rank, epoch, sampler_seed)
                try:
                    got = [int(i) for i in got]
                except TypeError:
                    raise WrongAnswer(_("{where}: return a list of indices, "
                                        "got {type}").format(
                                          where=where,
                                          type=type(got).__name__)) from None
                if got == want[rank]:
                    continue
                order = torch.randperm(
                    n, generator=torch.Generator().manual_seed(sampler_seed)).tolist()
                full = torch.randperm(
                    n, generator=torch.Generator().manual_seed(sampler_seed + epoch)
                ).tolist()
                if len(got) != per:
                    hint = (_("every rank reads ceil({n} / {world_size}) = {per} "
                              "indices: the sampler pads by repeating the shuffled "
                              "order from its start, as many times as needed").format(
                                n=n, world_size=world_size, per=per))
                elif epoch and got == sampling.shards(n, world_size, epoch=0,
                                                       seed=sampler_seed)[rank]:
                    hint = (_("the same order as epoch 0: the generator is seeded "
                              "with seed + epoch, which is what set_epoch changes"))
                elif got == _contiguous(full, world_size, rank):
                    hint = (_("the sampler deals the padded order round-robin: rank r "
                              "takes positions r, r + world_size, ..."))
                elif got == _contiguous(order, world_size, rank) or sorted(got) == \
                        sorted(want[rank]):
                    hint = _("right indices, wrong order or dealing")
                else:
                    hint = (_("shuffle with torch.randperm(dataset_len, generator=g), "
                              "g = torch.Generator().manual_seed(seed + epoch)"))
                raise WrongAnswer(_("{where}: got {got}, DistributedSampler gives "
                                    "{want}.").format(
                                      where=where, got=got, want=want[rank]), hint)
    passed(_("your indices equal DistributedSampler's on {n_cases} datasets, every "
             "rank and epoch, padding included").format(n_cases=len(cases)))
