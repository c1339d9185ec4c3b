"""Losing the controller costs seconds, never the job.

A controller killed with SIGKILL is restarted by its supervisor (the local cluster, as `stalwart
run` uses it) on the same database; it loads the job's saved state, hears the agents again and
carries on: a run that kept training is adopted, a recovery cut short is finished, the absence is
booked as `control_plane` time, and the controller serves new jobs afterwards.
"""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jobrun import gpt_spec, wait_for
from stalwart.security.auth import create_token_file
from stalwart.agent.workers import kill_tree
from stalwart.backends.local import LocalCluster
from stalwart.transport.client import Client, ControllerUnreachable
from stalwart.chaos.controller import SELF_KILL_FILE
from stalwart.spec import JobSpec


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def controller(tmp_path, port):
    return subprocess.Popen([sys.executable, "-m", "stalwart.cli", "controller", "--db",
                             f"sqlite:///{tmp_path}/stalwart.db", "--listen", f"127.0.0.1:{port}",
                             "--state-dir", str(tmp_path), "--heartbeat", "0.3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def alive_machines(client):
    try:
        return {m["id"] for m in client.get("/api/machines")["machines"] if m.get("alive")}
    except ControllerUnreachable:
        return set()


@pytest.mark.timeout(120)
def test_agent_reregisters_after_controller_restart(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token = create_token_file(str(tmp_path / "token"))      # the controller uses its state dir's
    procs = [controller(tmp_path, port)]
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "stalwart.cli", "agent", "--controller", url,
                                       "--machine-id", "m0", "--workdir", str(tmp_path / "m0"),
                                       "--token-file", str(tmp_path / "token"),
                                       "--heartbeat", "0.3"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        client = Client(url, timeout=2, token=token)
        assert wait_for(lambda: alive_machines(client) == {"m0"})
        kill_tree(procs[0].pid)
        procs[0].wait(timeout=10)
        assert not alive_machines(client)
        procs[0] = controller(tmp_path, port)          # same address, same store
        assert wait_for(lambda: alive_machines(client) == {"m0"}), "agent did not come back"
        assert procs[1].poll() is None                 # the agent never died
    finally:
        for p in procs:
            kill_tree(p.pid)


# -- a job through a controller's death ---------------------------------------------------------------

def status(cluster, job):
    """The job's status, riding out the controller's restart."""
    deadline = time.monotonic() + 90
    while True:
        try:
            return cluster.client(timeout=10).get(f"/api/jobs/{job}")
        except ControllerUnreachable:
            assert time.monotonic() < deadline, "the controller did not come back"
            time.sleep(0.2)


def finish(cluster, job, timeout=300):
    deadline = time.monotonic() + timeout
    while True:
        st = status(cluster, job)
        if st["state"] != "running":
            return st
        assert time.monotonic() < deadline, st.get("live")
        time.sleep(0.3)


def story(db_url: str, job: int = 1) -> list:
    """The job's events but steps and metrics: what to read when a restart test fails."""
    from stalwart.controller.store.db import Store
    store = Store(db_url)
    try:
        return [(round(e["t"] % 1000, 2), e["kind"], e["data"]) for e in store.events(job)
                if e["kind"] not in ("step", "health")]
    finally:
        store.close()


def warnings(state_dir, n: int = 40) -> list[str]:
    """The controller's and agents' warnings: why a machine was called lost, what was refused."""
    out = []
    logs = os.path.join(state_dir, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            out += [f"{name}: {line.rstrip()}" for line in f if " WARNING " in line or " ERROR " in line]
    return out[-n:]


def why(state_dir, db_url, job) -> tuple:
    """What to read when a job here did not succeed: its story and the logs' warnings."""
    return story(db_url or f"sqlite:///{state_dir}/stalwart.db", job), warnings(state_dir)


def controller_pid(state_dir) -> int:
    import json
    with open(os.path.join(state_dir, "controller.json")) as f:
        return json.load(f)["pid"]


def start(state_dir, spec: dict, db_url=None) -> tuple[LocalCluster, int, JobSpec]:
    js = JobSpec.from_dict(spec)
    total = js.machines + int(js.standby)
    cluster = LocalCluster(str(state_dir), total, js.gpus_per_machine, heartbeat_s=js.policy.heartbeat_s,
                           missed_beats=js.policy.missed_beats, db_url=db_url, controller_chaos=True)
    cluster.start()
    job = cluster.client().post("/api/jobs", {"spec": js.to_dict()})["job"]
    return cluster, job, js


def killed_at_step_30(tmp_path, db_url=None):
    cluster, job, _ = start(tmp_path, gpt_spec(machines=4, gpus=2, tp=2, pp=2, dp=2, steps=60), db_url)
    try:
        assert wait_for(lambda: (status(cluster, job).get("live") or {}).get("step", 0) >= 30, timeout=180)
        pid = controller_pid(tmp_path)
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: cluster.controller_restarts == 1, timeout=60)
        assert controller_pid(tmp_path) != pid
        rep = finish(cluster, job)
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path, db_url, job))
        assert rep["steps_completed"] == 60
        assert len(rep["runs"]) == 1 and rep["incidents"] == []        # the same run went on
        [gap] = rep["control_plane"]
        assert 0 < gap["seconds"] < 60 and gap["reconciled_at"] >= gap["up_at"] >= gap["down_at"]
        parts = rep["unproductive_s"]
        assert "control_plane" in parts
        assert abs(sum(parts.values()) - (rep["wall_s"] - rep["productive_s"])) < 1e-2
        # the machines went back to the pool: a second job starts and runs
        second = cluster.client().post("/api/jobs", {"spec": JobSpec.from_dict(
            gpt_spec(machines=2, gpus=2, tp=2, dp=2, steps=5)).to_dict()})["job"]
        rep2 = finish(cluster, second, timeout=180)
        assert rep2["state"] == "succeeded" and rep2["steps_completed"] == 5, rep2.get("reason")
    finally:
        cluster.stop()


@pytest.mark.timeout(480)
def test_controller_killed_mid_training_the_run_goes_on(tmp_path):
    killed_at_step_30(tmp_path)


@pytest.mark.postgres
@pytest.mark.timeout(480)
def test_controller_killed_mid_training_on_postgresql(tmp_path, pg_url):
    killed_at_step_30(tmp_path, db_url=pg_url)


def arm(state_dir, phase: str) -> None:
    os.makedirs(os.path.join(state_dir, "chaos"), exist_ok=True)
    with open(os.path.join(state_dir, SELF_KILL_FILE), "w") as f:
        f.write(phase)


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
@pytest.mark.timeout(480)
def test_controller_killed_during_recovery_and_during_checks(tmp_path, store, request):
    db_url = request.getfixturevalue("pg_url") if store == "postgresql" else None
    # 1. a machine-certain fault (Xid 79 on m1); the controller dies right after it stopped the run
    cluster, job, _ = start(tmp_path / "a", gpt_spec(machines=2, gpus=2, tp=2, dp=2, steps=40, standby=1,
                                                     chaos=["gpu-xid@step=12,machine=1"]), db_url)
    try:
        arm(tmp_path / "a", "recovering")
        rep = finish(cluster, job)
        assert cluster.controller_restarts == 1
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path / "a", db_url, job))
        [inc] = rep["incidents"]
        assert inc["symptom"] == "gpu_xid" and inc["machines_evicted"] == ["m1"]
        assert {m["id"]: m["state"] for m in rep["machines"]}["m1"] == "evicted"
        assert rep["runs"][-1]["machines"] == {"0": "m0", "1": "m2"}
        assert len(rep["control_plane"]) == 1
    finally:
        cluster.stop()
    # 2. a crash with no culprit; the controller dies while the stop-time checks run
    cluster, job, _ = start(tmp_path / "b", gpt_spec(machines=2, gpus=2, tp=2, dp=2, steps=40,
                                                     chaos=["crash@step=12,machine=1"]), db_url)
    try:
        arm(tmp_path / "b", "diagnosing")
        rep = finish(cluster, job)
        assert cluster.controller_restarts == 1
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path / "b", db_url, job))
        [inc] = rep["incidents"]
        assert inc["mechanism"] == "reattempt" and inc["machines_evicted"] == []
        assert inc["stop_time_checks"]["checks"] == ["selftest", "intra", "inter"]
        assert not inc["stop_time_checks"]["bad"]
    finally:
        cluster.stop()
