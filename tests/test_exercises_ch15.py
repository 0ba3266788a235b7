"""Chapter 15's checker, the outer step: on 2 and 3 real ranks it accepts every
valid spelling (an all-reduce per tensor with AVG, one flattened SUM divided by the
world size, the parameters averaged first, torch's own SGD with the buffers handed
in, a barrier besides) and rejects the plausible wrong ones: plain momentum instead
of Nesterov's, no all-reduce, an all-gather (more bytes), a buffer rebound instead
of updated in place, the sign of the pseudo-gradient flipped, a sum not divided,
the replica not reset to the anchor, an anchor moved by the parameters' mean
plainly, new tensors put into the lists (the caller's are unchanged), momentum kept
elsewhere than the buffers, and a local step whose anchors are averaged afterwards
(right anchor, each rank's own buffer). One launch
per world size runs every answer (the rank-side half); the judging half is applied
to each."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from dtlib.exercises import WrongAnswer
from dtlib.exercises import low_comm as ex
from dtlib.runtime import launch

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _nesterov(a, b, g, lr, momentum):
    b.mul_(momentum).add_(g)
    a.sub_(lr * (g + momentum * b))


def avg_per_tensor(params, anchor, buffers, lr, momentum):
    for p, a, b in zip(params, anchor, buffers):
        g = a - p
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        _nesterov(a, b, g, lr, momentum)
        p.copy_(a)


def sum_flattened(params, anchor, buffers, lr, momentum):
    flat = torch.cat([(a - p).reshape(-1) for p, a in zip(params, anchor)])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, p, a, b in zip(flat.split([a.numel() for a in anchor]), params, anchor,
                          buffers):
        _nesterov(a, b, g.view_as(a), lr, momentum)
        p.copy_(a)


def params_averaged_first(params, anchor, buffers, lr, momentum):
    for p, a, b in zip(params, anchor, buffers):
        dist.all_reduce(p, op=dist.ReduceOp.AVG)
        _nesterov(a, b, a - p, lr, momentum)
        p.copy_(a)


def torch_sgd(params, anchor, buffers, lr, momentum):
    opt = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=True)
    for p, a, b in zip(params, anchor, buffers):
        a.grad = a - p
        dist.all_reduce(a.grad, op=dist.ReduceOp.AVG)
        if b.any():  # torch starts its buffer at the first gradient
            opt.state[a]["momentum_buffer"] = b
    opt.step()
    for p, a, b in zip(params, anchor, buffers):
        if opt.state[a]["momentum_buffer"] is not b:
            b.copy_(opt.state[a]["momentum_buffer"])
        a.grad = None
        p.copy_(a)


def plain_momentum(params, anchor, buffers, lr, momentum):
    for p, a, b in zip(params, anchor, buffers):
        g = a - p
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        b.mul_(momentum).add_(g)
        a.sub_(lr * b)
        p.copy_(a)


def no_all_reduce(params, anchor, buffers, lr, momentum):
    for p, a, b in zip(params, anchor, buffers):
        _nesterov(a, b, a - p, lr, momentum)
        p.copy_(a)


def all_gather(params, anchor, buffers, lr, momentum):
    n = dist.get_world_size()
    for p, a, b in zip(params, anchor, buffers):
        parts = [torch.empty_like(p) for _ in range(n)]
        dist.all_gather(parts, a - p)
        _nesterov(a, b, sum(parts) / n, lr, momentum)
        p.copy_(a)


def buffer_rebound(params, anchor, buffers, lr, momentum):
    for p, a, b in zip(params, anchor, buffers):
        g = a - p
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        b = momentum * b + g
        a.sub_(lr * (g + momentum * b))
        p.copy_(a)


def sign_flipped(params, anchor, buffers, lr, momentum):
    for p, a, b in zip(params, anchor, buffers):
        g = p - a
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        _nesterov(a, b, g, lr, momentum)
        p.copy_(a)


def sum_not_divided(params, anchor, buffers, lr, momentum):
    for p, a, b in zip(params, anchor, buffers):
        g = a - p
        dist.all_reduce(g)
        _nesterov(a, b, g, lr, momentum)
        p.copy_(a)


def replica_not_reset(params, anchor, buffers, lr, momentum):
    for p, a, b in zip(params, anchor, buffers):
        g = a - p
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        _nesterov(a, b, g, lr, momentum)


def with_a_barrier(params, anchor, buffers, lr, momentum):  # sends nothing more
    dist.barrier()
    avg_per_tensor(params, anchor, buffers, lr, momentum)


def lists_rebound(params, anchor, buffers, lr, momentum):  # the caller sees nothing
    gs = [a - p for p, a in zip(params, anchor)]
    for g in gs:
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
    buffers[:] = [momentum * b + g for b, g in zip(buffers, gs)]
    anchor[:] = [a - lr * (g + momentum * b) for a, g, b in zip(anchor, gs, buffers)]
    params[:] = [a.clone() for a in anchor]


def hidden_momentum(params, anchor, buffers, lr, momentum):  # buffers left at zero
    for p, a in zip(params, anchor):
        g = a - p
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        if not hasattr(a, "_mom"):
            a._mom = torch.zeros_like(a)
        _nesterov(a, a._mom, g, lr, momentum)
        p.copy_(a)


def local_step_then_average(params, anchor, buffers, lr, momentum):
    # the anchor comes out right (the step is linear), each rank's buffer is its own
    for p, a, b in zip(params, anchor, buffers):
        _nesterov(a, b, a - p, lr, momentum)
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        p.copy_(a)


def mean_of_params(params, anchor, buffers, lr, momentum):  # local SGD, not DiLoCo
    for p, a, b in zip(params, anchor, buffers):
        dist.all_reduce(p, op=dist.ReduceOp.AVG)
        a.copy_(p)


VALID = [avg_per_tensor, sum_flattened, params_averaged_first, torch_sgd,
         with_a_barrier]
WRONG = [plain_momentum, no_all_reduce, all_gather, buffer_rebound, sign_flipped,
         sum_not_divided, replica_not_reset, mean_of_params, lists_rebound,
         hidden_momentum, local_step_then_average]


def _every_answer(cases: list) -> dict:
    return {fn.__name__: ex.outer_on_rank(fn, cases, ex.OUTER_ROUNDS)
            for fn in VALID + WRONG}


@pytest.fixture(scope="module")
def seen() -> dict:
    cases = ex.outer_cases(12345)
    return {n: (cases, launch.spawn(_every_answer, n, cases, stream=False,
                                    timeout=120)) for n in ex.OUTER_WORLDS}


@pytest.mark.parametrize("n", ex.OUTER_WORLDS)
@pytest.mark.parametrize("fn", VALID, ids=lambda f: f.__name__)
def test_every_valid_spelling_is_accepted(seen, n, fn) -> None:
    cases, ranks = seen[n]
    ex.judge_outer([r[fn.__name__] for r in ranks], cases, n)


@pytest.mark.parametrize("n", ex.OUTER_WORLDS)
@pytest.mark.parametrize("fn", WRONG, ids=lambda f: f.__name__)
def test_every_wrong_answer_is_rejected(seen, n, fn) -> None:
    cases, ranks = seen[n]
    with pytest.raises(WrongAnswer):
        ex.judge_outer([r[fn.__name__] for r in ranks], cases, n)
