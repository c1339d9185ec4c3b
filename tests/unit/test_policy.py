"""The pure decision rules of the controller (policy.py), with an explicit clock."""
from stalwart.controller.cluster import placement
from stalwart.controller.rules import policy
from stalwart.controller.rules.policy import Alert, Evidence, Exit, Snapshot


def snap(**kw):
    d = dict(active=("m0", "m1", "m2", "m3"), standby_ready=("m4",))
    d.update(kw)
    return Snapshot(**d)


def crash(machine="m1", rank=2, secondary=False, t=1.0, **kw):
    return Exit(machine=machine, rank=rank, code=-9, signal=9, symptom="worker_crash", secondary=secondary, t=t, **kw)


def test_crash_without_culprit_is_reattempted_on_same_machines():
    ev = Evidence(exits=(crash("m0", 0, secondary=True, t=1.2), crash("m1", 2, t=1.0)))
    r = policy.resolve(snap(), ev, now=5.0)
    assert r.mechanism == "reattempt" and r.evict == [] and r.suspects == ["m1"]
    assert "rank 2 on m1 killed by SIGKILL" in r.cause


def test_lost_machine_is_evicted_and_replaced():
    ev = Evidence(exits=(crash("m0", 0, secondary=True),), lost=("m2",))
    r = policy.resolve(snap(), ev, now=5.0)
    assert (r.mechanism, r.evict, r.symptom) == ("evict_restart", ["m2"], "machine_lost")
    assert placement.replacement_plan(("m0", "m1", "m2", "m3"), r.evict, ("m4",)) == {"m2": "m4"}


def test_eviction_without_enough_standbys_fails_clearly():
    r = policy.resolve(snap(standby_ready=()), Evidence(lost=("m2", "m3")), now=5.0)
    assert r.mechanism == "fail"
    assert "2 machine(s) evicted (m2, m3)" in r.fail_reason and "0 standby" in r.fail_reason


def test_machine_certain_alert_evicts_at_once_network_alert_needs_two_in_window():
    fatal = Alert("m1", "gpu_lost", "fatal", machine_certain=True, t=10.0)
    assert policy.should_open_incident(fatal, snap(), 10.0)
    net = Alert("m1", "nic_down", "warn", machine_certain=False, network=True, t=10.0)
    assert not policy.should_open_incident(net, snap(), 10.0)
    old = Alert("m1", "nic_down", "warn", False, network=True, t=10.0 - 301)
    assert not policy.should_open_incident(net, snap(recent_alerts=(old,)), 10.0)
    recent = Alert("m1", "nic_down", "warn", False, network=True, t=10.0 - 60)
    assert policy.should_open_incident(net, snap(recent_alerts=(recent,)), 10.0)
    other = Alert("m2", "nic_down", "warn", False, network=True, t=9.0)
    assert not policy.should_open_incident(net, snap(recent_alerts=(other,)), 10.0)
    warn = Alert("m1", "gpu_hot", "warn", machine_certain=False, t=10.0)
    assert not policy.should_open_incident(warn, snap(), 10.0)
    standby = Alert("m4", "gpu_lost", "fatal", machine_certain=True, t=10.0)
    assert not policy.should_open_incident(standby, snap(), 10.0)


def test_fatal_alert_resolution_evicts_that_machine():
    a = Alert("m3", "gpu_lost", "fatal", machine_certain=True, detail="GPU 1 fell off the bus", t=3.0)
    r = policy.resolve(snap(), Evidence(exits=(crash("m3", 6),), alerts=(a,)), now=5.0)
    assert (r.mechanism, r.evict, r.symptom) == ("evict_restart", ["m3"], "gpu_lost")


def test_user_code_exception_fails_the_run():
    e = Exit("m0", 1, 1, None, "user_code_exception", category="user_code", user_code=True,
             detail="ValueError: bad batch", t=1.0)
    r = policy.resolve(snap(), Evidence(exits=(e, crash("m1", 2, secondary=True, t=1.1))), now=2.0)
    assert r.mechanism == "fail" and r.category == "user_code"
    assert "ValueError: bad batch" in r.fail_reason


def test_no_progress_across_restarts_stops_the_job():
    r = policy.resolve(snap(restarts_without_progress=3, max_restarts_without_progress=3),
                       Evidence(exits=(crash(),)), now=1.0)
    assert r.mechanism == "fail" and "no progress across 3 restarts" in r.fail_reason
    r = policy.resolve(snap(restarts_without_progress=2, max_restarts_without_progress=3),
                       Evidence(exits=(crash(),)), now=1.0)
    assert r.mechanism == "reattempt"


def test_cause_in_hand_only_when_more_evidence_cannot_change_the_verdict():
    peer = crash("m0", 0, secondary=True)
    gpu = Alert(machine="m1", kind="gpu_lost", severity="fatal", machine_certain=True, t=1.0)
    nic = Alert(machine="m1", kind="nic_down", severity="fatal", machine_certain=False, network=True, t=1.0)
    assert not policy.cause_in_hand(False, (peer,), (), ())          # only consequences so far
    assert not policy.cause_in_hand(False, (peer,), (nic,), ())      # a network alert may flap
    assert policy.cause_in_hand(False, (peer,), (gpu,), ())
    assert policy.cause_in_hand(False, (peer, crash("m1", 2)), (), ())
    assert policy.cause_in_hand(False, (peer,), (), ("m1",))
    assert policy.cause_in_hand(True, (), (), ())                    # a hot update's stop


