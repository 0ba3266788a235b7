"""Checkers for Chapter 2, "Collectives": answers are checked on real ranks.

A function written in a notebook cell cannot be imported by the ranks that
:func:`dtlib.runtime.launch.spawn` forks (it lives in the kernel's ``__main__``). So the
all-gather checker sends the function's *source* (``inspect.getsource``) to every rank,
which executes it in a fresh namespace holding ``torch`` and ``dist``. The function
must therefore be self-contained: it may use ``torch``, ``dist`` (torch.distributed)
and anything it imports itself, not other variables of the notebook.

What the ring checker watches: every message (``send``, ``recv``, ``isend``,
``irecv``, ``batch_isend_irecv``) with its peer and size, and any collective, through
the one recorder of communication
(:func:`dtlib.collectives.accounting.count_comms`), which sees them at the dispatcher
whatever name or API issued them.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import textwrap
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from dtlib.collectives.accounting import count_comms
from dtlib.collectives.algorithms import ring_all_reduce
from dtlib.exercises import WrongAnswer, as_number, checker, passed
from dtlib.exercises.tripwires import guarded
from dtlib.runtime import diagnose, launch
from dtlib.runtime.i18n import N_, _

_CASES = ((4,), (3, 2), (1,), (5, 3))  # shard shapes, one per check


@contextlib.contextmanager
def watch_comms() -> Iterator[list[tuple[str, int | None, int]]]:
    """Record ``(kind, peer, numel)`` for every send/recv, ``(op, None, 0)`` for every
    other collective, issued inside the block on this rank, however it is spelled
    (the one recorder, :func:`~dtlib.collectives.accounting.count_comms`: ``dist.*``,
    ``distributed_c10d.*``, a group's methods, functional collectives). ``peer`` is a
    global rank (None for a receive from any source).

    Returns:
        The list, filled when the block ends.
    """
    entries: list[tuple[str, int | None, int]] = []
    with count_comms() as log:
        yield entries
    entries.extend((r.op, r.peer, r.numel) if r.op in ("send", "recv")
                   else (r.op, None, 0) for r in log.records)


def _load(source: str, name: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"torch": torch, "dist": dist}
    exec(compile(source, f"<your {name}>", "exec"), namespace)  # noqa: S102
    if not callable(namespace.get(name)):
        raise WrongAnswer(_("the source defines no function named {name!r}").format(
                              name=name))
    return guarded(namespace[name], _RING_ALL_GATHER_FORBIDS)


def _ring_problems(log: list[tuple[str, int | None, int]], rank: int, n: int,
                   chunk: int) -> list[str]:
    """What makes this rank's traffic not a ring all-gather (empty: nothing)."""
    used = sorted({kind for kind, _, _ in log} - {"send", "recv"})
    if used:
        return [_("it calls {used}: use only send/recv (dist.send, dist.recv, "
                  "dist.isend, dist.irecv, or dist.batch_isend_irecv)").format(
                    used=used)]
    sends = [(peer, k) for kind, peer, k in log if kind == "send"]
    recvs = [(peer, k) for kind, peer, k in log if kind == "recv"]
    right, left = (rank + 1) % n, (rank - 1) % n
    # The ring may turn either way: every send to one neighbour, every receive from
    # the other (or from any source, src=None: the only rank that sends to this one
    # is then that neighbour, since every rank's sends are checked the same way).
    to = sends[0][0] if sends else right
    frm = left if to == right else right
    if to not in (right, left) or any(peer != to for peer, _ in sends):
        peers = sorted({p for p, _ in sends if p is not None})
        return [_("rank {rank} of {n} sends to ranks {peers}: in a ring, a rank sends "
                  "only to one neighbour (rank {right}, or rank {left} for a ring "
                  "turning the other way)").format(
                    rank=rank, n=n, peers=peers, right=right, left=left)]
    if any(peer not in (frm, None) for peer, _ in recvs):
        return [_("rank {rank} of {n} receives from ranks {value}: in a ring, a rank "
                  "receives only from the neighbour on the other side, rank {frm} "
                  "(name it: src={frm})").format(
                    rank=rank, n=n, value=sorted({str(p) for p, _ in recvs}),
                    frm=frm)]
    # Each step passes one shard; it may go as several messages, never more than a
    # shard at once, and n - 1 shards in all.
    sent, got = sum(k for _, k in sends), sum(k for _, k in recvs)
    if len(sends) < n - 1 or sent != (n - 1) * chunk or got != (n - 1) * chunk:
        return [_("rank {rank} of {n} sends {n_sends} message(s) of {sent} element(s) "
                  "and receives {got}: a ring all-gather takes n - 1 = {value} steps, "
                  "each passing one shard ({chunk} elements)").format(
                    rank=rank, n=n, n_sends=len(sends), sent=sent, got=got,
                    value=n - 1, chunk=chunk)]
    if any(k > chunk for _, k in sends + recvs):
        return [_("rank {rank} of {n} sends messages of {value} element(s): each step "
                  "passes one shard ({chunk} elements)").format(
                    rank=rank, n=n, value=sorted({k for _, k in sends}), chunk=chunk)]
    return []


def _check_all_gather_on_rank(source: str, name: str,
                              extra: tuple[tuple[int, ...], ...] = (),
                              content_seed: int = 0) -> list[str]:
    """On every rank: run the learner's all-gather on several shapes (``extra``: more,
    in float64); list problems. The shards' values are drawn (``content_seed``, which
    the learner's function never sees): a result rebuilt without communication
    cannot match."""
    fn = _load(source, name)
    rank, n = dist.get_rank(), dist.get_world_size()
    cases = [(shape, torch.int64) for shape in _CASES]
    cases += [(shape, torch.float64) for shape in extra]

    def shard_of(r: int, case: int, shape: tuple[int, ...], dtype: torch.dtype
                 ) -> torch.Tensor:
        gen = torch.Generator().manual_seed(content_seed + 1000 * case + r)
        return torch.randint(-999, 1000, shape, generator=gen).to(dtype)

    for case, (shape, dtype) in enumerate(cases):
        shard = shard_of(rank, case, shape, dtype)
        want = torch.cat([shard_of(r, case, shape, dtype) for r in range(n)])
        with watch_comms() as log:
            got = fn(shard.clone())
        if isinstance(got, torch.Tensor) and got.dtype != dtype:
            return [_("world_size={n}, rank {rank}: the shards are {dtype}, your "
                      "result is {dtype2}: an all-gather keeps its input's dtype "
                      "(make the output with dtype=tensor.dtype)").format(
                        n=n, rank=rank, dtype=dtype, dtype2=got.dtype)]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or \
                not torch.equal(got, want):
            shape_got = (_(" (shape {shape})").format(shape=tuple(got.shape))
                         if isinstance(got, torch.Tensor) else "")
            return [
                _("world_size={n}, rank {rank}, shard shape {shape}: expected "
                  "{tolist} (shape {shape2}), got {value!r}").format(
                    n=n, rank=rank, shape=tuple(shape),
                    tolist=want.flatten().tolist(), shape2=tuple(want.shape),
                    value=(got.flatten().tolist() if isinstance(got, torch.Tensor)
                           else got))
                + shape_got]
        problems = _ring_problems(log, rank, n, shard.numel())
        if problems:
            return problems
    return []


#: What ``check_ring_all_gather`` switches off while the learner's function runs.
_RING_ALL_GATHER_FORBIDS = {
    'dtlib.collectives.algorithms:ring_all_gather':
        N_("the book's own ring all-gather"),
    'dtlib.collectives.algorithms:all_gather_into': N_("the book's all-gather"),
}


@checker(forbids=_RING_ALL_GATHER_FORBIDS)
def check_ring_all_gather(fn: Callable[..., Any] | str,
                          world_sizes: tuple[int, ...] = (1, 2, 3, 4),
                          timeout: float = 30.0, seed: int | None = None) -> None:
    """Check a learner's ``fn(tensor) -> tensor``: all-gather along dim 0 by a ring.

    The result must equal ``all_gather``, and the traffic must be a ring: each rank
    sends only to rank + 1 and receives only from rank - 1 (or from any source,
    ``src=None``, which in a ring can only be rank - 1), n - 1 times, one shard a
    time.

    Args:
        fn: the function, or its source text (then its name is the first ``def``).
        world_sizes: worlds to run it in.
        timeout: seconds before a hung attempt is stopped (and reported as a deadlock).
        seed: seeds the shard shape drawn beyond the page's (default: fresh each call).
    Returns:
        None; prints a pass line, or raises WrongAnswer.

    Taught in: Chapter 2, "Ring all-reduce, from send and recv".
    """
    if callable(fn):
        source, name = textwrap.dedent(inspect.getsource(fn)), fn.__name__
    else:
        source = textwrap.dedent(fn)
        line = next((ln for ln in source.splitlines() if ln.startswith("def ")), None)
        if line is None:
            raise WrongAnswer(_("the source has no top-level 'def'"))
        name = line[4:].split("(")[0].strip()
    _load(source, name)  # syntax errors surface here, in the learner's process
    diagnose.remember_source(f"<your {name}>", source)  # a hang report shows its lines
    # Beyond the page's shapes: one drawn at random per check, in float64.
    rng = random.Random(seed)
    extra = (tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3))),)
    content_seed = rng.randrange(2 ** 31)
    for n in world_sizes:
        try:
            results = launch.spawn(_check_all_gather_on_rank, n, source, name, extra,
                                   content_seed, timeout=timeout, stream=False)
        except launch.LaunchTimeout as exc:
            raise WrongAnswer(
                _("world_size={n}: your all-gather did not finish in {timeout:g} s: a "
                  "deadlock.\n").format(n=n, timeout=timeout) + "\n".join(exc.report),
                _("if every rank first sends and then receives with blocking calls, "
                  "all wait in send: post a step's send and receive together (isend + "
                  "irecv, or batch_isend_irecv), then wait on both.")) from None
        except launch.LaunchError as exc:
            raise WrongAnswer(_("world_size={n}: your all-gather raised on a "
                                "rank:\n{exc}").format(n=n, exc=exc)) from None
        problems = [p for per_rank in results for p in per_rank]
        if problems:
            raise WrongAnswer(problems[0], _("in step s, rank r passes on the shard "
                                             "it received in step s - 1 (its own in "
                                             "step 0): to rank r+1, while receiving "
                                             "the next from rank r-1. Look again at "
                                             "'Ring all-reduce, from send and recv': "
                                             "its all-gather half is this exercise."))
    passed(_("your ring all-gather equals all_gather on {world_sizes} ranks, passing "
             "one shard to the next rank round the ring n - 1 times").format(
               world_sizes=list(world_sizes)))


