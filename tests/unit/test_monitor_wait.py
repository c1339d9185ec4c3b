"""The agent's monitor sleeps until its next probe is due, not every tick (agent/monitor.py)."""
from stalwart.agent.monitor import MAX_WAIT_S, Monitor
from stalwart.agent.probes.base import Probe


class _Counting(Probe):
    def __init__(self, name: str, interval_s: float):
        super().__init__()
        self.name, self.interval_s, self.runs = name, interval_s, []

    def check(self, now: float) -> list:
        self.runs.append(now)
        return []


def test_the_monitor_waits_for_the_next_due_probe_within_its_bounds():
    fast, slow = _Counting("kmsg", 0.5), _Counting("gpu", 1.0)
    mon = Monitor([fast, slow], emit=lambda ev: None, tick_s=0.2)
    assert mon.wait_s(100.0) == 0.2                  # never ran: due now, but not a busy loop
    mon._run(force=False)                            # (both run with one `now`)
    now = fast.runs[0]
    assert fast.runs == slow.runs == [now]
    assert abs(mon.wait_s(now) - 0.5) < 1e-9         # the fast one is next
    assert abs(mon.wait_s(now + 0.45) - 0.2) < 1e-9  # due in 0.05 s: the tick is the floor
    assert mon.wait_s(now + 100.0) == 0.2            # overdue
    assert Monitor([], emit=lambda ev: None).wait_s(now) == MAX_WAIT_S
    assert Monitor([_Counting("disk", 60.0)], emit=lambda ev: None).wait_s(now) == 0.2
    quiet = _Counting("disk", 60.0)
    quiet.run(now)
    assert Monitor([quiet], emit=lambda ev: None).wait_s(now) == MAX_WAIT_S


def test_probes_due_together_stay_together():
    """Every probe of a run gets the run's `now`: equal intervals keep equal due times."""
    a, b = _Counting("gpu", 1.0), _Counting("disk", 1.0)
    mon = Monitor([a, b], emit=lambda ev: None)
    mon._run(force=False)
    assert a.next_due() == b.next_due() == a.runs[0] + 1.0
    mon.sweep()
    assert a.next_due() == b.next_due()
