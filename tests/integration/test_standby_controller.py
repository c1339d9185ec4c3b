"""Several controllers on one PostgreSQL database: one holds the lease and acts, standbys wait.

One job, two losses of the active controller: SIGKILL at step 30 (the first standby takes over and
the same run goes on), then SIGSTOP of the new active one (the second standby takes over); woken
afterwards, the paused controller must not act: its first write fails the fence and it exits with
its own code. The agents know every controller's URL and follow whichever answers."""
import os
import signal
import sys
import time

import pytest

from jobrun import wait_for
from stalwart.controller.store.lease import EXIT_LEASE_LOST
from stalwart.controller.store.db import Store
from stalwart.spec import JobSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from controller_failover import HaCluster, controller_pid, gpt, wait_step  # noqa: E402

pytestmark = pytest.mark.postgres
STEPS = 400         # (workers train on while no controller acts: room for two takeovers)


def log_says(path, text: str) -> bool:
    try:
        with open(path) as f:
            return text in f.read()
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_standbys_take_over_a_killed_and_a_paused_controller(tmp_path, pg_url):
    cluster = HaCluster(str(tmp_path), 4, 2, pg_url, standbys=2, heartbeat_s=0.5, missed_beats=4)
    try:
        cluster.start()
        b = cluster.standby(1)
        job = cluster.client().post("/api/jobs", {"spec": JobSpec.from_dict(gpt(STEPS)).to_dict()})["job"]
        clients = [cluster.client_of(i) for i in range(3)]
        _, s0 = wait_step(clients, job, 29, 180)
        a_pid = controller_pid(tmp_path)
        os.kill(a_pid, signal.SIGKILL)
        t_kill = time.monotonic()
        t_next, s1 = wait_step(clients, job, s0, 60)
        print(f"kill -9 at step {s0} -> step {s1} through the standby in {t_next - t_kill:.2f}s")
        assert wait_for(lambda: controller_pid(tmp_path) == b.pid, timeout=10)   # b is active now
        c = cluster.standby(2)
        assert wait_for(lambda: log_says(tmp_path / "logs" / "controller-2.log", "standby: c1 holds the lease"),
                        timeout=30)
        os.kill(b.pid, signal.SIGSTOP)       # paused: c takes over, b must not act when it wakes
        _, s2 = wait_step(clients, job, s1 + 5, 90)
        assert wait_for(lambda: controller_pid(tmp_path) == c.pid, timeout=10)
        store = Store(pg_url)
        try:
            holder = store.read(lambda conn: conn.exec_driver_sql("SELECT holder, fence FROM lease").first())
        finally:
            store.close()
        assert tuple(holder) == ("c2", 3)
        os.kill(b.pid, signal.SIGCONT)
        assert b.wait(timeout=20) == EXIT_LEASE_LOST
        assert log_says(tmp_path / "logs" / "controller-1.log",
                        "lost the lease: another controller holds the lease now")
        rep = None
        deadline = time.monotonic() + 120
        while rep is None or rep["state"] == "running":
            assert time.monotonic() < deadline, rep and rep.get("live")
            time.sleep(0.3)
            rep = cluster.client_of(2).get(f"/api/jobs/{job}")
        assert rep["state"] == "succeeded", rep.get("reason")
        assert rep["steps_completed"] == STEPS
        assert len(rep["runs"]) == 1 and rep["incidents"] == []       # the same run went on
        assert len(rep["control_plane"]) == 2
    finally:
        cluster.stop()
