"""Chapters 5 and 6: the exercises' checkers reject each kind of wrong answer and accept
the valid alternatives.

Chapter 6's GPipe step is checked on two real ranks for its numbers *and* its order: a
step that computes the right gradients one micro-batch at a time, or holds its messages
back, is not a pipeline and must be rejected; isend/irecv, a prefetched receive,
batch_isend_irecv and newest-first backwards are GPipe too and must pass. All of these
answers are judged in one launch of two ranks (each on both of the checker's shapes).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.exercises import WrongAnswer
from dtlib.exercises import pipeline_parallel as ex

# ---- Chapter 6: when does the first backward start? ----------------------------------


def _first_backward(schedule, stage, p, m, t_f, t_b):
    forwards = m if schedule == "gpipe" else 1
    return (p - 1 + forwards) * t_f + (p - 1 - stage) * t_b


def _first_backward_walked(schedule, stage, p, m, t_f, t_b):
    """The same, found by walking the micro-batch down and back, step by step."""
    mb = m - 1 if schedule == "gpipe" else 0
    t = (mb + 1) * t_f  # stage 0 finishes this micro-batch's forward
    for _ in range(1, p):
        t += t_f  # one more stage's forward
    for _ in range(stage, p - 1):
        t += t_b  # the gradient comes back through the later stages
    return t


def test_first_backward_accepts_the_formula_and_a_walk(capsys) -> None:
    ex.check_first_backward(_first_backward)
    ex.check_first_backward(_first_backward_walked)
    assert capsys.readouterr().out.count("Correct") == 2


@pytest.mark.parametrize("wrong", [
    # 1F1B's answer for GPipe too: GPipe's first backward waits for every forward
    lambda sch, s, p, m, tf, tb: p * tf + (p - 1 - s) * tb,
    # the gradient's way back costs nothing
    lambda sch, s, p, m, tf, tb: (p - 1 + (m if sch == "gpipe" else 1)) * tf,
    # counted from the wrong end of the pipeline
    lambda sch, s, p, m, tf, tb: (p - 1 + (m if sch == "gpipe" else 1)) * tf + s * tb,
    # read off the page's figure (t_f = 1, t_b = 2), true only there
    lambda sch, s, p, m, tf, tb: p - 1 + (m if sch == "gpipe" else 1) + 2 * (p - 1 - s),
    lambda sch, s, p, m, tf, tb: "soon",
])
def test_first_backward_rejects(wrong) -> None:
    with pytest.raises(WrongAnswer):
        ex.check_first_backward(wrong)


def test_first_backward_stub_is_not_attempted(capsys) -> None:
    def first_backward(schedule, stage, p, m, t_f, t_b):
        raise NotImplementedError

    ex.check_first_backward(first_backward)
    assert "not attempted yet" in capsys.readouterr().out.lower()


# ---- Chapter 6: one GPipe step on two ranks, pipelined -------------------------------

def _gpipe_alternatives(stage, micro_batches, targets, act_shape):
    """GPipe with isend/irecv: rank 1 prefetches the next activation while it computes
    the current one, and both ranks run their backwards newest first."""
    if dist.get_rank() == 0:
        outs = []
        for x in micro_batches:
            y = stage(x)
            dist.isend(y.detach(), dst=1).wait()
            outs.append(y)
        for y in reversed(outs):
            grad = torch.empty_like(y)
            dist.irecv(grad, src=1).wait()
            y.backward(grad)
        return None
    m = len(targets)
    bufs = [torch.empty(act_shape) for _ in range(m)]
    reqs = [dist.irecv(bufs[0], src=0)]
    inputs, losses = [], []
    for i, t in enumerate(targets):
        reqs[i].wait()
        if i + 1 < m:
            reqs.append(dist.irecv(bufs[i + 1], src=0))  # the next one, in advance
        a = bufs[i].requires_grad_()
        inputs.append(a)
        losses.append(F.mse_loss(stage(a), t) / m)
    for a, loss in reversed(list(zip(inputs, losses))):
        loss.backward()
        dist.send(a.grad, dst=0)
    return sum(loss.item() for loss in losses)


def _gpipe_batched(stage, micro_batches, targets, act_shape):
    """GPipe whose every message goes through batch_isend_irecv (one op per batch)."""
    def exchange(op, tensor, peer):
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)]):
            work.wait()

    if dist.get_rank() == 0:
        outs = []
        for x in micro_batches:
            y = stage(x)
            exchange(dist.isend, y.detach(), 1)
            outs.append(y)
        for y in outs:
            grad = torch.empty_like(y)
            exchange(dist.irecv, grad, 1)
            y.backward(grad)
        return None
    inputs, losses = [], []
    for t in targets:
        a = torch.empty(act_shape)
        exchange(dist.irecv, a, 0)
        inputs.append(a.requires_grad_())
        losses.append(F.mse_loss(stage(a), t) / len(targets))
    for a, loss in zip(inputs, losses):
        loss.backward()
        exchange(dist.isend, a.grad, 0)
    return sum(loss.detach() for loss in losses).item()


def _one_at_a_time(stage, micro_batches, targets, act_shape):
    """Right numbers, no pipeline: each micro-batch's forward and backward, then the
    next one's."""
    if dist.get_rank() == 0:
        for x in micro_batches:
            y = stage(x)
            dist.send(y.detach(), dst=1)
            grad = torch.empty_like(y)
            dist.recv(grad, src=1)
            y.backward(grad)
        return None
    total = 0.0
    for t in targets:
        a = torch.empty(act_shape)
        dist.recv(a, src=0)
        a.requires_grad_()
        loss = F.mse_loss(stage(a), t) / len(targets)
        loss.backward()
        dist.send(a.grad, dst=0)
        total += loss.item()
    return total


