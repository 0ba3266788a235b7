"""Checkers for Chapter 15, "When the network is slow"."""

from __future__ import annotations

import random
from typing import Any, Callable

import torch

from dtlib.exercises import WrongAnswer, checker, passed, run_on_ranks
from dtlib.runtime.i18n import N_, _

#: The outer step is checked on this many ranks: 2, and 3 (where a sum divided by 3
#: rounds, and a mean taken of the wrong values cannot hide behind a power of two).
OUTER_WORLDS = (2, 3)
#: Outer steps per case: the second one reads the momentum buffers the first left.
OUTER_ROUNDS = 2

_OUTER_FORBIDS = {
    "dtlib.low_comm.diloco:OuterStepping.sync": N_("the book's own outer step"),
    "dtlib.low_comm.diloco:outer_update": N_("the book's own outer update"),
    "dtlib.low_comm.diloco:simulate_diloco": N_("the book's one-process DiLoCo"),
    "dtlib.exercises.low_comm:_outer_truth": N_("the checker's truth"),
}


def _outer_case(seed: int) -> dict[str, Any]:
    """Shapes, outer learning rate and momentum of one case drawn from ``seed``; the
    page's case (seed 0) has DiLoCo's outer step, lr 0.7 and momentum 0.9. The
    momentum is never 0: without it Nesterov's step is plain SGD's."""
    rng = random.Random(seed)
    shapes = [tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 2)))
              for _ in range(rng.randint(1, 3))]
    lr, momentum = (0.7, 0.9) if seed == 0 else (round(rng.uniform(0.2, 1.0), 3),
                                                  round(rng.uniform(0.5, 0.95), 3))
    return {"shapes": shapes, "lr": lr, "momentum": momentum, "seed": seed}


