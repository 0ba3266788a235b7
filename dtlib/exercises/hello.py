"""Checkers for Chapter 0, "Hello, distributed"."""

from __future__ import annotations

import random
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtlib.runtime import launch
from dtlib.runtime.dist import world
from dtlib.exercises import WrongAnswer, as_number, checker, passed, run_on_ranks
from dtlib.runtime.i18n import _

_PAGE_WORLDS = (1, 2, 4)     # the world sizes the page names
_MORE_WORLDS = (3, 5, 6)  # launched too, one of them drawn at random per check


def _all_reduce_rank_plus_one() -> float:
    """On every rank: all-reduce (sum) a tensor holding rank + 1; return the result."""
    rank = dist.get_rank()
    t = torch.tensor([rank + 1.0], device=world().device)
    dist.all_reduce(t)
    return t.item()


def _is_number(value: Any) -> bool:
    return as_number(value) is not None


@checker
def check_all_reduce_prediction(predict: Callable[[int, int], float],
                                world_sizes: tuple[int, ...] | None = None,
                                seed: int | None = None) -> None:
    """Check ``predict(world_size, rank)``: the value each rank holds after
    ``all_reduce(SUM)`` of ``tensor([rank + 1.0])``.

    The truth comes from real ranks: the page's worlds (1, 2, 4) and one more drawn
    at random from 3, 5, 6, every rank of each. Then a few worlds too large to
    launch here (drawn from 8 to 4096, at random ranks) are compared with the sum those
    real runs obey, so a table of the launched sizes does not pass.

    Args:
        predict: the learner's ``predict(world_size, rank) -> number``.
        world_sizes: worlds to launch (default: the page's and a random one).
        seed: seeds the random draws (default: a fresh draw each call).
    Returns:
        None; prints a pass line, or raises WrongAnswer.

    Taught in: Chapter 0, "Four ranks on a CPU".
    """
    rng = random.Random(seed)
    if world_sizes is None:
        world_sizes = (*_PAGE_WORLDS, rng.choice(_MORE_WORLDS))
    hint = _("after an all-reduce every rank holds the same value, the sum over all "
             "ranks of what each contributed: write it for any world_size.")
    for n in world_sizes:
        truth = launch.spawn(_all_reduce_rank_plus_one, n, stream=False)
        for rank, actual in enumerate(truth):
            got = predict(n, rank)
            if not _is_number(got) or got != actual:
                raise WrongAnswer(
                    _("world_size={n}, rank={rank}: you predicted {got!r}, the rank "
                      "holds {actual!r}.").format(n=n, rank=rank, got=got,
                                                  actual=actual), hint)
    # Beyond what two cores can launch: the sum of rank + 1 over the ranks, which is
    # what every launched world above held (exact: integers below 2**24 in float32).
    for n in sorted(rng.sample(range(8, 4097), 3)):
        rank = rng.randrange(n)
        got, actual = predict(n, rank), float(n * (n + 1) // 2)
        if not _is_number(got) or got != actual:
            raise WrongAnswer(
                _("world_size={n}, rank={rank}: you predicted {got!r}; the sum of "
                  "rank + 1 over {n} ranks is {actual!r}.").format(
                      n=n, rank=rank, got=got, actual=actual), hint)
    passed(_("your prediction matches real all-reduces on {worlds} ranks and the "
             "larger worlds tried").format(worlds=list(world_sizes)))


def _count_on_rank(count_flagged: Callable[[bool], Any],
                   patterns: list[list[bool]]) -> list[Any]:
    """On every rank: call the learner's function once per pattern, with this rank's
    flag; return what it returned each time."""
    rank = dist.get_rank()
    return [count_flagged(flags[rank]) for flags in patterns]


def _patterns(n: int, rng: random.Random) -> list[list[bool]]:
    """Flag patterns for ``n`` ranks: none, all, and (n > 1) a mixed one."""
    patterns = [[False] * n, [True] * n]
    if n > 1:
        mixed = [rng.random() < 0.5 for _ in range(n)]
        flagged, clear = rng.sample(range(n), 2)
        mixed[flagged], mixed[clear] = True, False
        patterns.insert(0, mixed)  # first: a collective under `if flag` hangs here
    return patterns


@checker
def check_count_flagged(count_flagged: Callable[[bool], Any],
                        world_sizes: tuple[int, ...] | None = None,
                        seed: int | None = None, timeout: float = 20.0) -> None:
    """Check ``count_flagged(flag) -> int``, called on every rank with that rank's
    flag: every rank must return how many ranks of the world have ``flag=True``.

    Runs on real ranks: 4 (the page's world) and one more drawn from 2, 3, 5, with flag
    patterns drawn at random (some ranks flagged and some not, none, all).

    Args:
        count_flagged: the learner's function (it may be defined in a notebook cell).
        world_sizes: worlds to launch (default: 4 and one random).
        seed: seeds the random draws (default: a fresh draw each call).
        timeout: seconds before a hang is stopped and reported.
    Returns:
        None; prints a pass line, or raises WrongAnswer.

    Taught in: Chapter 0, "The classic mistake: a collective only rank 0 calls".
    """
    rng = random.Random(seed)
    if world_sizes is None:
        world_sizes = (4, rng.choice((2, 3, 5)))
    hint = _("every rank must call the same collective, whatever its own flag: put "
             "the flag in a tensor (1 or 0), all-reduce it, and return the sum on "
             "every rank, as an int.")
    for n in world_sizes:
        patterns = _patterns(n, rng)
        try:
            results = run_on_ranks(_count_on_rank, count_flagged, n, patterns,
                                   timeout=timeout, what=_("your count_flagged"))
        except WrongAnswer as exc:
            raise WrongAnswer(exc.what, hint) from None
        for i, flags in enumerate(patterns):
            want = sum(flags)
            for rank, per_rank in enumerate(results):
                got = per_rank[i]
                if not _is_number(got) or got != want:
                    raise WrongAnswer(
                        _("world_size={n}, flags per rank {flags}: rank {rank} "
                          "returned {got!r}, expected {want} (a number, the same on "
                          "every rank).").format(n=n, flags=flags, rank=rank, got=got,
                                                 want=want), hint)
    passed(_("every rank returned the count on {worlds} ranks, for every flag "
             "pattern tried").format(worlds=list(world_sizes)))
