"""The whole-job heartbeat queries of a `ClusterView` (`freshest`, `unheard_since`), which the stop's
silence check asks at every tick, agree with `last_heard` asked machine by machine; the simulated
cluster answers them from its dead machines alone."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from stalwart import protocol
from stalwart.controller.cluster.beats import BeatLateness
from stalwart.controller.cluster.machines import Registry
from stalwart.controller.rules import policy
from stalwart.controller.service import MachineView
from stalwart.sim.cluster import SimCluster


def per_machine_freshest(view, machines):
    return max((t for t in map(view.last_heard, machines) if t is not None), default=None)


def per_machine_unheard(view, machines, t):
    return {m: h for m in machines if (h := view.last_heard(m)) is None or h <= t}


@pytest.mark.parametrize("seed", range(5))
def test_sim_cluster_answers_as_last_heard_machine_by_machine(seed):
    rng = random.Random(seed)
    c = SimCluster(32, 4, 8, free=4, seed=seed)
    machines = list(c.order) + ["unknown"]
    c.now = 100.0
    for m in rng.sample(machines[:-1], 6):       # machines die at various times before now
        c.now = rng.uniform(90.0, 100.0)
        c.kill(m)
    c.now = 100.0
    for subset in (machines, machines[:8], [m for m in machines if m in c.dead_at], []):
        assert c.freshest(subset) == per_machine_freshest(c, subset)
        for t in (89.0, 95.0, 99.5, 100.0, 120.0):
            assert c.unheard_since(set(subset), t) == per_machine_unheard(c, subset, t)


def test_the_silence_rule_on_the_machines_named_equals_the_rule_on_every_machine():
    """check_stopped asks the cluster for the machines unheard since just short of the silence
    limit and judges those: the same machines lost, in the same order, as judging every one."""
    c = SimCluster(16, 4, 4, free=0, seed=1)
    c.now = 50.0
    for m, at in (("m3", 10.0), ("m7", 48.5), ("m9", 48.0), ("m12", 49.9)):
        c.dead_at[m] = at
    awaiting = set(c.order[:12]) | {"gone"}
    slots = set(c.order)
    for late in (0.0, 0.3, 5.0):
        latest = c.freshest(c.order)
        assert latest is not None
        full = {m: c.last_heard(m) for m in awaiting if m in slots}
        want = policy.silent_during_stop(awaiting, full, latest, 1.0, late)
        near = latest - policy.silence_limit(1.0, late) + 1e-3
        heard = c.unheard_since(awaiting & slots, near)
        heard.update(dict.fromkeys(awaiting - slots))
        assert policy.silent_during_stop(heard, heard, latest, 1.0, late) == want
        assert "gone" in want and "m3" in want and "m12" not in want


def test_the_controller_s_view_answers_from_its_registry_machine_by_machine():
    """The real controller's `MachineView`: registered machines beating at different times, one
    known from the store but never heard, one unknown."""
    reg = Registry([{"id": "m9", "state": "active", "job_id": 1, "reason": None}], BeatLateness(1.0))
    for i, t in enumerate((10.0, 12.0, 15.5, 16.0)):
        reg.register(f"m{i}", protocol.Registration(address=f"10.0.0.{i}", gpus=8), t)
    view = MachineView(SimpleNamespace(registry=reg), job_id=1)
    machines = ["m0", "m1", "m2", "m3", "m9", "nobody"]
    assert view.freshest(machines) == per_machine_freshest(view, machines) == 16.0
    assert view.freshest(["m9", "nobody"]) is None
    for t in (9.0, 12.0, 15.9, 20.0):
        assert view.unheard_since(set(machines), t) == per_machine_unheard(view, machines, t)
    assert view.unheard_since(set(machines), 12.0) == {"m0": 10.0, "m1": 12.0, "m9": None, "nobody": None}
