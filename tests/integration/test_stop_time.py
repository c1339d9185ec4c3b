"""Stop-time diagnostics on real local clusters — the inter-machine test names a slowed
machine, a crash that goes away is reattempted after the checks pass, a version that keeps crashing
(not a user-code exception) is rolled back after the reattempt, and silent data corruption on one
machine of 4 is found by the bitwise alignment test or, with that disabled, by dual-phase replay."""
import glob
import os
import shutil
import sys

import pytest

from jobrun import gpt_spec, run_job
from test_hot_update import Script, code, statuses

ROOT = os.geteuid() == 0


def incident_data(state_dir, inc_id):
    from stalwart.controller.store.db import Store
    store = Store(f"sqlite:///{state_dir}/stalwart.db")
    try:
        return next(i for i in store.incidents(1) if i["id"] == inc_id)["data"]
    finally:
        store.close()


def three(**kw):
    """3 machines x 1 worker (dp=3; a batch of 12 splits into 3 x 2 micro-batches)."""
    s = gpt_spec(machines=3, gpus=1, **kw)
    s["command"] += ["--batch", "12"]
    return s


def four(**kw):
    """4 machines x 1 worker (dp=4) and one standby."""
    d = dict(machines=4, gpus=1, steps=30, standby=1)
    d.update(kw)
    return gpt_spec(**d)


def slow_link_evicted(tmp_path, rep, culprit="m1", may_time_out=False):
    """The slow machine alone is evicted by the stop-time checks, whose pair test measured every
    pair's bandwidth and flagged exactly the pairs through it; the job completes. With
    `may_time_out` (a link of a few KB/s) a pair through it may also be flagged for getting no
    answer in time instead of a measurement."""
    assert rep["state"] == "succeeded", rep.get("reason")
    evicting = [i for i in rep["incidents"] if i["machines_evicted"]]
    assert len(evicting) == 1, [(i["symptom"], i["cause"]) for i in rep["incidents"]]
    [inc] = evicting
    assert inc["machines_evicted"] == [culprit], inc
    assert inc["mechanism"] == "evict_restart" and "stop-time checks" in inc["cause"], inc
    checks = incident_data(tmp_path, inc["id"])["stop_time_checks"]
    assert list(checks["bad"]) == [culprit], checks["bad"]
    assert checks["bad"][culprit].startswith("inter-machine test failed with every partner"), checks["bad"]
    pairs = checks["pairs"]
    print(f"\n{inc['symptom']}: detected {inc['detection_s']}s after the fault, localized "
          f"{inc['localized_at'] - inc['detected_at']:.1f}s later; pairs: "
          + ", ".join(f"{k} {p['mbps']} Mbit/s{' BAD' if p['bad'] else ''}" for k, p in pairs.items()))
    index = int(culprit[1:])
    through = {k for k in pairs if index in map(int, k.split("-"))}
    assert {k for k, p in pairs.items() if p["bad"]} == through, pairs
    assert all((pairs[k]["mbps"] is not None and pairs[k]["mbps"] < 5) or
               (may_time_out and pairs[k]["mbps"] is None and "no answer" in pairs[k]["detail"])
               for k in through), pairs
    assert all(p["mbps"] > 100 and p["latency_s"] < 0.5 for k, p in pairs.items() if k not in through), pairs
    assert rep["runs"][-1]["machines"][str(index)] != culprit
    return inc


@pytest.mark.timeout(300)
@pytest.mark.skipif(not ROOT or not shutil.which("tc"), reason="link-slow needs root and tc")
def test_slow_link_through_the_hang_path_evicts_only_that_machine(tmp_path):
    """The issue's case: a slow link on one machine of a 4-machine data-parallel job with one
    standby makes a step outlast the hang timeout. The stacks catch healthy ranks mid-step; their
    only shared group is the whole job, which narrows nothing: the checks name the machine."""
    s = four(steps=40, chaos=["link-slow@step=10,machine=1,rate=64kbit"])
    s["policy"].update(hang_timeout_floor_s=3.0, hang_safety_factor=3.0, diag_timeout_s=6.0)
    # (at 64 kbit/s the pair test's exchange may not finish before its deadline: seen in CI)
    inc = slow_link_evicted(tmp_path, run_job(tmp_path, s, timeout=280), may_time_out=True)
    assert inc["symptom"] in ("hang", "fail_slow"), inc


@pytest.mark.timeout(300)
@pytest.mark.skipif(not ROOT or not shutil.which("tc"), reason="link-slow needs root and tc")
def test_slow_link_that_only_slows_the_job_is_found_by_the_pair_test(tmp_path):
    """A link at 3 Mbit/s: every step takes seconds but none outlasts the hang timeout. The time
    goes to communication, not to any rank's compute, so the slowdown goes to the checks (default
    policy)."""
    s = four(steps=40, chaos=["link-slow@step=10,machine=2,rate=3mbit"])
    inc = slow_link_evicted(tmp_path, run_job(tmp_path, s, timeout=280), culprit="m2")
    assert inc["symptom"] == "fail_slow" and "the time went to communication" in inc["cause"], inc


