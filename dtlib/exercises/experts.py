"""Checkers for Chapter 14, "Mixture of experts"."""

from __future__ import annotations

import random
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from dtlib.collectives.accounting import count_comms
from dtlib.exercises import WrongAnswer, checker, passed, run_on_ranks
from dtlib.runtime.dist import world
from dtlib.runtime.i18n import N_, _

DISPATCH_WORLD = 3
_HIDDEN = 4


def _case(case: int, rank: int, n: int, content_seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows and their destinations in case ``case``: 0 sends two
    rows to every rank (every split equal), 1 sends uneven splits, 2 sends nothing
    to the last rank. ``content_seed`` (drawn per check, never shown to the learner's
    function) makes the rows and routes unknowable without the all-to-alls."""
    gen = torch.Generator().manual_seed(content_seed + 10 * case + rank)
    if case == 0:
        order = torch.randperm(2 * n, generator=gen)
        dest = torch.arange(n).repeat_interleave(2)[order]
    elif case == 1:
        dest = torch.randint(0, n, (3 + 2 * rank,), generator=gen)
    else:
        dest = torch.randint(0, n - 1, (4,), generator=gen)
    x = torch.randn(dest.numel(), _HIDDEN, generator=gen, dtype=torch.float64)
    return x + 100 * rank, dest  # a row's source readable from its values


def _truth(case: int, rank: int, n: int, content_seed: int = 0) -> torch.Tensor:
    """One process: every source's rows for ``rank``, by source, in source order."""
    rows = []
    for src in range(n):
        x, dest = _case(case, src, n, content_seed)
        rows.append(x[dest == rank])
    return torch.cat(rows)


class UnstableSorts(TorchFunctionMode):
    """Notes every sort of a tensor with ties that does not ask for ``stable=True``
    (``torch.sort``/``argsort`` and their tensor methods). On a CPU torch sorts
    stably whatever it is asked; on a GPU an unstable sort returns tied elements in
    any order, so the same code is right on one and wrong on the other. Keys without
    ties (``dest * rows + arange``, say) need no stability and are not noted."""

    SORTS = (torch.sort, torch.argsort, torch.Tensor.sort, torch.Tensor.argsort)

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in self.SORTS and not kwargs.get("stable"):
            t = args[0] if args else kwargs.get("input")
            if isinstance(t, torch.Tensor) and t.numel() > torch.unique(t).numel():
                self.found.append(func.__name__)
        return func(*args, **kwargs)


def dispatch_on_rank(dispatch: Callable[..., torch.Tensor], content_seed: int = 0
                     ) -> list[dict[str, Any]]:
    """On one rank: each case's rows and destinations passed to ``dispatch(x,
    dest)``, its all-to-alls counted, its result beside the one-process truth.
    Stops after a case whose answer made fewer than two all-to-alls (a later,
    uneven case could not run without the counts).

    Returns:
        Per case run: ``got`` (a CPU tensor or a description), ``want``, ``a2a``
        (``(elements, bytes)`` of each all-to-all).

    Taught in: Chapter 14, "Expert parallelism on all-to-alls".
    """
    rank, n, device = dist.get_rank(), dist.get_world_size(), world().device
    out = []
    for case in range(3):
        x, dest = _case(case, rank, n, content_seed)
        with count_comms() as log, UnstableSorts() as sorts:
            got = dispatch(x.to(device), dest.to(device))
        got = got.detach().cpu() if isinstance(got, torch.Tensor) else \
            f"a {type(got).__name__}"
        a2a = [(r.numel, r.bytes) for r in log.records if r.op == "all_to_all"]
        others = sorted({r.op for r in log.records} - {"all_to_all"})
        out.append({"case": case, "got": got,
                    "want": _truth(case, rank, n, content_seed), "a2a": a2a,
                    "others": others, "unstable": sorts.found})
        if len(a2a) < 2:
            break
    return out


def judge_dispatch(ranks: list[list[dict[str, Any]]]) -> None:
    """Raise :class:`WrongAnswer` unless every rank exchanged the counts (one
    all-to-all of one integer per rank) and then the rows, and received exactly
    the rows one process computes, grouped by source rank in source order.

    Taught in: Chapter 14, "Expert parallelism on all-to-alls" (its
    exercise).
    """
    n = len(ranks)
    for r, records in enumerate(ranks):
        for rec in records:
            where = _("rank {r}, case {rec_case}").format(r=r, rec_case=rec['case'])
            a2a = rec["a2a"]
            if rec.get("others"):
                raise WrongAnswer(
                    _("{where}: your dispatch also ran {join}; expert parallelism's "
                      "dispatch is two all-to-alls and nothing else (each rank learns "
                      "only what is sent to it).").format(
                        where=where, join=', '.join(rec['others'])),
                    _("exchange the counts with one all-to-all, then the rows with "
                      "another; no rank needs the others' destinations"))
            if len(a2a) < 2:
                raise WrongAnswer(
                    _("{where}: {n_a2a} all-to-all call(s); a dispatch needs "
                      "two.").format(where=where, n_a2a=len(a2a)),
                    _("a rank cannot size its receive buffer until it knows how many "
                      "rows each peer sends it: exchange the counts first (one "
                      "all-to-all of one integer per rank), then the rows"))
            numel, nbytes = a2a[0]
            if numel != n or nbytes // max(numel, 1) not in (4, 8):
                raise WrongAnswer(
                    _("{where}: the first all-to-all moved {numel} elements of "
                      "{value} bytes; the counts are one integer per rank.").format(
                        where=where, numel=numel, value=nbytes // max(numel, 1)), _(
                                "count the rows for each destination "
                                "(torch.bincount(dest, minlength=world_size)) and "
                                "exchange those"))
            got, want = rec["got"], rec["want"]
            if rec.get("unstable"):
                raise WrongAnswer(
                    _("{where}: your dispatch sorts destinations with ties without "
                      "stable=True. Here, on a CPU, torch sorts stably anyway; on a "
                      "GPU rows bound for one rank may come back in any order, and "
                      "the receiver can no longer tell which token is which.").format(
                        where=where),
                    _("torch.argsort(dest, stable=True)"))
            if isinstance(got, str):
                raise WrongAnswer(_("{where}: dispatch returned {got}, not a "
                                    "tensor.").format(where=where, got=got))
            if got.shape != want.shape:
                raise WrongAnswer(
                    _("{where}: received {shape_0} rows; one process says this rank "
                      "gets a different number.").format(
                        where=where, shape_0=tuple(got.shape)[0]), _(
                                "row i goes to rank dest[i]: the counts sent and the "
                                "rows sent must agree"))
            if not torch.equal(got, want):
                hint = (_("the rows go to rank dest[i], grouped by destination before "
                          "the all-to-all (a stable sort keeps each source's order), "
                          "and arrive grouped by source rank"))
                if sorted(got[:, 0].tolist()) == sorted(want[:, 0].tolist()):
                    raise WrongAnswer(_("{where}: the right rows in the "
                                        "wrong order.").format(where=where),
                                      hint)
                raise WrongAnswer(_("{where}: received rows meant for "
                                    "another rank.").format(where=where),
                                  hint)
    passed(_("on {n} ranks, equal and uneven splits and a rank that receives nothing: "
             "every rank got exactly its rows, counts first").format(n=n))


#: What ``check_dispatch`` switches off while the learner's function runs.
_DISPATCH_FORBIDS = {
    'dtlib.exercises.experts:_truth': N_("the checker's truth"),
    'dtlib.expert_parallel.all_to_all:all_to_all': N_("the book's own dispatch"),
    'dtlib.expert_parallel.all_to_all:exchange_counts': N_("the book's own dispatch"),
    'dtlib.expert_parallel.all_to_all:AllToAll.forward': N_("the book's own dispatch"),
    'dtlib.expert_parallel.layer:ExpertParallelMoE.forward':
        N_("the book's own MoE layer"),
}


@checker(forbids=_DISPATCH_FORBIDS)
def check_dispatch(dispatch: Callable[..., torch.Tensor],
                   seed: int | None = None) -> None:
    """Check ``dispatch(x, dest) -> received`` on 3 real ranks: ``x`` (rows, h) are
    this rank's tokens, ``dest`` (rows,) the rank each must go to; return the rows
    this rank receives, grouped by source rank, each source's in its order.

    Args:
        dispatch: the learner's function: one all-to-all of the counts (either
            form), one of the rows. The rows need ``all_to_all_single`` with split
            sizes on gloo: its list form ``all_to_all`` wants equal shapes there,
            which uneven routing does not give (NCCL takes uneven lists).
        seed: draws the rows' values and routes (default: fresh each call).
    Returns:
        None (prints "Correct" or raises :class:`WrongAnswer`).

    Taught in: Chapter 14, "Expert parallelism on all-to-alls".
    """
    content_seed = random.Random(seed).randrange(2 ** 31)  # the rows' values
    ranks = run_on_ranks(dispatch_on_rank, dispatch, DISPATCH_WORLD, content_seed,
                         what=_("your dispatch"))
    judge_dispatch(ranks)
