"""Chapter 6, "The V: two chunks per rank": ZB-V's action lists.

Our lists hold every F, B and W once per micro-batch and chunk and play without
deadlock for every depth and micro-batch count tried; with equal F, B, W times and
m >= 2p every rank holds exactly p whole-stage micro-batches (1F1B's first stage's
peak) and the step is 3m + (p - 1)/2 time units: the only idle is the (p - 1) chunk
forwards (half a stage each) before the last rank's first one, half of ZB-H1's
(p - 1). The times are sums of halves, exact in binary floating point, so the
comparisons are exact. The step-time model's closed form (``zb_v_step``: for equal
times 3m + max((p - 1)/2, 2p - 1 - m) for any m) is held to play_v.

On ranks (``pipeline_step_v``): its message plan (``v_p2p_plan``) is replayed as NCCL
runs it - each pair of ranks shares one stream on which a rank's sends and receives to
the other execute in the order it posted them, an operation completing only with the
matching one at the head of the peer's stream, an action waiting for its receive -
and must neither stall nor match a receive with the wrong message; the order a naive
plan would use (post each receive just before the action that reads it) is shown to
mismatch, so the replay can fail. That our ZB-V trains equal to one process and bit
for bit like torch's ScheduleZBVZeroBubble (which runs these very lists) is checked on
2 and 4 gloo ranks in ``tests/test_interleaved.py``.
"""

from __future__ import annotations

import pytest

from dtlib.pipeline_parallel.schedules import in_flight_peak, schedule_order, simulate
from dtlib.pipeline_parallel.zero_bubble_v import (VMessage, play_v, step_time,
                                                   torch_orders, v_in_flight_peak,
                                                   v_messages, v_p2p_plan, v_stage,
                                                   zbv_order, zbv_orders)
from dtlib.planner.step_time import zb_v_step


@pytest.mark.parametrize("p", range(1, 9))
def test_every_action_once_and_no_deadlock(p: int) -> None:
    for m in range(1, 4 * p + 2):
        orders = zbv_orders(p, m)
        for r, order in enumerate(orders):
            assert sorted(order) == sorted((k, i, c) for k in "FBW" for i in range(m)
                                           for c in (0, 1)), (p, m, r)
            seen: set = set()
            for kind, i, c in order:  # a W after its B, a B after its F
                need = {"W": "B", "B": "F"}.get(kind)
                assert need is None or (need, i, c) in seen, (p, m, r, kind, i, c)
                seen.add((kind, i, c))
        events = play_v(orders)
        assert len(events) == 6 * m * p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_equal_times_idle_is_half_of_zb_h1_at_1f1b_memory(p: int) -> None:
    for m in (2 * p, 2 * p + 1, 4 * p):
        orders = zbv_orders(p, m)
        assert step_time(play_v(orders)) == 3 * m + (p - 1) / 2
        zb_h1 = simulate("zb-h1", p, m, 1.0, 1.0, 1.0)
        assert max(e.end for e in zb_h1) == 3 * m + (p - 1)
        one_f_one_b = in_flight_peak(schedule_order("1f1b", 0, p, m))
        assert [v_in_flight_peak(o) for o in orders] == [one_f_one_b] * p == [p] * p


def test_unequal_times_leave_more_idle() -> None:
    # a B twice an F: the pattern was built for equal times, so ranks wait
    p, m = 4, 16
    equal = step_time(play_v(zbv_orders(p, m))) - 3 * m
    slow_b = step_time(play_v(zbv_orders(p, m), 1.0, 2.0, 1.0)) - 4 * m
    assert slow_b > equal


def test_the_v_placement() -> None:
    assert [v_stage(r, c, 4) for r in range(4) for c in (0, 1)] == \
        [0, 7, 1, 6, 2, 5, 3, 4]
    with pytest.raises(ValueError, match="chunk=2 must be 0 or 1"):
        v_stage(0, 2, 4)
    with pytest.raises(ValueError, match="rank=4 must be in 0..3"):
        zbv_order(4, 4, 8)
    with pytest.raises(ValueError, match="n_microbatches=0 must be a positive"):
        zbv_orders(2, 0)


def test_a_reordered_list_deadlocks_and_says_where() -> None:
    orders = zbv_orders(2, 4)
    orders[1] = orders[1][1:] + orders[1][:1]  # rank 1 waits for its own first F
    with pytest.raises(RuntimeError, match="deadlock at positions"):
        play_v(orders)


class _Act:
    def __init__(self, stage: int, kind: str, mb: int, sub=()) -> None:
        self.stage_index, self.computation_type = stage, kind
        self.microbatch_index, self.sub_actions = mb, sub


def test_torch_actions_read_as_ours() -> None:
    order = {0: [_Act(0, "F", 0), None, _Act(3, "F", 0), _Act(3, "B", 0),
                 _Act(-1, "OVERLAP_F_B", 0, (_Act(0, "F", 1), _Act(0, "I", 0)))],
             1: [_Act(1, "W", 2)]}
    assert torch_orders(order, 2) == [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("W", 0, 1), ("F", 1, 0),
         ("B", 0, 0)], [("W", 2, 0)]]
    with pytest.raises(ValueError, match="not a compute action"):
        torch_orders({0: [_Act(0, "SEND_F", 0)]}, 1)
    with pytest.raises(ValueError, match="stage 0 is not one of its V stages 1, 2"):
        torch_orders({0: [], 1: [_Act(0, "F", 0)]}, 2)


