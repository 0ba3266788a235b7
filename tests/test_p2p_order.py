"""Chapter 6: the pipeline's messages cannot deadlock.

A blocking send may wait until the peer has posted the matching receive, on gloo (its
TCP pair transmits once the receiver has posted its buffer) as on NCCL: two stages that
block sending to each other at the same moment never get through. These tests replay
every stage's batches of point-to-point operations (:func:`p2p_plan`, the list
:func:`pipeline_step` itself follows) under that rule
- an operation completes only when its peer has posted the matching one, a stage posts
its next batch only when the current one has completed, messages between a pair match
in order - and fail on a deadlock or on a receive matched with the wrong message.
The unfused order the chapter used before (each send alone) is shown to deadlock, so the
replay can fail; a gloo run checks that pipeline_step issues exactly the plan.
The step, too, posts a batch only once the one before has completed, but it computes
in between: it waits for a batch's receive before the action's compute and for its
send after it. Another gloo run checks that each send is still in flight when the
next compute starts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.collectives.accounting import count_comms
from dtlib.pipeline_parallel import schedules
from dtlib.pipeline_parallel.schedules import (P2P, SCHEDULES, SPLIT_SCHEDULES, p2p_plan,
                                               pipeline_step, schedule_order)
from dtlib.runtime import launch

Batch = tuple[P2P, ...]


def replay(plans: list[list[Batch]]) -> None:
    """Play each stage's batches under rendezvous semantics.

    Raises:
        AssertionError: a deadlock (naming what each stage waits for) or a receive
            matched with a different message than the one sent.
    """
    n = len(plans)
    pos = [0] * n  # index of the batch each stage has posted
    done: list[set[int]] = [set() for _ in range(n)]  # matched ops of that batch
    while True:
        progressed = False
        for s in range(n):
            while pos[s] < len(plans[s]) and len(done[s]) == len(plans[s][pos[s]]):
                pos[s] += 1
                done[s] = set()
                progressed = True
        for a in range(n):
            if pos[a] >= len(plans[a]):
                continue
            for k, op in enumerate(plans[a][pos[a]]):
                b = op.peer
                if k in done[a] or op.op != "send" or pos[b] >= len(plans[b]):
                    continue
                # the first unmatched receive from a in b's posted batch
                recvs = [(j, r) for j, r in enumerate(plans[b][pos[b]])
                         if r.op == "recv" and r.peer == a and j not in done[b]]
                if not recvs:
                    continue
                j, r = recvs[0]
                assert (r.what, r.mb) == (op.what, op.mb), (
                    f"stage {b} receives {r.what} {r.mb} from stage {a}, which sends "
                    f"{op.what} {op.mb}")
                done[a].add(k)
                done[b].add(j)
                progressed = True
        if all(pos[s] >= len(plans[s]) for s in range(n)):
            return
        if not progressed:
            waits = {s: [o for k, o in enumerate(plans[s][pos[s]]) if k not in done[s]]
                     for s in range(n) if pos[s] < len(plans[s])}
            raise AssertionError(f"deadlock: stages wait for {waits}")


def plans(schedule: str, p: int, m: int) -> list[list[Batch]]:
    return [[b for b, _ in p2p_plan(schedule, s, p, m)] for s in range(p)]


def unfused(schedule: str, stage: int, p: int, m: int) -> list[Batch]:
    """The order before: a blocking receive before an action, its send alone after."""
    out: list[Batch] = []
    for kind, i in schedule_order(schedule, stage, p, m):
        if kind == "F":
            if stage > 0:
                out.append((P2P("recv", "act", i, stage - 1),))
            if stage < p - 1:
                out.append((P2P("send", "act", i, stage + 1),))
        elif kind == "B":
            if stage < p - 1:
                out.append((P2P("recv", "grad", i, stage + 1),))
            if stage > 0:
                out.append((P2P("send", "grad", i, stage - 1),))
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_is_deadlock_free_under_rendezvous(schedule):
    for p in range(2, 7):
        for m in range(1, 13):
            replay(plans(schedule, p, m))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_plan_sends_every_message_once_and_follows_the_schedule(schedule):
    for p in range(1, 7):
        for m in range(1, 13):
            for s in range(p):
                plan = p2p_plan(schedule, s, p, m)
                assert [a for _, a in plan[:-1]] == schedule_order(schedule, s, p, m)
                assert plan[-1][1] is None
                ops = [o for b, _ in plan for o in b]
                n_mid = (s > 0) + (s < p - 1)  # neighbours
                assert len(ops) == 2 * m * n_mid  # each of act, grad: sent + received
                assert len(set(ops)) == len(ops)


def test_the_unfused_1f1b_order_deadlocks():
    # p = 2, m = 4: stage 0 sends activation 1 while stage 1 sends gradient 0.
    with pytest.raises(AssertionError, match="deadlock"):
        replay([unfused("1f1b", s, 2, 4) for s in range(2)])
    replay([unfused("gpipe", s, 2, 4) for s in range(2)])  # GPipe never crosses


def test_a_mismatched_message_is_caught():
    bad = plans("gpipe", 2, 2)
    bad[1][0] = (P2P("recv", "act", 1, 0),)  # stage 1 expects micro-batch 1 first
    with pytest.raises(AssertionError, match="receives act 1"):
        replay(bad)


def issued_batches(schedule: str, m: int) -> dict:
    """On every rank: run pipeline_step on a chain of Linear stages under the one
    recorder; return the messages it issued, as batches of (op, peer stage) pairs (a
    batch: what was issued before the next wait), and the plan's."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    stage = nn.Linear(4, 4)
    x = torch.randn(2 * m, 4)
    with count_comms() as log:
        pipeline_step(stage, x, x, n_microbatches=m, act_shape=(2, 4),
                      loss_fn=lambda out, y: (out - y).square().mean(),
                      schedule=schedule)
    by_seq = {r.seq: r for r in log.records}
    calls: list[list[tuple[str, int]]] = []
    fresh = True
    for kind, seq in log.events:
        rec = by_seq[seq]
        if kind != "issue" or rec.op not in ("send", "recv"):  # a wait, the barrier
            fresh = True                 # that starts the clock, the loss's broadcast
            continue
        if fresh:
            calls.append([])
            fresh = False
        calls[-1].append((rec.op, rec.peer))
    want = [[(o.op, o.peer) for o in b] for b, _ in p2p_plan(schedule, rank, p, m) if b]
    return {"issued": calls, "plan": want}


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_step_issues_exactly_the_plan_on_gloo(world_size):
    for schedule in SCHEDULES:
        for r in launch.spawn(issued_batches, world_size, schedule, 5, timeout=90):
            assert r["issued"] == r["plan"]