@pytest.mark.timeout(240)
def test_crash_that_goes_away_is_reattempted_after_checks_pass(tmp_path):
    rep = run_job(tmp_path, three(steps=30, chaos=["crash@step=8,machine=1"]))
    assert rep["state"] == "succeeded", rep.get("reason")
    [inc] = rep["incidents"]
    assert (inc["mechanism"], inc["machines_evicted"]) == ("reattempt", [])
    assert "stop-time checks (selftest, intra, inter) passed" in inc["cause"], inc
    checks = incident_data(tmp_path, inc["id"])["stop_time_checks"]
    assert checks["bad"] == {} and len(checks["pairs"]) == 3
    kinds = {(r["machine"], r["check"]) for r in checks["results"] if r["ok"]}
    assert {(m, c) for m in ("m0", "m1", "m2") for c in ("selftest", "intra")} <= kinds


ABORTS = '''
import os
import sys
from stalwart.examples import gpt

START = None

def allreduce_after_a_while(params, group, size, _orig=gpt.allreduce_mean):
    global START
    START = START or 0
    START += 1
    if START > 6:               # a native crash in a new kernel, some steps into every run
        os.abort()
    return _orig(params, group, size)

if __name__ == "__main__":
    gpt.allreduce_mean = allreduce_after_a_while
    sys.exit(gpt.main())
'''


@pytest.mark.timeout(400)
def test_version_that_keeps_crashing_is_rolled_back_after_the_reattempt(tmp_path):
    s = gpt_spec(machines=2, gpus=1, steps=200)
    # >= 50 ms a step: the update (prewarmed for up to a few seconds) lands with steps to spare for
    # two runs of the bad version (each crashes 6 steps in); at full speed the job could end first
    s["command"] = [sys.executable, "train.py", "--layers", "2", "--log-every", "0", "--min-compute-s", "0.05"]
    s["code_dir"] = code(tmp_path, "v1")
    # applied within 2 s (warm or not): the job is short, and this test is about the rollback
    s["policy"]["hot_update_prewarm_s"] = 2.0
    script = Script([(20, {"code": code(tmp_path, "aborts", ABORTS), "mode": "urgent"})])
    rep = run_job(tmp_path / "state", s, during=script, timeout=380)
    assert rep["state"] == "succeeded", rep.get("reason")
    mech = [i["mechanism"] for i in rep["incidents"]]
    assert mech == ["hot_update", "reattempt", "rollback"], [(i["symptom"], i["mechanism"], i["cause"])
                                                              for i in rep["incidents"]]
    crash = rep["incidents"][1]
    assert crash["category"] != "user_code" and "passed" in crash["cause"]
    assert "failed again after a reattempt" in rep["incidents"][2]["cause"]
    assert statuses(tmp_path / "state") == [(1, "stable"), (2, "rolled-back")]


@pytest.mark.timeout(300)
def test_silent_corruption_is_found_by_bitwise_alignment(tmp_path):
    rep = run_job(tmp_path, four(chaos=["sdc@step=10,machine=2"]), timeout=280)
    assert rep["state"] == "succeeded", rep.get("reason")
    inc = rep["incidents"][0]
    assert inc["symptom"] == "nan" and inc["machines_evicted"] == ["m2"], inc
    assert inc["mechanism"] == "evict_restart" and "bitwise alignment" in inc["cause"], inc
    assert len(rep["incidents"]) == 1


@pytest.mark.timeout(400)
def test_silent_corruption_without_alignment_is_found_by_replay(tmp_path):
    s = four(chaos=["sdc@step=10,machine=2"])
    s["policy"].update(alignment_test=False, replay_k=2, replay_steps=4)
    rep = run_job(tmp_path, s, timeout=380)
    assert rep["state"] == "succeeded", rep.get("reason")
    mech = [(i["symptom"], i["mechanism"], i["machines_evicted"]) for i in rep["incidents"]]
    assert mech == [("nan", "reattempt", []), ("nan", "replay", ["m2"])], mech
    replay = incident_data(tmp_path, rep["incidents"][1]["id"])["replay"]
    # k=2 on 4 machines: horizontal {m0,m1},{m2,m3}; vertical {m0,m2},{m1,m3}
    assert (replay["failed_horizontal"], replay["failed_vertical"], replay["machines"]) == ([1], [0], ["m2"])
    assert rep["incidents_by_mechanism"] == {"reattempt": 1, "replay": 1}
    # the replay ran the job's layout on fewer layers (one per pipeline stage)
    logs = [open(p, errors="replace").read() for p in glob.glob(f"{tmp_path}/**/*.err", recursive=True)]
    assert any("replay: 1 of 2 layers" in text for text in logs), len(logs)