@pytest.mark.parametrize("p", range(1, 9))
def test_the_step_time_models_closed_form_is_the_clock(p: int) -> None:
    # sums of quarters: exact in binary floating point, so compared exactly
    times = [(t, t, t) for t in (0.5, 1.0, 3.0)] + [
        (f, f, w) for f in (0.5, 1.0, 2.0) for w in (0.25, 0.5, 0.75, 1.0) if w < f]
    checked = 0
    for m in range(1, 4 * p + 2):
        orders = zbv_orders(p, m)
        for f, b, w in times:
            try:
                closed = zb_v_step(p, m, f, b, w)
            except ValueError:  # no closed form: only between p and 2p - 1
                assert p < m < 2 * p - 1 and w < f, (p, m, f, w)
                continue
            assert closed == step_time(play_v(orders, f, b, w)), (p, m, f, b, w)
            checked += 1
    assert checked >= 4 * p * len(times) // 2
    with pytest.raises(ValueError, match="t_fwd == t_bwd >= t_w"):
        zb_v_step(4, 8, 1.0, 2.0, 1.0)


def replay_streams(programs: list[list]) -> None:
    """Run every rank's program (:func:`v_p2p_plan`) as NCCL would: a rank posts its
    sends and receives in program order onto one stream per peer; the operations at
    the heads of two peers' streams complete together when they are the two sides of
    one message; an action waits until its receive has completed.

    Raises:
        AssertionError: the heads of a pair's streams are not one message (a receive
            would get another message, or both ranks send or both receive and stall
            forever), or no rank can move (a deadlock), naming where each rank is.
    """
    p = len(programs)
    pos = [0] * p
    streams: dict[tuple[int, int], list[VMessage]] = {}  # (rank, peer) -> posted
    arrived: list[set] = [set() for _ in range(p)]
    while any(pos[r] < len(programs[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(programs[r]):
                item, what = programs[r][pos[r]]
                if item in ("recv", "send"):
                    streams.setdefault((r, what.peer), []).append(what)
                else:
                    recv, _ = v_messages(r, p, what)
                    if recv is not None and recv.key not in arrived[r]:
                        break
                pos[r] += 1
                moved = True
        for (a, b), mine in streams.items():
            theirs = streams.get((b, a), [])
            while mine and theirs:
                x, y = mine[0], theirs[0]
                assert {x.op, y.op} == {"send", "recv"} and x.key == y.key, (
                    f"ranks {a} and {b}: rank {a} posts {x.op} {x.key} while rank "
                    f"{b} posts {y.op} {y.key}")
                mine.pop(0), theirs.pop(0)
                arrived[a if x.op == "recv" else b].add(x.key)
                moved = True
        if not moved:
            raise AssertionError(f"deadlock: ranks at {pos} of "
                                 f"{[len(x) for x in programs]}")
    assert not any(streams.values()), f"unmatched messages: {streams}"


@pytest.mark.parametrize("p", range(1, 9))
def test_the_plan_runs_every_list_as_nccl_would(p: int) -> None:
    for m in range(1, 3 * p + 2):
        orders = zbv_orders(p, m)
        programs = v_p2p_plan(orders)
        for r in range(p):
            assert [w for k, w in programs[r] if k == "run"] == orders[r]
            sends = [w for k, w in programs[r] if k == "send"]
            n_mid = (r > 0) + (r < p - 1)  # neighbours: act and grad, 2 chunks
            assert len(sends) == len(set(sends)) == 2 * m * n_mid
        replay_streams(programs)


def naive_plan(orders: list[list]) -> list[list]:
    """Each receive posted just before the action that reads it."""
    p = len(orders)
    out = []
    for r, order in enumerate(orders):
        prog: list = []
        for action in order:
            recv, send = v_messages(r, p, action)
            prog += ([("recv", recv)] if recv else []) + [("run", action)] + (
                [("send", send)] if send else [])
        out.append(prog)
    return out


def test_the_replay_catches_receives_posted_out_of_the_senders_order() -> None:
    # p = 2, m = 3: rank 1 reads grad 0 before act 2, which rank 0 sends first; the
    # naive streams stall even earlier, both ranks sending at their heads
    with pytest.raises(AssertionError, match="rank 0 posts send .* while rank 1 "
                                             "posts send"):
        replay_streams(naive_plan(zbv_orders(2, 3)))
    replay_streams(naive_plan(zbv_orders(1, 3)))  # one rank: nothing to mismatch
    swapped = v_p2p_plan(zbv_orders(2, 4))
    recvs = [k for k, (item, _) in enumerate(swapped[1]) if item == "recv"]
    a, b = recvs[0], recvs[1]  # act 0 then act 1 from rank 0, posted the other way
    swapped[1][a], swapped[1][b] = swapped[1][b], swapped[1][a]
    with pytest.raises(AssertionError, match="rank 0 posts send .'act', 0, 0. while "
                                             "rank 1 posts recv .'act', 0, 1."):
        replay_streams(swapped)


def test_the_plan_refuses_lists_that_deadlock() -> None:
    orders = zbv_orders(2, 4)
    orders[1] = orders[1][1:] + orders[1][:1]
    with pytest.raises(RuntimeError, match="deadlock at positions"):
        v_p2p_plan(orders)
