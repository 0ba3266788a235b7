"""Checkers for Chapter 8, "Gradient accumulation"."""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Sequence

from dtlib.exercises import (WrongAnswer, as_number, as_integer, checker, passed,
                             run_on_ranks)
from dtlib.runtime.i18n import N_, _

#: Token counts per rank, per micro-batch: ``cases[i][rank][k]``.
SCALE_CASES: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((10, 20),),
    ((30, 12, 50), (41, 7, 20)),
    ((5,), (0,), (9,), (16,)),
    ((64, 64), (64, 64), (64, 64), (64, 1)),
)


def _scale_truth(token_counts: Sequence[Sequence[int]]) -> float:
    world_size = len(token_counts)
    return world_size / sum(sum(rank) for rank in token_counts)


ALLREDUCE_CASES = ((1, 1, True), (1, 5, False), (4, 1, True), (4, 1, False),
                   (4, 7, True), (4, 7, False), (8, 3, True), (3, 3, False))


#: What ``check_allreduce_calls`` switches off while the learner's function runs.
_ALLREDUCE_CALLS_FORBIDS = {
    'dtlib.data_parallel.ddp:allreduce_calls_per_step': N_("the book's own count"),
}


@checker(forbids=_ALLREDUCE_CALLS_FORBIDS)
def check_allreduce_calls(calls: Callable[[int, int, bool], int],
                          seed: int | None = None) -> None:
    """Check ``calls(accum_steps, n_buckets, no_sync) -> int``: gradient all-reduce
    calls one rank issues per optimizer step (DDP with ``n_buckets`` buckets), with
    all but the last micro-batch inside ``no_sync()`` when ``no_sync`` is true. The
    page's cases and four drawn from ``seed`` (up to 64 micro-batches, 50 buckets)."""
    rng = random.Random(seed)
    drawn = tuple((rng.randint(1, 64), rng.randint(1, 50), no_sync)
                  for no_sync in (True, False, True, False))
    for accum_steps, n_buckets, no_sync in (*ALLREDUCE_CASES, *drawn):
        want = n_buckets if no_sync else accum_steps * n_buckets
        got = calls(accum_steps, n_buckets, no_sync)
        if as_integer(got) is None:
            raise WrongAnswer(_("expected an int, got {type} {got!r}").format(
                                  type=type(got).__name__, got=got))
        got = as_integer(got)
        if got != want:
            hint = (_("every backward outside no_sync all-reduces every bucket once")
                    if not no_sync else
                    _("inside no_sync nothing is sent; the last, synchronised "
                      "backward sends each bucket once"))
            raise WrongAnswer(
                _("accum_steps={accum_steps}, n_buckets={n_buckets}, "
                  "no_sync={no_sync}: you said {got}, a rank issues {want}. Hint: "
                  "{hint}.").format(
                    accum_steps=accum_steps, n_buckets=n_buckets, no_sync=no_sync,
                    got=got, want=want, hint=hint))
    passed(_("no_sync cuts the gradient all-reduces per step by a factor accum_steps"))


# ---- build it: the normaliser, computed by the ranks themselves ----------------------

def _scale_on_rank(scale: Callable[[list[int]], float],
                   cases: tuple[tuple[tuple[int, ...], ...], ...]) -> list[Any]:
    """On every rank: the learner's factor for this rank's token counts, per case,
    and the collectives it issued."""
    import torch.distributed as dist

    # loads torch on first use: this module imports without it
    from dtlib.exercises.collectives import watch_comms

    rank, out = dist.get_rank(), []
    for case in cases:
        with watch_comms() as log:
            got = scale(list(case[rank]))
        out.append((got.item() if hasattr(got, "item") else got,
                    [kind for kind, _, _ in log]))
    return out


#: One collective that brings every rank's count, as the recorder sees it: the sum
#: directly (all-reduce), or every count, summed locally (an all-gather in any of its
#: forms; ``all_gather_object`` is two, its payloads' sizes and then the payloads).
ONE_COLLECTIVE = (["all_reduce"], ["all_gather"], ["all_gather", "all_gather"])


