"""Backup pacing (agent/pacing.py): the pace from measured costs, the due steps, the flush at a stop."""
import math

import pytest

from stalwart.agent import pacing
from stalwart.agent.pacing import Lane


def measured(step_s: float, cost_s: float) -> Lane:
    return Lane(step_s=step_s, cost_s=cost_s)


def test_every_step_until_measured():
    assert pacing.interval(Lane(), pacing.AUTO, cap=8) == 1
    assert pacing.interval(Lane(step_s=0.02), pacing.AUTO, cap=8) == 1     # no push measured yet
    assert pacing.interval(Lane(cost_s=0.001), pacing.AUTO, cap=8) == 1    # no step time yet


def test_cheap_pushes_every_step():
    # a GPU job: 1 ms of CPU a push (2 ms both ends) against a 500 ms step is 0.4%
    assert pacing.interval(measured(0.5, 0.001), pacing.AUTO, cap=8) == 1


@pytest.mark.parametrize("step_s,cost_s,k", [
    (0.035, 0.0003, 1),      # 0.6 ms both ends / 35 ms = 1.7% <= 2%
    (0.035, 0.0005, 2),      # 1.0 ms: 2.9% a step, 1.4% every 2
    (0.035, 0.0011, 4),      # 2.2 ms: 6.3%, 3.1% every 2, 1.6% every 4
    (0.010, 0.0011, 8),      # 22% -> every 16 would fit; the cap is 8
])
def test_adaptive_pace_is_the_smallest_power_of_two_within_budget(step_s, cost_s, k):
    assert pacing.interval(measured(step_s, cost_s), pacing.AUTO, cap=8) == k
    if k < 8:       # within the budget at k, over it at k / 2
        share = lambda n: pacing.RECEIVER_FACTOR * cost_s / (n * step_s)  # noqa: E731
        assert share(k) <= pacing.BUDGET + 1e-12
        assert k == 1 or share(k // 2) > pacing.BUDGET


def test_cap_bounds_every_pace():
    lane = measured(0.01, 0.01)
    assert pacing.interval(lane, pacing.AUTO, cap=2) == 2          # mem_slots 4: own holds 3 steps
    assert pacing.interval(lane, pacing.AUTO, cap=3) == 2          # powers of two only: grids nest
    assert pacing.interval(lane, 5, cap=2) == 2                    # a set pace is cut to the cap too
    assert pacing.interval(lane, 5, cap=8) == 5
    assert pacing.interval(lane, pacing.AUTO, cap=0) == 1


def test_due_on_the_grid_and_never_more_than_k_apart():
    lane, pushed = Lane(), []
    for step in range(20):
        if pacing.due(lane, step, 4):
            lane = pacing.pushing(lane, step)
            pushed.append(step)
    assert pushed == [3, 7, 11, 15, 19]
    # announcements that skip the grid step (two steps committed at once): the newest goes when
    # the rank has gone k steps without a push
    lane = pacing.pushing(Lane(), 3)
    assert not pacing.due(lane, 5, 4) and not pacing.due(lane, 6, 4)
    assert pacing.due(lane, 8, 4)           # step 7 was never seen; 8 is 5 steps after 3
    assert not pacing.due(lane, 3, 1) and pacing.due(lane, 4, 1)


def test_nested_grids_share_their_coarsest_steps():
    # ranks paced at 1, 2 and 4 all push the steps on the grid of 4
    grids = [{s for s in range(32) if pacing.due(Lane(pushed=s - 1), s, k)} for k in (1, 2, 4)]
    assert {s for s in range(32) if (s + 1) % 4 == 0} <= set.intersection(*grids)


def test_step_time_and_cost_are_running_averages():
    lane = pacing.observe_step(Lane(), 10, now=100.0)
    assert lane.step_s is None and lane.newest == 10
    lane = pacing.observe_step(lane, 12, now=100.1)                # two steps in 0.1 s
    assert lane.step_s == pytest.approx(0.05)
    assert pacing.observe_step(lane, 11, now=101.0) is lane        # an older step changes nothing
    lane = pacing.observe_step(lane, 13, now=100.15)
    assert lane.step_s == pytest.approx(0.8 * 0.05 + 0.2 * 0.05)
    lane = pacing.observe_push(lane, 0.002)
    assert lane.cost_s == pytest.approx(0.002)
    lane = pacing.observe_push(lane, 0.004)
    assert lane.cost_s == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)
    assert pacing.observe_push(lane, math.nan) is lane and pacing.observe_push(lane, -1.0) is lane


def test_flush_names_the_newest_step_not_pushed():
    lane = pacing.observe_step(Lane(), 6, now=1.0)
    assert pacing.flush(lane) == 6
    lane = pacing.pushing(lane, 6)
    assert pacing.flush(lane) is None
    lane = pacing.observe_step(lane, 7, now=1.02)
    assert pacing.flush(lane) == 7