def _outer_values(case: dict[str, Any], rank: int, n: int, rounds: int
                  ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The shared anchor, and per round every replica's parameters after its inner
    steps (the anchor plus a replica's own drift): rank ``rank``'s are ``[r][rank]``."""
    gen = torch.Generator().manual_seed(case["seed"])
    anchor = [torch.randn(s, generator=gen) for s in case["shapes"]]
    drift = [[[0.1 * torch.randn(s, generator=gen) for s in case["shapes"]]
              for _ in range(n)] for _ in range(rounds)]
    return anchor, drift


def _outer_truth(case: dict[str, Any], n: int, rounds: int) -> dict[str, Any]:
    """One process: per round, the anchor and the momentum buffers after it
    (torch's SGD with Nesterov momentum, stepping on the replicas' mean ``anchor -
    params``; its buffer is ``momentum * buffer + g``), and the entrywise bounds on
    what a right answer's anchor and buffers may differ by."""
    anchor, drift = _outer_values(case, 0, n, rounds)
    anchor = [a.clone() for a in anchor]
    m, lr = case["momentum"], case["lr"]
    outer = torch.optim.SGD(anchor, lr=lr, momentum=m, nesterov=m > 0)
    after, bounds, buffers, buffer_bounds = [], [], [], []
    e_buf = [torch.zeros_like(a) for a in anchor]
    e_anchor = [torch.zeros_like(a) for a in anchor]
    eps = torch.finfo(torch.float32).eps
    for r in range(rounds):
        with torch.no_grad():
            params = [[a + d for a, d in zip(anchor, drift[r][k])] for k in range(n)]
            for i, a in enumerate(anchor):
                deltas = [a - params[k][i] for k in range(n)]
                a.grad = sum(deltas) / n
                # what a right answer may round differently in the mean
                # pseudo-gradient: the n-term sum in any order and its division
                # ((n + 1) eps of the magnitudes), or the parameters averaged
                # first and subtracted from the anchor (eps of the anchor and of
                # the parameters each). The buffer carries it m-fold; the anchor
                # moves by lr (g + m buffer) and keeps the previous rounds' error,
                # plus its own last bit or two
                e_g = (n + 1) * eps * sum(d.abs() for d in deltas) / n \
                    + 2 * eps * (a.abs() + torch.stack([p[i].abs() for p in params]
                                                       ).amax(0))
                e_buf[i] = m * e_buf[i] + e_g
                e_anchor[i] = e_anchor[i] + lr * (e_g + m * e_buf[i])
            before = [a.detach().abs() for a in anchor]
            grads = [a.grad.abs() for a in anchor]
            outer.step()
            for i, a in enumerate(anchor):  # each product and sum of the update
                buf = outer.state[a]["momentum_buffer"]
                size = grads[i] + 2 * m * buf.abs()
                e_anchor[i] += 4 * eps * (before[i] + a.abs() + lr * size)
                e_buf[i] += 2 * eps * buf.abs()  # its own product and sum
        after.append([a.detach().clone() for a in anchor])
        bounds.append([e.clone() + 1e-30 for e in e_anchor])
        buffers.append([outer.state[a]["momentum_buffer"].clone() for a in anchor])
        buffer_bounds.append([e.clone() + 1e-30 for e in e_buf])
    return {"anchor": after, "bound": bounds, "buffers": buffers,
            "buffer_bound": buffer_bounds}


def outer_on_rank(outer_step: Callable[..., Any], cases: list[dict[str, Any]],
                  rounds: int) -> list[dict[str, Any]]:
    """On one rank and per case: ``rounds`` outer steps of the learner's function
    from the drawn values, each counted; what the caller's own tensors (the
    parameters, the anchor and the buffers it handed in, whatever the lists hold
    afterwards) hold after each."""
    import torch.distributed as dist

    from dtlib.collectives.accounting import count_comms

    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for case in cases:
        anchor, drift = _outer_values(case, rank, n, rounds)
        buffers = [torch.zeros_like(a) for a in anchor]
        params = [a.clone() for a in anchor]
        seen = []
        for r in range(rounds):
            with torch.no_grad():
                for p, a, d in zip(params, anchor, drift[r][rank]):
                    p.copy_(a + d)  # this replica after its inner steps
            with count_comms() as log:  # fresh lists: the tensors are the caller's
                outer_step(list(params), list(anchor), list(buffers), case["lr"],
                           case["momentum"])
            seen.append({"params": [p.detach().clone() for p in params],
                         "anchor": [a.detach().clone() for a in anchor],
                         "buffers": [b.detach().clone() for b in buffers],
                         "comms": [(c.op, c.bytes) for c in log.records]})
        out.append({"rounds": seen})
    return out


@checker(forbids=_OUTER_FORBIDS)
def check_outer_step(outer_step: Callable[..., Any], seed: int | None = None) -> None:
    """Check ``outer_step(params, anchor, buffers, lr, momentum)`` on 2 and 3 ranks.

    Each rank's ``params`` are its replica after its inner steps, ``anchor`` the
    parameters the replicas last agreed on, ``buffers`` the outer momentum (zeros
    before the first outer step); all are lists of float32 tensors to update in
    place. After each of two outer steps every rank's anchor and parameters must be
    the one-process anchor (the replicas' mean pseudo-gradient, a Nesterov SGD step),
    within what rounding allows, and the step must send one all-reduce's worth of
    the parameters, no more. The page's case and two drawn from ``seed``.
    """
    cases = outer_cases(seed)
    for n in OUTER_WORLDS:
        ranks = run_on_ranks(outer_on_rank, outer_step, n, cases, OUTER_ROUNDS,
                             timeout=60, what=_("your outer step"))
        judge_outer(ranks, cases, n)
    passed(_("your outer step moves every replica to the one-process anchor on 2 and "
             "3 ranks, for {k} cases of two outer steps, sending one all-reduce of "
             "the pseudo-gradients each").format(k=len(cases)))


def outer_cases(seed: int | None) -> list[dict[str, Any]]:
    """The page's case and two drawn from ``seed``."""
    rng = random.Random(seed)
    return [_outer_case(0)] + [_outer_case(rng.randint(1, 10**6)) for _ in range(2)]


def judge_outer(ranks: list[list[dict[str, Any]]], cases: list[dict[str, Any]],
                n: int) -> None:
    """Raise :class:`WrongAnswer` unless every rank's outer steps (what
    :func:`outer_on_rank` returned on ``n`` ranks) sent one all-reduce of the
    pseudo-gradients and left the one-process anchor in ``anchor`` and ``params``."""
    for c, case in enumerate(cases):
        truth = _outer_truth(case, n, OUTER_ROUNDS)
        numel = sum(t.numel() for t in truth["anchor"][0])
        where = _("{n} ranks, shapes {shapes}, lr {lr}, momentum {m}").format(
            n=n, shapes=case["shapes"], lr=case["lr"], m=case["momentum"])
        for rank in range(n):
            for r, seen in enumerate(ranks[rank][c]["rounds"]):
                # a barrier sends nothing; any other collective is more traffic
                ops = [op for op, _b in seen["comms"] if op != "barrier"]
                sent = sum(b for op, b in seen["comms"] if op == "all_reduce")
                if set(ops) - {"all_reduce"} or sent != 4 * numel:
                    raise WrongAnswer(
                        _("{where}: outer step {r} sent {comms} from rank {rank}; "
                          "an outer step is one all-reduce of the pseudo-"
                          "gradients, {nbytes} bytes in all").format(
                              where=where, r=r + 1, comms=seen["comms"] or _(
                                  "nothing"), rank=rank, nbytes=4 * numel),
                        _("average anchor - params over the replicas with "
                          "dist.all_reduce (ReduceOp.AVG, or SUM and divide by "
                          "the world size), once per tensor or once flattened"))
                for name, got in (("anchor", seen["anchor"]),
                                  ("params", seen["params"])):
                    _compare(got, truth["anchor"][r], truth["bound"][r], where, rank,
                             r, name)
                _compare(seen["buffers"], truth["buffers"][r],
                         truth["buffer_bound"][r], where, rank, r, "buffers")


def _compare(got: list[torch.Tensor], want: list[torch.Tensor],
             bound: list[torch.Tensor], where: str, rank: int, r: int, name: str
             ) -> None:
    """Raise unless each of the caller's ``name`` tensors (anchor, params or
    buffers) is the one-process value within its bound."""
    diff = max(((g - w).abs() - b).max().item() for g, w, b in zip(got, want, bound))
    if diff <= 0:
        return
    worst = max((g - w).abs().max().item() for g, w in zip(got, want))
    update = _("the pseudo-gradient is anchor - params; Nesterov: buffer = momentum * "
               "buffer + g, then anchor -= lr * (g + momentum * buffer); update the "
               "tensors you are given in place (the caller keeps them, not the "
               "lists)")
    if name == "buffers":
        raise WrongAnswer(
            _("{where}: after outer step {r}, the momentum buffers on rank {rank} "
              "are not momentum * buffer + the mean pseudo-gradient (largest "
              "difference {diff:.2e}); the next outer step reads them").format(
                  where=where, r=r + 1, rank=rank, diff=worst), update)
    hint = _("every replica restarts from the new anchor: copy it into the "
             "parameters you were given (p.copy_(a))") if name == "params" else update
    what = _("the parameters") if name == "params" else _("the anchor")
    raise WrongAnswer(
        _("{where}: after outer step {r}, {what} on rank {rank} differ from the "
          "one-process anchor (largest difference {diff:.2e})").format(
              where=where, r=r + 1, what=what, rank=rank, diff=worst), hint)
