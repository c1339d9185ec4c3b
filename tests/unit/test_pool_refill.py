"""The standby pool's refill never takes a machine the job already holds."""
from __future__ import annotations

from corekit import Harness, of
from stalwart.controller.job import actions as a


def test_a_refill_in_the_tick_that_starts_the_job_does_not_take_an_active_machine_as_a_standby():
    """Fewer machines than slots + standbys: after `max_standby_wait_s` the job starts with the one
    standby there is, and the pool's refill in the same tick (the cluster's free list not yet
    updated by the start's assignments) must not take one of the job's active machines."""
    h = Harness(machines=2, standby=2)          # m0, m1 for the job, m2, m3 for the pool
    h.cluster.dead.add("m3")
    acts = h.tick(h.spec.policy.max_standby_wait_s + 1.0)
    assert of(acts, a.StartRun), acts
    assert h.st.slots == ["m0", "m1"] and h.st.pool.standby == ["m2"]
    standby = [x.machine for x in of(acts, a.AssignMachine) if x.state == "standby"]
    assert standby == ["m2"] and not set(standby) & set(h.st.slots)
    h.cluster.machines.append("m4")            # a machine registers later: the pool takes it
    acts = h.tick(1.5)
    assert [x.machine for x in of(acts, a.AssignMachine) if x.state == "standby"] == ["m4"]
