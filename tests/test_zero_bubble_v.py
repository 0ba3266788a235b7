"""Chapter 6, "The V: two chunks per rank": ZB-V's action lists.

Our lists hold every F, B and W once per micro-batch and chunk and play without
deadlock for every depth and micro-batch count tried; with equal F, B, W times and
m >= 2p every rank holds exactly p whole-stage micro-batches (1F1B's first stage's
peak) and the step is 3m + (p - 1)/2 time units: the only idle is the (p - 1) chunk
forwards (half a stage each) before the last rank's first one, half of ZB-H1's
(p - 1). The times are sums of halves, exact in binary floating point, so the
comparisons are exact. That torch's ScheduleZBVZeroBubble runs these very lists is
checked on 2 and 4 gloo ranks in ``tests/test_interleaved.py``.
"""

from __future__ import annotations

import pytest

from dtlib.pipeline_parallel.schedules import in_flight_peak, schedule_order, simulate
from dtlib.pipeline_parallel.zero_bubble_v import (play_v, step_time, torch_orders,
                                                   v_in_flight_peak, v_stage,
                                                   zbv_order, zbv_orders)


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
