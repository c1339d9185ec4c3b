"""A job through an outage of the controller's store, on SQLite and on PostgreSQL.

    python bench/store_outage.py [--outage 60] [--step 30] [--steps 120] [--only sqlite,postgresql]
    python bench/store_outage.py --commit-cost

At step `--step` the store goes away for `--outage` seconds: the SQLite file is locked exclusively
by another process, or the PostgreSQL server is stopped (`pg_ctl stop -m fast`) and started again.
Printed per store: whether an incident was opened, the steps lost (redone after a restore), the
seconds from the store's return to the next step the controller committed, how long `/api/health`
answered 503, and whether the job finished. `--commit-cost` times one job decision's commit on
SQLite with synchronous=NORMAL and FULL. Not a timed test.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))

from stalwart.backends.local import LocalCluster  # noqa: E402
from stalwart.transport.client import ApiError, ControllerUnreachable  # noqa: E402
from stalwart.spec import JobSpec  # noqa: E402


def spec(steps: int) -> dict:
    return {"name": "outage", "machines": 2, "gpus_per_machine": 1, "steps": steps, "ckpt_every": 5, "dp": 2,
            "command": [sys.executable, "-m", "stalwart.examples.gpt", "--layers", "2", "--log-every", "0"],
            "policy": {"heartbeat_s": 0.5, "missed_beats": 4}}


def live(cluster: LocalCluster, job: int) -> dict:
    try:
        return cluster.client(timeout=15).get(f"/api/jobs/{job}/live")
    except (ApiError, ControllerUnreachable):
        return {}


def healthy(cluster: LocalCluster) -> bool:
    try:
        cluster.client(timeout=5).get("/api/health")
        return True
    except (ApiError, ControllerUnreachable):
        return False


def run(store: str, outage: float, at: int, steps: int) -> dict:
    d = tempfile.mkdtemp(prefix=f"stalwart-outage-{store}-")
    srv = None
    db_url = None
    if store == "postgresql":
        from pgserver import PgServer
        srv = PgServer()
        db_url = srv.start()
    js = JobSpec.from_dict(spec(steps))
    cluster = LocalCluster(d, 2, 1, heartbeat_s=0.5, missed_beats=4, db_url=db_url)
    try:
        cluster.start()
        job = cluster.client().post("/api/jobs", {"spec": js.to_dict()})["job"]
        while (live(cluster, job).get("live") or {}).get("step", 0) < at:
            time.sleep(0.1)
        lock = None
        t0 = time.monotonic()
        if srv is not None:
            srv.pause()
        else:
            lock = sqlite3.connect(f"{d}/stalwart.db", timeout=30, isolation_level=None)
            lock.execute("BEGIN EXCLUSIVE")
        unhealthy_from = None
        while time.monotonic() - t0 < outage:
            if unhealthy_from is None and not healthy(cluster):
                unhealthy_from = time.monotonic()
            time.sleep(0.5)
        if srv is not None:
            srv.resume()
        else:
            assert lock is not None
            lock.execute("ROLLBACK")
            lock.close()
        t_back = time.monotonic()
        # the live step right after the return is what the job thread knew before the outage
        # plus the backlog it now works through; a new step is one trained after the return
        seen = (live(cluster, job).get("live") or {}).get("step", 0)
        t_next = t_healthy = None
        while True:
            if t_healthy is None and healthy(cluster):
                t_healthy = time.monotonic()
            st = live(cluster, job)
            step = (st.get("live") or {}).get("step", 0)
            if t_next is None and step > seen:
                t_next = time.monotonic()
            if st.get("state") not in (None, "running") and t_healthy is not None:
                break
            time.sleep(0.1)
        rep = cluster.client().get(f"/api/jobs/{job}")
        return {"store": store, "outage_s": outage, "at_step": at, "state": rep["state"],
                "incidents": len(rep["incidents"]), "runs": len(rep["runs"]),
                "steps_lost": rep.get("steps_lost", 0),
                "health_503_after_s": round(unhealthy_from - t0, 2) if unhealthy_from else None,
                "health_200_after_return_s": round(t_healthy - t_back, 2) if t_healthy else None,
                "return_to_next_step_s": round(t_next - t_back, 2) if t_next else None,
                "steps_completed": rep["steps_completed"]}
    finally:
        cluster.stop()
        if srv is not None:
            srv.stop()


def commit_cost(n: int = 400) -> dict:
    """Mean seconds of one job decision's commit (events, a run update, the state) by sync mode."""
    import sqlalchemy as sa

    from stalwart.controller.store.db import Store
    from stalwart.controller.store.ops import Record
    out = {}
    for mode in ("NORMAL", "FULL"):
        d = tempfile.mkdtemp(prefix="stalwart-commit-")
        s = Store(f"sqlite:///{d}/s.db")
        sa.event.listen(s.engine, "connect", lambda c, _r, m=mode: c.execute(f"PRAGMA synchronous={m}"))
        s.engine.dispose()
        job = s.create_job("j", {}, 1.0)
        state = os.urandom(20_000)
        t = time.perf_counter()
        for i in range(n):
            s.commit(job, [Record(kind="incident_resumed", t=float(i), data={"i": i})], state)
        out[mode] = (time.perf_counter() - t) / n
        assert s.read(lambda c: c.exec_driver_sql("PRAGMA synchronous").scalar()) == (1 if mode == "NORMAL" else 2)
        s.close()
    return {k: round(v * 1000, 3) for k, v in out.items()} | {"unit": "ms per commit"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outage", type=float, default=60.0)
    ap.add_argument("--step", type=int, default=30)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--only", default="sqlite,postgresql")
    ap.add_argument("--commit-cost", action="store_true")
    a = ap.parse_args()
    if a.commit_cost:
        print(json.dumps(commit_cost()))
        return 0
    for store in a.only.split(","):
        print(json.dumps(run(store, a.outage, a.step, a.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
