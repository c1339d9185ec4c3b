"""Run a job on a real local cluster (controller + agents + gloo workers) and return its report."""
from __future__ import annotations

import sys
import time

from stalwart.backends.local import LocalCluster
from stalwart.transport.client import ControllerUnreachable
from stalwart.controller.cluster.standby import standby_count
from stalwart.spec import JobSpec

GPT = [sys.executable, "-m", "stalwart.examples.gpt"]


def gpt_spec(machines: int = 2, gpus: int = 2, steps: int = 40, **kw) -> dict:
    d = {"name": "test", "machines": machines, "gpus_per_machine": gpus, "steps": steps,
         "ckpt_every": 5, "command": GPT + ["--layers", "2", "--log-every", "0"],
         "policy": {"heartbeat_s": 0.5, "missed_beats": 4}}
    d.update(kw)
    return d


def run_job(state_dir, spec: dict, timeout: float = 240.0, during=None, db_url: str | None = None,
            spare: int = 0, network: str = "auto") -> dict:
    """Start a cluster sized for `spec` (plus `spare` idle machines), run the job to the end, stop
    everything, return the report. The machines have their own network namespaces where they can
    (`network="auto"`: as root), so network faults are real.

    `during(client, job_id, status)` is called on every poll (to inject faults mid-run); the
    cluster is `client.cluster`. Polls ride out a controller restart.
    """
    js = JobSpec.from_dict(spec)
    total = js.machines + standby_count(js) + spare
    cluster = LocalCluster(str(state_dir), total, js.gpus_per_machine,
                           heartbeat_s=js.policy.heartbeat_s, missed_beats=js.policy.missed_beats,
                           db_url=db_url, network=network)
    try:
        cluster.start()
        job = cluster.client().post("/api/jobs", {"spec": js.to_dict()})["job"]
        deadline = time.monotonic() + timeout
        while True:
            client = cluster.client()
            client.cluster = cluster          # type: ignore[attr-defined]
            try:
                st = client.get(f"/api/jobs/{job}")
            except ControllerUnreachable:     # restarting: its supervisor brings it back
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            if st["state"] != "running":
                return st
            if during is not None:
                during(client, job, st)
            if time.monotonic() > deadline:
                raise TimeoutError(f"job did not finish within {timeout}s: {st.get('live')}")
            time.sleep(0.2)
    finally:
        cluster.stop()


def events(state_dir, kind: str) -> list[dict]:
    """The data of job 1's events of `kind`, from the state dir's store."""
    from stalwart.controller.store.db import Store
    store = Store(f"sqlite:///{state_dir}/stalwart.db")
    try:
        return [e["data"] for e in store.events(1) if e["kind"] == kind]
    finally:
        store.close()


def losses(report: dict) -> dict[int, float]:
    return {int(k): v for k, v in report["losses"].items()}


def wait_for(cond, timeout: float = 60.0, every: float = 0.05) -> bool:
    """Poll `cond` until it is true (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return False
