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
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.collectives.accounting import count_comms
from dtlib.pipeline_parallel.schedules import (P2P, SCHEDULES, p2p_plan, pipeline_step,
                                               schedule_order)
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
        else:
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