def _ring_bytes_sent(nbytes: int) -> int:
    with count_comms() as log:
        ring_all_reduce(torch.ones(nbytes // 4))
    return log.total_bytes("send")


#: What ``check_bytes_sent`` switches off while the learner's function runs.
_BYTES_SENT_FORBIDS = {
    'dtlib.collectives.cost_model:bytes_sent_per_rank': N_("the book's formula"),
    'dtlib.collectives.cost_model:cost_terms': N_("the book's formula"),
    'dtlib.collectives.cost_model:collective_time': N_("the book's formula"),
}


@checker(forbids=_BYTES_SENT_FORBIDS)
def check_bytes_sent(predict: Callable[[int, int], float],
                     cases: tuple[tuple[int, int], ...] = ((4800, 2), (4800, 4),
                                                           (96, 4)),
                     seed: int | None = None) -> None:
    """Check ``predict(nbytes, world_size)``: bytes a rank sends in a ring all-reduce.

    The truth is counted on real ranks (``count_comms`` around
    :func:`dtlib.collectives.ring_all_reduce` of a float32 tensor of ``nbytes``), on
    ``cases`` and one more drawn at random (world size 3 or 5; a tensor whose
    elements divide by it, so every rank sends the same).

    Args:
        predict: the learner's ``predict(nbytes, world_size) -> number``.
        cases: ``(nbytes, world_size)`` pairs to count.
        seed: seeds the drawn case (default: a fresh draw each call).
    Returns:
        None; prints a pass line, or raises WrongAnswer.

    Taught in: Chapter 2, "Ring all-reduce, from send and recv".
    """
    rng = random.Random(seed)
    n_drawn = rng.choice((3, 5))
    cases = (*cases, (4 * n_drawn * rng.randint(1, 300), n_drawn))
    for nbytes, n in cases:
        sent = launch.spawn(_ring_bytes_sent, n, nbytes, stream=False)
        got = predict(nbytes, n)
        if as_number(got) is None:
            raise WrongAnswer(_("predict({nbytes}, {n}) returned {got!r}: return a "
                                "number").format(nbytes=nbytes, n=n, got=got))
        got = as_number(got)
        if any(abs(got - s) > 1e-6 * max(1, s) for s in sent):
            raise WrongAnswer(
                _("all-reduce of {nbytes} bytes on {n} ranks: you predicted {got!r} "
                  "bytes per rank, the ranks sent {sent}.").format(
                    nbytes=nbytes, n=n, got=got, sent=sent), _(
                            "count the steps of the reduce-scatter and of the "
                            "all-gather, and the size of the chunk sent in each."))
    passed(_("your prediction matches the bytes each rank sent, for every case"))
