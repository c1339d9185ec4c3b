"""One real local cluster per explicit fault kind. Each asserts the symptom, the evicted
machine (or none), that the job finishes (or fails clearly), and that detection time is recorded."""
import os

import pytest

from jobrun import events, gpt_spec, run_job

ROOT = os.geteuid() == 0


def small(**kw):
    """2 active machines x 1 worker (dp=2) and one warm standby: the cheapest job with a spare."""
    d = dict(machines=2, gpus=1, steps=60, standby=1)
    d.update(kw)
    return gpt_spec(**d)


def check_evicted(rep, symptom, machine="m1", steps=60):
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["steps_completed"] == steps
    inc = next(i for i in rep["incidents"] if machine in i["machines_evicted"])
    assert inc["symptom"] == symptom, inc
    assert inc["mechanism"] == "evict_restart"
    assert inc["machines_evicted"] == [machine]
    assert inc["detection_s"] is not None and 0 <= inc["detection_s"] < 5.0, inc
    assert rep["runs"][-1]["machines"]["1"] == "m2"
    return inc


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,symptom", [
    ("gpu-xid", "gpu_xid"),
    ("gpu-lost", "gpu_lost"),
    ("ecc", "ecc_dbe"),
    ("disk-full", "disk_full"),
])
def test_machine_certain_fault_evicts_at_once(tmp_path, kind, symptom):
    rep = run_job(tmp_path, small(chaos=[f"{kind}@step=8,machine=1"]))
    check_evicted(rep, symptom)
    assert len(rep["incidents"]) == 1


@pytest.mark.timeout(240)
def test_crash_is_reattempted_without_eviction(tmp_path):
    rep = run_job(tmp_path, small(standby=0, chaos=["crash@step=8,machine=1"]))
    assert rep["state"] == "succeeded"
    [inc] = rep["incidents"]
    assert (inc["symptom"], inc["mechanism"], inc["machines_evicted"]) == ("worker_crash", "reattempt", [])
    assert inc["detection_s"] is not None and inc["detection_s"] < 2.0


@pytest.mark.timeout(240)
def test_machine_down_is_evicted(tmp_path):
    rep = run_job(tmp_path, small(chaos=["machine-down@step=8,machine=1"]))
    check_evicted(rep, "machine_lost")


@pytest.mark.timeout(240)
def test_user_error_fails_the_job_clearly(tmp_path):
    rep = run_job(tmp_path, small(standby=0, chaos=["user-error@step=8,machine=1"]))
    assert rep["state"] == "failed"
    [inc] = rep["incidents"]
    assert inc["symptom"] == "user_code_exception" and inc["category"] == "user_code"
    assert inc["machines_evicted"] == [] and inc["mechanism"] == "fail"
    assert "user code raised an exception" in rep["reason"] and "gpt.py" in rep["reason"]
    assert inc["detection_s"] is not None


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="network namespaces need root")
@pytest.mark.timeout(240)
def test_nic_down_is_evicted(tmp_path):
    rep = run_job(tmp_path, small(chaos=["nic-down@step=8,machine=1"]))
    inc = check_evicted(rep, "nic_down")
    assert inc["detection_s"] < 10.0


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="network namespaces need root")
@pytest.mark.timeout(240)
def test_nic_flap_twice_within_window_is_evicted(tmp_path):
    rep = run_job(tmp_path, small(steps=90, chaos=["nic-flap@step=4,machine=1",
                                                     "nic-flap@step=40,machine=1"]))
    inc = next(i for i in rep["incidents"] if "m1" in i["machines_evicted"])
    # the probe sees a flap as `nic_flap` (carrier changes) and, when it looks mid-flap, `nic_down`
    check_evicted(rep, inc["symptom"], steps=90)
    assert inc["symptom"] in ("nic_flap", "nic_down")
    assert "on m1: 2 occurrences within 300s" in inc["cause"], inc


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="network namespaces need root")
@pytest.mark.timeout(240)
def test_a_single_nic_flap_evicts_nothing(tmp_path):
    """One flap (down 0.5 s, then up) is one occurrence, however many of the probe's checks report
    it (its down state, its carrier changes): the job trains on and nothing is evicted."""
    rep = run_job(tmp_path, small(steps=40, chaos=["nic-flap@step=8,machine=1,times=1"]))
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["steps_completed"] == 40 and rep["incidents"] == [], rep["incidents"]
    seen = [e["kind"] for e in events(tmp_path, "health") if e["machine"] == "m1"]
    assert "nic_flap" in seen, seen                 # the probe did see it
    assert all(m["state"] != "evicted" for m in rep["machines"]), rep["machines"]
