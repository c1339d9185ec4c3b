"""A worker crash is reattempted and training continues bit for bit; a lost machine is
replaced by a standby."""
import pytest

from jobrun import events, gpt_spec, losses, run_job


@pytest.mark.timeout(400)
def test_crash_reattempt_is_bitwise_equal_to_fault_free(tmp_path):
    base = run_job(tmp_path / "clean", gpt_spec(tp=2, dp=2, steps=40))
    assert base["state"] == "succeeded", base.get("reason")
    assert base["steps_completed"] == 40 and base["incidents"] == []
    rep = run_job(tmp_path / "crash", gpt_spec(tp=2, dp=2, steps=40, chaos=["crash@step=30,machine=1"]))
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["steps_completed"] == 40
    [inc] = rep["incidents"]
    assert inc["mechanism"] == "reattempt"
    assert inc["symptom"] == "worker_crash"
    assert inc["machine_suspects"] == ["m1"] and inc["machines_evicted"] == []
    assert inc["injected_at"] is not None and inc["detected_at"] >= inc["injected_at"]
    assert inc["resumed_at"] > inc["localized_at"] >= inc["detected_at"]
    assert len(rep["runs"]) == 2
    assert losses(rep) == losses(base)          # bit for bit: floats compared exactly
    assert losses(base)[39] < losses(base)[0]
    assert 0 < rep["ettr"] < 1.0 and rep["unproductive_s"]["failover"] > 0   # (load-independent)
    parts = rep["unproductive_s"]
    assert abs(sum(parts.values()) - (rep["wall_s"] - rep["productive_s"])) < 1e-2


@pytest.mark.timeout(300)
def test_machine_down_is_replaced_by_standby(tmp_path):
    rep = run_job(tmp_path / "down", gpt_spec(tp=2, dp=2, steps=30, standby=1,
                                              chaos=["machine-down@step=12,machine=1"]))
    assert rep["state"] == "succeeded", rep.get("reason")
    [inc] = rep["incidents"]
    assert inc["symptom"] == "machine_lost"
    assert inc["machines_evicted"] == ["m1"] and inc["mechanism"] == "evict_restart"
    states = {m["id"]: m["state"] for m in rep["machines"]}
    assert states["m1"] == "evicted"
    assert rep["runs"][-1]["machines"] == {"0": "m0", "1": "m2"}


@pytest.mark.timeout(200)
def test_machine_down_without_standby_fails_clearly(tmp_path):
    rep = run_job(tmp_path / "nostandby", gpt_spec(tp=2, dp=2, steps=30,
                                                   chaos=["machine-down@step=5,machine=0"]))
    assert rep["state"] == "failed"
    assert "standby" in rep["reason"] and "m0" in rep["reason"]
    # the CLI reads the same record offline, as JSON and as an HTML page
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "stalwart.cli", "report", "--state-dir",
                          str(tmp_path / "nostandby"), "--json", str(tmp_path / "r.json"), "--html",
                          str(tmp_path / "r.html")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "failed" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["incidents"][0]["symptom"] == "machine_lost"
    page = (tmp_path / "r.html").read_text()
    assert "<table>" in page and "machine_lost" in page and "ETTR" in page


@pytest.mark.timeout(300)
def test_pool_refills_from_a_spare_and_absorbs_a_second_loss(tmp_path):
    # m2 is the standby, m3 an idle spare; m1 dies, m2 takes over and m3 refills the pool (warm);
    # then m2 dies too and m3 takes over with its pre-started workers
    rep = run_job(tmp_path, gpt_spec(machines=2, gpus=1, steps=60, standby=1,
                                     chaos=["machine-down@step=10,machine=1",
                                            "machine-down@step=35,machine=2"]), spare=1)
    assert rep["state"] == "succeeded", rep.get("reason")
    assert [(i["machines_evicted"], i["mechanism"]) for i in rep["incidents"]] == \
        [(["m1"], "evict_restart"), (["m2"], "evict_restart")]
    assert rep["runs"][-1]["machines"] == {"0": "m0", "1": "m3"}
    assert [e["machine"] for e in events(tmp_path, "standby_added")] == ["m3"]
    last = max(e["run"] for e in events(tmp_path, "workers_started"))
    assert {e["machine"]: e["warm"] for e in events(tmp_path, "workers_started") if e["run"] == last}["m3"]
