"""One controller runs several jobs at once on disjoint machines; a job that
finds too few free machines waits (FIFO) until a finished job gives its machines back. Six local
machines: A (2 + 1 standby) and B (2 + 1 standby) each lose a machine to a GPU Xid and complete on
their standby; C (2 machines) waits until one of them ends and then runs on the machines it freed."""
import pytest

from jobrun import gpt_spec, wait_for
from stalwart.backends.local import LocalCluster
from stalwart.transport.client import ApiError
from stalwart.controller.store.db import Store
from stalwart.spec import JobSpec


def spec(steps: int, standby: int, chaos=()) -> dict:
    return JobSpec.from_dict(gpt_spec(machines=2, gpus=1, steps=steps, standby=standby,
                                      chaos=list(chaos))).to_dict()


def job_states(client) -> dict[str, str]:
    """job_id -> state, from the controller's /metrics (read with prometheus_client's parser)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    req = urllib.request.Request(client.url + "/metrics", headers={"Authorization": f"Bearer {client.token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "stalwart_job_state":
            for smp in fam.samples:
                assert smp.labels["job_name"], smp
                if smp.value == 1:
                    assert smp.labels["job_id"] not in out, smp        # one state per job
                    out[smp.labels["job_id"]] = smp.labels["state"]
    return out


def machines_of(rep: dict) -> set[str]:
    return {m for run in rep["runs"] for m in run["machines"].values()}


@pytest.mark.timeout(400)
def test_two_jobs_with_faults_on_disjoint_machines_and_a_third_waits_its_turn(tmp_path):
    cluster = LocalCluster(str(tmp_path), 6, 1, heartbeat_s=0.5, missed_beats=4)
    try:
        cluster.start()
        client = cluster.client(timeout=30)
        a = client.post("/api/jobs", {"spec": spec(100, 1, ["gpu-xid@step=10,machine=1"])})["job"]
        assert wait_for(lambda: client.get(f"/api/jobs/{a}")["live"]["state"] == "running", timeout=60)
        b = client.post("/api/jobs", {"spec": spec(120, 1)})["job"]
        c = client.post("/api/jobs", {"spec": spec(10, 0)})["job"]
        # A holds m0-m2 and B is first in line for m3-m5: nothing can be free for C
        assert client.get(f"/api/jobs/{c}")["live"]["state"] == "waiting"
        lv = client.get(f"/api/jobs/{c}/live")       # (a progress line's poll: no report built)
        assert (lv["state"], lv["live"]["state"], lv["steps_target"]) == ("running", "waiting", 10)
        assert "ettr" not in lv and "incidents" not in lv
        assert wait_for(lambda: (client.get(f"/api/jobs/{b}")["live"] or {}).get("step", 0) >= 10, timeout=120)
        # /metrics describes every job of the controller, each under its own job_id label
        states = job_states(client)
        assert states[str(b)] == "running" and states[str(c)] == "waiting" and str(a) in states, states
        # two jobs run: an action on "latest" must say which job
        with pytest.raises(ApiError, match="say which with --job ID"):
            client.post("/api/jobs/latest/inject", {"chaos": "gpu-xid@machine=4"})
        client.post(f"/api/jobs/{b}/inject", {"chaos": "gpu-xid@machine=4"})     # B's second machine

        def done(job, timeout=240):
            assert wait_for(lambda: client.get(f"/api/jobs/{job}")["state"] not in ("waiting", "running"),
                            timeout=timeout, every=0.5)
            return client.get(f"/api/jobs/{job}")
        ra, rb, rc = done(a), done(b), done(c)
        assert client.get(f"/api/jobs/{a}/live")["ettr"] == ra["ettr"]     # an ended job's: its report
        for rep in (ra, rb, rc):
            assert rep["state"] == "succeeded", rep.get("reason")
        [ia], [ib] = ra["incidents"], rb["incidents"]
        assert (ia["symptom"], ia["machines_evicted"]) == ("gpu_xid", ["m1"])
        assert (ib["symptom"], ib["machines_evicted"]) == ("gpu_xid", ["m4"])
        assert machines_of(ra) == {"m0", "m1", "m2"} and machines_of(rb) == {"m3", "m4", "m5"}
        # C ran on the machines the first job to end gave back (its evicted one excepted), after it ended
        store = Store(f"sqlite:///{tmp_path}/stalwart.db")
        try:
            first = min((a, b), key=lambda j: store.job(j)["finished_at"])
            assert store.runs(c)[0]["started_at"] >= store.job(first)["finished_at"]
        finally:
            store.close()
        # (the first's two, or any two of both if they ended within one tick of each other)
        assert len(machines_of(rc)) == 2 and machines_of(rc) <= {"m0", "m2", "m3", "m5"}
        states = {m["id"]: m["state"] for m in client.get("/api/machines")["machines"]}
        assert states["m1"] == "evicted" and states["m4"] == "evicted"
        assert {m for m, s in states.items() if s == "idle"} == {"m0", "m2", "m3", "m5"}
    finally:
        cluster.stop()
