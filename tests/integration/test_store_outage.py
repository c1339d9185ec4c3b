"""The controller survives its database: a job goes on through an exclusive lock on the SQLite
file and through a PostgreSQL restart. While the store is away `/api/health` answers 503, the
heartbeat monitor still judges machines from memory, and what the job decides waits for its
commit; once the store is back the decisions go out in order: a machine lost during the
outage is replaced, a crash and a cancel posted during it are applied."""
import sqlite3
import time

import pytest

from jobrun import gpt_spec, wait_for
from pgserver import PgServer, unavailable_reason
from stalwart.agent.workers import kill_tree
from stalwart.transport.client import ApiError, ControllerUnreachable
from test_controller_restart import finish, start, status, why


def health(cluster) -> int:
    try:
        cluster.client(timeout=5).get("/api/health")
        return 200
    except ApiError as e:
        return e.status
    except ControllerUnreachable:
        return 0


def step(cluster, job) -> int:
    return (status(cluster, job).get("live") or {}).get("step", 0)


def lock_sqlite(state_dir) -> sqlite3.Connection:
    c = sqlite3.connect(f"{state_dir}/stalwart.db", timeout=10, isolation_level=None)
    c.execute("BEGIN EXCLUSIVE")
    return c


@pytest.mark.timeout(240)
def test_sqlite_locked_40s_while_a_machine_is_lost(tmp_path):
    cluster, job, _ = start(tmp_path, gpt_spec(machines=2, gpus=1, dp=2, steps=50, standby=1))
    lock = None
    try:
        assert wait_for(lambda: step(cluster, job) >= 5, timeout=120)
        lock = lock_sqlite(tmp_path)
        t0 = time.monotonic()
        assert wait_for(lambda: health(cluster) == 503, timeout=15), "health did not report the outage"
        kill_tree(cluster.agents["m1"].pid)           # a machine dies while the store is locked
        assert health(cluster) == 503
        time.sleep(max(0.0, 40 - (time.monotonic() - t0)))
        lock.execute("ROLLBACK")
        lock.close()
        lock = None
        assert wait_for(lambda: health(cluster) == 200, timeout=15)
        rep = finish(cluster, job, timeout=180)
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path, None, job))
        assert rep["steps_completed"] == 50
        [inc] = rep["incidents"]
        assert inc["machines_evicted"] == ["m1"], inc
    finally:
        if lock is not None:
            lock.close()
        cluster.stop()


@pytest.mark.timeout(180)
def test_a_crash_and_a_cancel_posted_during_a_lock_are_applied_after_it(tmp_path):
    cluster, job, _ = start(tmp_path, gpt_spec(machines=2, gpus=1, dp=2, steps=2000))
    lock = None
    try:
        assert wait_for(lambda: step(cluster, job) >= 3, timeout=120)
        lock = lock_sqlite(tmp_path)
        assert wait_for(lambda: health(cluster) == 503, timeout=15)
        c = cluster.client(timeout=15)
        assert c.post(f"/api/jobs/{job}/inject", {"chaos": "crash@machine=1"})["ok"]
        assert c.post(f"/api/jobs/{job}/cancel", {"reason": "stopped during the outage"})["ok"]
        time.sleep(8)
        assert status(cluster, job)["state"] == "running"      # nothing applied without its commit
        lock.execute("ROLLBACK")
        lock.close()
        lock = None
        rep = finish(cluster, job, timeout=60)
        assert rep["state"] == "cancelled" and rep["reason"] == "stopped during the outage", rep.get("reason")
        from stalwart.controller.store.db import Store
        store = Store(f"sqlite:///{tmp_path}/stalwart.db")
        try:
            # (committed and visible to other processes: `stalwart report` reads the file)
            assert wait_for(lambda: store.job(job)["state"] == "cancelled", timeout=10)
            every = [e["kind"] for e in store.events(job) if e["kind"] not in ("step", "rank_times")]
            kinds = [k for k in every if k in ("chaos_sent", "job_finished")]
        finally:
            store.close()
        assert kinds == ["chaos_sent", "job_finished"], every          # in the order they were posted
        machines = {m["id"]: m for m in cluster.client().get("/api/machines")["machines"]}
        assert all(m["state"] == "idle" for m in machines.values()), machines     # released
    finally:
        if lock is not None:
            lock.close()
        cluster.stop()


@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_postgresql_stopped_and_restarted_during_a_job(tmp_path):
    why_not = unavailable_reason()
    if why_not:
        pytest.skip(why_not)
    srv = PgServer()
    url = srv.start()
    cluster = None
    try:
        cluster, job, _ = start(tmp_path, gpt_spec(machines=2, gpus=1, dp=2, steps=60), url)
        assert wait_for(lambda: step(cluster, job) >= 5, timeout=120)
        srv.pause()
        assert wait_for(lambda: health(cluster) == 503, timeout=15)
        time.sleep(10)
        srv.resume()
        assert wait_for(lambda: health(cluster) == 200, timeout=30)
        rep = finish(cluster, job, timeout=150)
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path, url, job))
        assert rep["steps_completed"] == 60 and rep["incidents"] == []
    finally:
        if cluster is not None:
            cluster.stop()
        srv.stop()