def _sends_after_all_forwards(stage, micro_batches, targets, act_shape):
    """Rank 0 computes every forward before sending the first activation (and rank 1
    receives every activation before computing the first)."""
    if dist.get_rank() == 0:
        outs = [stage(x) for x in micro_batches]
        for y in outs:
            dist.send(y.detach(), dst=1)
        for y in outs:
            grad = torch.empty_like(y)
            dist.recv(grad, src=1)
            y.backward(grad)
        return None
    acts = [torch.empty(act_shape) for _ in targets]
    for a in acts:
        dist.recv(a, src=0)
    losses = [F.mse_loss(stage(a.requires_grad_()), t) / len(targets)
              for a, t in zip(acts, targets)]
    for a, loss in zip(acts, losses):
        loss.backward()
        dist.send(a.grad, dst=0)
    return sum(loss.item() for loss in losses)


def _one_message_each_way(stage, micro_batches, targets, act_shape):
    """Every activation in one concatenated message, every gradient in another."""
    m = len(micro_batches) if micro_batches is not None else len(targets)
    if dist.get_rank() == 0:
        outs = [stage(x) for x in micro_batches]
        dist.send(torch.cat([y.detach() for y in outs]), dst=1)
        grads = torch.empty(m * act_shape[0], *act_shape[1:])
        dist.recv(grads, src=1)
        for y, g in zip(outs, grads.split(act_shape[0])):
            y.backward(g)
        return None
    acts = torch.empty(m * act_shape[0], *act_shape[1:])
    dist.recv(acts, src=0)
    acts.requires_grad_()
    loss = sum(F.mse_loss(stage(a), t) / m
               for a, t in zip(acts.split(act_shape[0]), targets))
    loss.backward()
    dist.send(acts.grad, dst=0)
    return loss.item()


def _rank1_receives_all_first(stage, micro_batches, targets, act_shape):
    """Rank 0 is GPipe; rank 1 takes in every activation before its first forward."""
    if dist.get_rank() == 0:
        return _gpipe_alternatives(stage, micro_batches, targets, act_shape)
    acts = [torch.empty(act_shape) for _ in targets]
    for a in acts:
        dist.recv(a, src=0)
    losses = []
    for a, t in zip(acts, targets):
        losses.append(F.mse_loss(stage(a.requires_grad_()), t) / len(targets))
    for a, loss in reversed(list(zip(acts, losses))):
        loss.backward()
        dist.send(a.grad, dst=0)
    return sum(loss.item() for loss in losses)


