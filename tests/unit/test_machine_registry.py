"""The controller's machine registry (controller/cluster/machines.py): roles kept or reset on registration,
the answers to beats and event batches, a job's end, the heartbeat monitor's scan, and the rows
`/api/machines` shows."""
from stalwart import protocol
from stalwart.controller.cluster.beats import BeatLateness
from stalwart.controller.cluster.machines import AgentReply, Registry
from stalwart.controller.cluster.roles import Role

ROW_KEYS = ["id", "state", "address", "registered_at", "last_beat", "alive", "isolated", "job_id", "reason"]


def registry(rows=()):
    return Registry(list(rows), BeatLateness(1.0))


def reg(address="10.0.0.1", **kw):
    return protocol.Registration(address=address, gpus=8, **kw)


def test_a_machine_from_the_store_is_known_but_not_alive_until_it_registers():
    r = registry([{"id": "m1", "state": "active", "job_id": 4, "reason": None, "address": "10.0.0.2",
                   "info": {"peer": ["10.0.0.2", 9100]}, "registered_at": 1.0, "last_beat": 2.0}])
    m = r.get("m1")
    assert m is not None and m.role is Role.ACTIVE and m.job_id == 4 and not m.alive and m.last_beat is None
    assert r.peer_addr("m1") == ("10.0.0.2", 9100)
    assert r.beat("m1", 3.0) is AgentReply.REREGISTER            # known, not alive here: register again
    assert r.events("m1", 3.0) == (AgentReply.REREGISTER, 4)
    assert r.events("m9", 3.0) == (AgentReply.UNKNOWN, None)     # unknown: the batch is not taken
    assert [(a.reregister, a.taken) for a in AgentReply] == [(False, True), (True, True), (True, False)]


def test_registration_keeps_a_jobs_role_and_resets_any_other():
    r = registry([{"id": "m1", "state": "evicted", "job_id": 4, "reason": "xid 79"},
                  {"id": "m2", "state": "provisioning"}])
    m1 = r.register("m1", reg(labels={"switch": "s1"}, isolated=True), 5.0)
    m2 = r.register("m2", reg("10.0.0.3"), 5.0)
    assert (m1.role, m1.job_id, m1.reason, m1.alive, m1.isolated) == (Role.EVICTED, 4, "xid 79", True, True)
    assert (m2.role, m2.job_id) == (Role.IDLE, None)
    assert r.labels("m1") == {"switch": "s1"} and r.free() == ["m2"]
    assert r.beat("m2", 6.0) is AgentReply.OK and r.last_heard("m2") == 6.0
    assert r.events("m1", 6.5) == (AgentReply.OK, 4)


def test_roles_a_job_gives_and_takes_back():
    r = registry()
    for i in (10, 2, 1):
        r.register(f"m{i}", reg(), 1.0)
    assert r.free() == ["m1", "m2", "m10"]                # natural order
    r.assign("m1", Role.ACTIVE, 7)
    r.assign("m2", Role.STANDBY, 7)
    r.assign("m10", Role.EVICTED, 7, reason="nic down")
    r.assign("m3", Role.ACTIVE, 8)                        # not registered yet: added, not alive
    assert r.free() == [] and "m3" in r and not r.alive("m3")
    assert r.release(7, ["m1", "m2", "m10", "m3"]) == ["m1", "m2"]   # its own active and standby only
    assert r.free() == ["m1", "m2"]
    evicted = r.get("m10")
    assert evicted is not None and (evicted.role, evicted.job_id) == (Role.EVICTED, 7)
    assert sorted(r.clear_roles()) == ["m10", "m3"] and r.free() == ["m1", "m2", "m10"]


def test_the_monitor_loses_the_silent_and_a_stall_moves_every_deadline():
    r = registry()
    r.register("m1", reg(), 10.0)
    r.register("m2", reg(), 12.0)
    assert r.lose_overdue(12.5, 3.0) == []
    r.stalled(5.0)                                        # the controller did not run for 5 s
    assert r.lose_overdue(17.5, 3.0) == []                # m1's beat counts as at 15.0
    lost = r.lose_overdue(18.5, 3.0)
    assert [m.id for m in lost] == ["m1"] and not r.alive("m1") and r.alive("m2")
    assert r.earliest_beat == 17.0
    assert r.beat("m1", 19.0) is AgentReply.REREGISTER


def test_rows_are_what_the_api_shows_with_plain_string_states():
    r = registry([{"id": "m2", "state": "standby", "job_id": 1, "registered_at": 1.0}])
    r.register("m1", reg(), 2.0)
    rows = r.rows()
    assert [list(row) for row in rows] == [ROW_KEYS, ROW_KEYS]
    assert [(row["id"], row["state"], type(row["state"])) for row in rows] == [("m1", "idle", str),
                                                                               ("m2", "standby", str)]
    assert rows[0]["address"] == "10.0.0.1" and rows[0]["alive"] and rows[1]["job_id"] == 1
