"""The heartbeat monitor's scan (machines.overdue): which machines are overdue, and the earliest
beat among the others, below which no scan is needed."""
import math
import random

from stalwart.controller.cluster.machines import Machine, overdue


def machines(beats):
    return [Machine(id=f"m{i}", alive=alive, last_beat=t) for i, (alive, t) in enumerate(beats)]


def test_overdue_names_the_silent_alive_machines_and_the_earliest_other_beat():
    ms = machines([(True, 10.0), (True, 6.9), (False, 1.0), (True, 8.5), (True, 7.0)])
    lost, earliest = overdue(ms, now=10.0, limit_s=3.0)
    assert [m.id for m in lost] == ["m1"]          # 3.1 s silent; m4 (exactly 3.0 s) is not
    assert earliest == 7.0                            # the dead m2 and the lost m1 do not count


def test_overdue_with_no_alive_machine_has_no_earliest_beat():
    lost, earliest = overdue(machines([(False, 1.0)]), now=10.0, limit_s=3.0)
    assert lost == [] and earliest == math.inf


def test_no_machine_is_overdue_until_the_earliest_beat_plus_the_limit():
    """The monitor skips its scan while now - limit <= earliest: a scan then would find nobody;
    just after, one would."""
    rng = random.Random(7)
    for _ in range(200):
        ms = machines([(rng.random() < 0.9, rng.uniform(0.0, 10.0)) for _ in range(50)])
        lost, earliest = overdue(ms, now=10.0, limit_s=3.0)
        for m in lost:                      # as the monitor does
            m.alive = False
        assert all(m.last_beat >= earliest for m in ms if m.alive)
        for later in (10.0, 11.0, earliest + 3.0):
            if later - 3.0 <= earliest:
                assert overdue(ms, now=later, limit_s=3.0)[0] == []
        assert earliest in [m.last_beat for m in overdue(ms, now=earliest + 3.01, limit_s=3.0)[0]]


def test_the_monitor_sleeps_until_a_machine_could_be_overdue_within_its_bounds():
    from stalwart.controller.service import ALIVE_EVERY_S, MONITOR_EVERY_S, monitor_wait
    import math
    # earliest beat at 10, limit 3: nobody can be overdue before 13
    assert monitor_wait(12.5, 10.0, 3.0, next_alive=20.0) == 0.5
    assert monitor_wait(12.95, 10.0, 3.0, next_alive=20.0) == MONITOR_EVERY_S     # the floor
    assert monitor_wait(14.0, 10.0, 3.0, next_alive=20.0) == MONITOR_EVERY_S     # overdue already
    assert monitor_wait(10.0, 10.0, 3.0, next_alive=20.0) == ALIVE_EVERY_S       # the cap
    assert abs(monitor_wait(10.0, 10.0, 3.0, next_alive=10.3) - 0.3) < 1e-9     # the alive_at write
    assert monitor_wait(10.0, math.inf, 3.0, next_alive=20.0) == ALIVE_EVERY_S   # no machine
    assert monitor_wait(10.0, math.inf, 0.4, next_alive=20.0) == 0.2             # half a short limit