#: What ``check_loss_scale_on_ranks`` switches off while the learner's function runs.
_LOSS_SCALE_ON_RANKS_FORBIDS = {
    'dtlib.exercises.accumulation:_scale_truth': N_("the checker's truth"),
}


@checker(forbids=_LOSS_SCALE_ON_RANKS_FORBIDS)
def check_loss_scale_on_ranks(scale: Callable[[list[int]], float],
                              world_sizes: tuple[int, ...] | None = None,
                              seed: int | None = None) -> None:
    """Check ``scale(local_token_counts) -> float`` on real ranks.

    Each rank passes the real-token counts of its own micro-batches (this optimizer
    step) and gets the factor it multiplies each micro-batch's *summed* token loss by,
    so that after DDP averages the gradients they equal the large batch's mean loss.
    A rank does not know the others' counts: it must ask them, with one collective
    (an all-reduce of its count, or an all-gather of every rank's count).

    Worlds of 2 and 4 ranks and one drawn from 3 and 5 (``seed``); on each, the page's
    counts and counts drawn per check (1 to 4 micro-batches a rank, zeros among them),
    so no table of the checker's cases can stand in for the collective.
    """
    rng = random.Random(seed)
    if world_sizes is None:
        world_sizes = (2, 4, rng.choice((3, 5)))
    for n in world_sizes:
        drawn = tuple(tuple(rng.randint(0, 60) for _ in range(rng.randint(1, 4)))
                      for _ in range(n))
        if not sum(map(sum, drawn)):
            drawn = ((1,), *drawn[1:])  # some rank holds a real token
        cases = tuple(c for c in SCALE_CASES if len(c) == n) + (
            tuple(tuple(7 * r + k + 1 for k in range(3)) for r in range(n)), drawn)
        ranks = run_on_ranks(_scale_on_rank, scale, n, cases,
                             what=_("your normaliser"))
        for i, case in enumerate(cases):
            counts = [list(c) for c in case]
            want = _scale_truth(counts)
            for rank in range(n):
                got, comms = ranks[rank][i]
                where = _("world_size={n}, rank {rank}, token counts {counts}").format(
                            n=n, rank=rank, counts=counts)
                if as_number(got) is None:
                    raise WrongAnswer(_("{where}: expected a number, got "
                                        "{got!r}").format(where=where, got=got))
                got = as_number(got)
                # N / T in float32 is within 2 ulps (2 * 2**-24 ~ 1.2e-7) of the
                # truth (T < 2**24 is exact); rel_tol=1e-6 allows 16 ulps, while
                # the wrong normalisers are off by factors (1/T_r, 1/T).
                if math.isclose(got, want, rel_tol=1e-6):
                    if comms not in ONE_COLLECTIVE:
                        raise WrongAnswer(
                            _("{where}: right, but it issues {comms}; one collective "
                              "is enough: an all-reduce of the count, or an "
                              "all-gather of every rank's count.").format(
                                where=where, comms=comms))
                    continue
                total, local = sum(map(sum, counts)), sum(counts[rank])
                if not comms:
                    hint = (_("this rank only knows its own tokens; the normaliser "
                              "needs every rank's: sum them with one dist.all_reduce "
                              "(or gather them with one dist.all_gather)"))
                elif local and math.isclose(got, 1 / local, rel_tol=1e-6):
                    hint = (_("that is this rank's own count: DDP would average "
                              "per-rank means; all-reduce the count first"))
                elif math.isclose(got, 1 / total, rel_tol=1e-6):
                    hint = (_("DDP *averages* the ranks' gradients (divides by "
                              "world_size); multiply that back"))
                else:
                    hint = _("count every real token of every rank's micro-batches")
                side = _("too large") if got > want else _(
                        "too small")
                raise WrongAnswer(_("{where}: you gave {got!r}, {side}.").format(
                                      where=where, got=got, side=side), hint)
    passed(_("every rank computes world_size / (global token count) with one "
             "collective, on {world_sizes} ranks").format(
               world_sizes=list(world_sizes)))