# valid alternatives to the page's solution (which tests/test_exercises.py runs)
VALID = [_gpipe_alternatives, _gpipe_batched]
# each wrong kind, and the message that names it; all judged in one launch
NOT_PIPELINED = [
    (_one_at_a_time, "A backward runs before the last forward"),
    (_sends_after_all_forwards, "rank 0 .* leaves only after the next micro-batch's"),
    (_one_message_each_way, "That is 1 sends for 3 micro-batches"),
    (_rank1_receives_all_first, "rank 1 .* starts only after message 1 has been"),
]


@pytest.fixture(scope="module")
def verdicts() -> list:
    """One launch of two ranks judges the valid alternative and every wrong kind."""
    return ex.pipeline_step_verdicts(VALID + [step for step, _ in NOT_PIPELINED])


def test_pipeline_step_accepts_the_valid_alternatives(verdicts) -> None:
    for step, verdict in zip(VALID, verdicts):
        assert verdict is None, (step.__name__, str(verdict))


def test_pipeline_step_rejects_each_step_that_is_not_pipelined(verdicts) -> None:
    for (step, message), verdict in zip(NOT_PIPELINED, verdicts[len(VALID):]):
        assert verdict is not None, f"{step.__name__} passed"
        assert re.search(message, str(verdict), re.S), (step.__name__, str(verdict))


# ---- Chapter 6: B now, W later, on two ranks -----------------------------------------

def _b(out, grad, x, params):
    x_grad = None
    if x is not None:
        (x_grad,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    return x_grad, (out, grad)


def _w(saved, params):
    out, grad = saved
    for p, g in zip(params, torch.autograd.grad(out, params, grad)):
        p.grad = g if p.grad is None else p.grad + g


def _b_backward_inputs(out, grad, x, params):
    """Another spelling: backward() limited to the input."""
    if x is None:
        return None, (out, grad)
    out.backward(grad, inputs=[x], retain_graph=True)
    return x.grad, (out, grad)


def _w_backward_inputs(saved, params):
    """backward() limited to the parameters accumulates into .grad itself."""
    out, grad = saved
    out.backward(grad, inputs=list(params))


def _b_fused(out, grad, x, params):
    """The whole backward at B: the weights' gradients too."""
    out.backward(grad, retain_graph=True)
    return (None if x is None else x.grad), None


def _w_nothing(saved, params):
    pass


def _b_weights_kept(out, grad, x, params):
    """The weight gradients computed at B and only added at W."""
    wanted = ([x] if x is not None else []) + list(params)
    got = torch.autograd.grad(out, wanted, grad)
    return (got[0] if x is not None else None), got[-len(params):]


def _w_add_kept(saved, params):
    for p, g in zip(params, saved):
        p.grad = g if p.grad is None else p.grad + g


def _w_replaces(saved, params):
    out, grad = saved
    for p, g in zip(params, torch.autograd.grad(out, params, grad)):
        p.grad = g


def _b_frees_graph(out, grad, x, params):
    x_grad = None
    if x is not None:
        (x_grad,) = torch.autograd.grad(out, [x], grad)
    return x_grad, (out, grad)


def _b_books(out, grad, x, params):
    from dtlib.pipeline_parallel.zero_bubble import backward_input
    return backward_input(out, grad, x, [])


@pytest.mark.parametrize("b, w", [(_b, _w), (_b_backward_inputs, _w_backward_inputs)])
def test_split_backward_accepts_valid_spellings(b, w, capsys) -> None:
    ex.check_split_backward(b, w, seed=3)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("b, w, says", [
    (_b_fused, _w_nothing, "your B computed weight gradients"),
    (_b_weights_kept, _w_add_kept, "your B computed weight gradients"),
    (_b, _w_replaces, "not one process's"),
    (_b_frees_graph, _w, "retain_graph|second time"),
    (_b_books, _w, "book's own B"),
])
def test_split_backward_rejects(b, w, says) -> None:
    with pytest.raises(WrongAnswer, match=says):
        ex.check_split_backward(b, w, seed=4)