def test_a_machine_silent_for_two_beats_after_the_stop_is_lost():
    heard = {"m0": 9.8, "m1": 7.9, "m2": None}
    assert policy.silent_during_stop({"m0", "m1", "m2"}, heard, now=10.0, heartbeat_s=1.0) == ["m1", "m2"]
    assert policy.silent_during_stop({"m0"}, heard, now=10.0, heartbeat_s=1.0) == []
    assert policy.silent_during_stop({"m1"}, heard, now=10.0, heartbeat_s=1.5) == []   # 2.1 s < 2 beats
    # short beats on a quiet host: two intervals are enough
    assert policy.silent_during_stop({"m1"}, {"m1": 9.1}, now=10.0, heartbeat_s=0.5) == []
    assert policy.silent_during_stop({"m1"}, {"m1": 9.0}, now=10.0, heartbeat_s=0.5) == ["m1"]
    # ... a host whose beats came 0.4 s late asks for one interval plus twice that
    assert policy.silent_during_stop({"m1"}, {"m1": 8.8}, now=10.0, heartbeat_s=0.5, late_s=0.4) == []
    assert policy.silent_during_stop({"m1"}, {"m1": 8.7}, now=10.0, heartbeat_s=0.5, late_s=0.4) == ["m1"]
    # ... and a very late beat (a loaded host) never asks for more than the cap
    assert policy.silent_during_stop({"m1"}, {"m1": 8.5}, now=10.0, heartbeat_s=0.5, late_s=5.0) == []
    assert policy.silent_during_stop({"m1"}, {"m1": 7.9}, now=10.0, heartbeat_s=0.5, late_s=5.0) == ["m1"]


def test_the_silence_limit_follows_the_lateness_seen_between_two_beats_and_the_cap():
    assert policy.silence_limit(0.5) == 1.0
    assert policy.silence_limit(0.5, late_s=0.1) == 1.0          # jitter within the two intervals
    assert policy.silence_limit(0.5, late_s=0.5) == 1.5
    assert policy.silence_limit(0.5, late_s=3.0) == policy.SILENT_CAP_S
    assert policy.silence_limit(2.0, late_s=3.0) == 4.0          # the cap never cuts below two beats
    assert policy.silence_limit(0.5, late_s=-1.0) == 1.0         # early beats are no jitter


def net(machine="m1", kind="nic_down", t=10.0, ids=("eth0/link@0#1",), standing=False):
    return Alert(machine, kind, "warn", machine_certain=False, network=True, t=t, occurrences=ids,
                 standing=standing)


def test_one_flap_is_one_occurrence_however_many_alerts_report_it():
    """The probe reports one flap as a down state and then as a carrier change, and a link that
    stays down on every check: each is one occurrence of the network rule."""
    down, flap = net(t=10.0, standing=True), net(kind="nic_flap", t=11.0)
    assert policy.network_occurrences((down, flap), "m1", 11.0, 300.0) == ["eth0/link@0#1"]
    assert not policy.should_open_incident(flap, snap(recent_alerts=(down,)), 11.0)
    stays = tuple(net(t=10.0 + k, standing=True) for k in range(30))
    assert not policy.should_open_incident(stays[-1], snap(recent_alerts=stays[:-1]), 40.0)
    r = policy.resolve(snap(), Evidence(exits=(crash(secondary=True),), alerts=(down, flap)), now=12.0)
    assert (r.mechanism, r.evict) == ("reattempt", [])


def test_a_second_occurrence_within_the_window_evicts_and_is_a_guess():
    first = net(t=10.0, ids=("eth0/link@0#1",))
    second = net(kind="nic_flap", t=70.0, ids=("eth0/link@0#2",))
    assert policy.should_open_incident(second, snap(recent_alerts=(first,)), 70.0)
    late = net(kind="nic_flap", t=400.0, ids=("eth0/link@0#3",))
    assert not policy.should_open_incident(late, snap(recent_alerts=(first,)), 400.0)
    r = policy.resolve(snap(), Evidence(alerts=(first, second)), now=71.0)
    assert (r.mechanism, r.evict, r.certain) == ("evict_restart", ["m1"], False)
    assert "2 occurrences within 300s" in r.cause
    # alerts from probes that name no occurrence count one each (as before)
    assert policy.should_open_incident(net(t=12.0, ids=()), snap(recent_alerts=(net(t=11.0, ids=()),)), 12.0)


def test_a_network_condition_still_standing_when_the_job_failed_names_the_machine():
    down = net(t=10.0, standing=True)
    hang = Evidence(alerts=(down,), implicit_symptom="hang", implicit_reason="hang; stacks inconclusive",
                    standing=("m1",))
    r = policy.resolve(snap(), hang, now=20.0)
    assert (r.mechanism, r.evict, r.symptom, r.certain) == ("evict_restart", ["m1"], "nic_down", False)
    assert "nic_down on m1 still standing when the run stopped making progress" in r.cause
    # ... but not when something certain explains the failure
    gpu = Alert("m2", "gpu_lost", "fatal", machine_certain=True, t=9.0)
    r = policy.resolve(snap(), Evidence(alerts=(gpu, down), standing=("m1",)), now=20.0)
    assert (r.evict, r.certain) == (["m2"], True)


def test_a_certain_eviction_is_certain_a_stack_guess_is_not():
    assert policy.resolve(snap(), Evidence(lost=("m2",)), now=5.0).certain
    r = policy.resolve(snap(), Evidence(implicit_symptom="hang", implicit_evict=("m0", "m1")), now=5.0)
    assert (r.evict, r.certain, r.mechanism) == (["m0", "m1"], False, "fail")