def send_waits(schedule: str, m: int) -> dict:
    """On every rank: run pipeline_step on a chain of Linear stages, recording in one
    list when each forward or backward starts and when each message is posted and
    waited for (the works ``batch_isend_irecv`` returns, wrapped); also how far the
    loss and the stage's gradients are from one process's on the whole chain
    (relative to the loss, and to the largest gradient entry)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4) for _ in range(p)]
    x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
    out = x
    for s in stages:
        out = s(out)
    ref_loss = nn.functional.mse_loss(out, y)  # the mean of the equal micro-batches'
    ref_loss.backward()
    ref = [q.grad.clone() for q in stages[rank].parameters()]
    stages[rank].zero_grad()
    trace: list[tuple] = []

    def starts(kind: str):
        trace.append(("compute", kind))

    class Watched:
        def __init__(self, work, k: int) -> None:
            self.work, self.k = work, k

        def wait(self, *a, **kw):
            res = self.work.wait(*a, **kw)
            trace.append(("wait", self.k))
            return res

    real = dist.batch_isend_irecv
    posted: list[str] = []

    def batch_isend_irecv(ops):
        works = real(ops)
        assert len(works) == len(ops)  # gloo: one work per operation
        watched = []
        for op, work in zip(ops, works):
            posted.append("send" if op.op in (dist.isend, dist.distributed_c10d.isend)
                          else "recv")
            trace.append(("post", len(posted) - 1))
            watched.append(Watched(work, len(posted) - 1))
        return watched

    stage = stages[rank]
    stage.register_forward_pre_hook(lambda *_: starts("F"))
    stage.register_full_backward_pre_hook(lambda *_: starts("B"))
    real_w = schedules.backward_weight

    def backward_weight(deferred):  # a split schedule's W is a compute too
        starts("W")
        return real_w(deferred)

    dist.batch_isend_irecv = batch_isend_irecv
    schedules.backward_weight = backward_weight
    try:
        res = pipeline_step(stage, x, y, n_microbatches=m, act_shape=(2, 4),
                            loss_fn=nn.functional.mse_loss, schedule=schedule)
    finally:
        dist.batch_isend_irecv = real
        schedules.backward_weight = real_w
    # per message: computes started before its post, before its wait(s)
    computes = 0
    at_post: dict[int, int] = {}
    at_wait: dict[int, list[int]] = {}
    for ev in trace:
        if ev[0] == "compute":
            computes += 1
        elif ev[0] == "post":
            at_post[ev[1]] = computes
        else:
            at_wait.setdefault(ev[1], []).append(computes)
    scale = max(g.abs().max().item() for g in ref)  # what the bound is relative to
    return {"posted": posted, "at_post": at_post, "at_wait": at_wait,
            "computes": computes,
            "loss_diff": abs(res.loss - ref_loss.item()) / ref_loss.item(),
            "grad_diff": max((g - r).abs().max().item() for g, r in
                             zip((q.grad for q in stage.parameters()), ref)) / scale}


@pytest.mark.parametrize("world_size", [2, 4])
def test_sends_stay_in_flight_during_the_next_compute_on_gloo(world_size):
    """A receive is waited for before the compute that reads it, a send only after the
    next compute has started (the step's last sends at its end); every message once.
    Waiting each whole batch before computing, as the chapter did before, fails."""
    m = 5
    # What the step and one process may differ by (fp32, unit roundoff u = 2^-24):
    # the same sums in another order, each within n*u of the sum of its terms'
    # magnitudes (Higham's gamma_n). A value passes p Linear(4, 4) layers (4 products
    # and a bias each) forward, then back; the loss and a weight gradient sum the
    # batch's 2m rows of 4 columns, split into micro-batch means.
    rel = 2.0 ** -24 * (2 * 5 * world_size + 2 * m * 4)
    for schedule in SCHEDULES:
        for rank, r in enumerate(launch.spawn(send_waits, world_size, schedule, m,
                                              timeout=90)):
            # F and B per micro-batch, and W in a split schedule
            assert r["computes"] == (3 if schedule in SPLIT_SCHEDULES else 2) * m
            assert r["loss_diff"] <= rel and r["grad_diff"] <= rel, (schedule, rank)
            assert set(r["at_wait"]) == set(range(len(r["posted"])))
            overlapped = 0
            for k, op in enumerate(r["posted"]):
                (waited,) = r["at_wait"][k]  # waited for exactly once
                if op == "recv":
                    assert waited == r["at_post"][k], (schedule, rank, k)
                elif r["at_post"][k] < r["computes"]:  # a compute follows the post
                    assert waited == r["at_post"][k] + 1, (schedule, rank, k)
                    overlapped += 1
                else:
                    assert waited == r["computes"], (schedule, rank, k)
            assert overlapped > 0, (schedule, rank)
