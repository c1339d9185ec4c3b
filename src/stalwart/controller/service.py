"""The controller: machines, command queues, jobs, the heartbeat monitor. The HTTP API is in api.py."""
from __future__ import annotations

import logging
import os
import re
import threading
import time

from stalwart.chaos import catalogue
from stalwart.controller.jobs import TERMINAL, JobRunner
from stalwart.controller.pool import standby_count
from stalwart.controller.rendezvous import Rendezvous
from stalwart.controller.report import build_report
from stalwart.controller.store import Store
from stalwart.spec import JobSpec

log = logging.getLogger("stalwart.controller")


def natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


class Controller:
    def __init__(self, db_url: str, state_dir: str, store_host: str = "127.0.0.1",
                 heartbeat_s: float = 1.0, missed_beats: int = 3):
        self.store = Store(db_url)
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(self.state_dir, exist_ok=True)
        self.store_host = store_host
        self.heartbeat_s = heartbeat_s
        self.missed_beats = missed_beats
        self.rendezvous = Rendezvous()
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._machines: dict[str, dict] = {m["id"]: dict(m, alive=False) for m in self.store.machines()}
        self._queues: dict[str, list[dict]] = {}
        self.jobs: dict[int, JobRunner] = {}
        self._stop = threading.Event()
        self._interrupted_jobs()
        threading.Thread(target=self._monitor, name="heartbeat-monitor", daemon=True).start()

    def _interrupted_jobs(self) -> None:
        """Jobs a previous controller left running cannot be resumed mid-run: say so in the store."""
        for j in self.store.jobs_in_state(["pending", "running", "waiting", "recovering"]):
            self.store.update_job(j["id"], state="failed", finished_at=time.time(),
                                  reason="the controller restarted while the job was running")

    def close(self) -> None:
        self._stop.set()
        for r in list(self.jobs.values()):
            r.post("cancel", reason="controller shutting down")
        for r in list(self.jobs.values()):
            r.thread.join(timeout=10)
        self.rendezvous.close()
        self.store.close()

    # -- machines ---------------------------------------------------------------------------------
    def register(self, machine: str, info: dict) -> dict:
        now = time.time()
        with self._lock:
            m = self._machines.get(machine)
            state = m["state"] if m and m["state"] in ("active", "standby", "evicted") else "idle"
            if m and m["state"] in ("active", "standby") and not info.get("running_run") \
                    and not info.get("workers"):
                state = m["state"]
            rec = {"id": machine, "state": state, "address": info.get("address"), "info": info,
                   "registered_at": now, "last_beat": now, "alive": True,
                   "job_id": m.get("job_id") if m else None, "reason": m.get("reason") if m else None}
            self._machines[machine] = rec
            self._queues.setdefault(machine, [])
        self.store.upsert_machine(machine, state=state, address=rec["address"], info=info,
                                  registered_at=now, last_beat=now, job_id=rec["job_id"])
        log.info("machine %s registered (%s, %s)", machine, rec["address"], state)
        return {"ok": True, "heartbeat_s": self.heartbeat_s, "role": state}

    def heartbeat(self, machine: str, body: dict) -> dict:
        with self._lock:
            m = self._machines.get(machine)
            if m is None or not m["alive"]:
                return {"reregister": True}
            m["last_beat"] = time.time()
        return {"ok": True}

    def _monitor(self) -> None:
        while not self._stop.wait(0.1):
            now = time.time()
            lost = []
            with self._lock:
                for m in self._machines.values():
                    if m["alive"] and now - m["last_beat"] > self.heartbeat_s * self.missed_beats:
                        m["alive"] = False
                        lost.append(m)
            for m in lost:
                log.warning("machine %s lost: no heartbeat for %.1fs", m["id"], now - m["last_beat"])
                self.store.upsert_machine(m["id"], last_beat=m["last_beat"])
                runner = self.jobs.get(m.get("job_id"))
                if runner is not None:
                    runner.post("machine_lost", machine=m["id"])

    def last_heard(self, machine: str) -> float | None:
        """When the machine's agent last sent anything (a heartbeat or events)."""
        with self._lock:
            m = self._machines.get(machine)
            return m["last_beat"] if m else None

    def machine_alive(self, machine: str) -> bool:
        with self._lock:
            m = self._machines.get(machine)
            return bool(m and m["alive"])

    def machine_state(self, machine: str) -> str | None:
        with self._lock:
            m = self._machines.get(machine)
            return m["state"] if m else None

    def set_machine(self, machine: str, **values) -> None:
        with self._lock:
            self._machines.setdefault(machine, {"id": machine, "alive": False}).update(values)
        self.store.upsert_machine(machine, **values)

    def peer_addr(self, machine: str | None) -> list | None:
        """Where a machine's agent serves checkpoint shards to its peers."""
        with self._lock:
            m = self._machines.get(machine) if machine else None
            return (m.get("info") or {}).get("peer") if m else None

    def free_machines(self) -> list[str]:
        with self._lock:
            return sorted((m["id"] for m in self._machines.values()
                           if m["alive"] and m["state"] == "idle"), key=natural_key)

    def machines(self) -> list[dict]:
        with self._lock:
            return [{k: v for k, v in m.items() if k != "info"} | {"address": m.get("address")}
                    for m in sorted(self._machines.values(), key=lambda m: natural_key(m["id"]))]

    # -- commands to agents -------------------------------------------------------------------------
    def send(self, machine: str, cmd: dict) -> None:
        with self._cond:
            self._queues.setdefault(machine, []).append(cmd)
            self._cond.notify_all()

    def commands(self, machine: str, wait: float) -> list[dict]:
        deadline = time.time() + min(wait, 30.0)
        with self._cond:
            while not self._queues.get(machine) and not self._stop.is_set():
                left = deadline - time.time()
                if left <= 0:
                    return []
                self._cond.wait(left)
            cmds, self._queues[machine] = self._queues.get(machine, []), []
            return cmds

    def agent_events(self, machine: str, events: list[dict]) -> None:
        with self._lock:
            m = self._machines.get(machine)
            job_id = m.get("job_id") if m else None
            if m is not None:
                m["last_beat"] = time.time()
        runner = self.jobs.get(job_id)
        for ev in events:
            if ev.get("type") == "started" and m is not None:
                pass
            if runner is not None:
                runner.post("agent_event", machine=machine, ev=ev)

    # -- jobs ---------------------------------------------------------------------------------------
    def ckpt_dir(self, job_id: int) -> str:
        return os.path.join(self.state_dir, "checkpoints", f"job{job_id}")

    def submit(self, spec_dict: dict) -> int:
        spec = JobSpec.from_dict(spec_dict)
        for c in spec.chaos:
            cs = catalogue.parse(c)
            catalogue.validate_against(cs, spec.machines + standby_count(spec),
                                       spec.gpus_per_machine, spec.machines)
        if any(r.state not in TERMINAL for r in self.jobs.values()):
            raise ValueError("a job is already running on this controller")
        job_id = self.store.create_job(spec.name, spec.to_dict(), time.time())
        runner = JobRunner(self, job_id, spec)
        self.jobs[job_id] = runner
        runner.start()
        return job_id

    def job_finished(self, runner: JobRunner) -> None:
        pass

    def resolve_job(self, job: str | int) -> int:
        if job in ("latest", "current"):
            row = self.store.latest_job()
            if row is None:
                raise LookupError("no job has been submitted yet")
            return row["id"]
        try:
            job_id = int(job)
        except ValueError:
            raise LookupError(f"no job {job!r}") from None
        if self.store.job(job_id) is None:
            raise LookupError(f"no job {job_id}")
        return job_id

    def status(self, job_id: int) -> dict:
        rep = build_report(self.store, job_id, now=time.time())
        runner = self.jobs.get(job_id)
        if runner is not None:
            rep["live"] = runner.live()
        return rep

    def inject(self, job_id: int, text: str) -> dict:
        runner = self.jobs.get(job_id)
        if runner is None or runner.state in TERMINAL:
            raise ValueError(f"job {job_id} is not running")
        c = catalogue.parse(text)
        catalogue.validate_against(c, len(self._machines), runner.G, runner.spec.machines)
        runner.post("inject", spec=c.to_dict())
        return {"ok": True, "chaos": c.to_dict()}

    def register_version(self, job_id: int, code: str, mode: str, window_s: float | None) -> dict:
        runner = self.jobs.get(job_id)
        if runner is None or runner.state in TERMINAL:
            raise ValueError(f"job {job_id} is not running")
        if mode not in ("lazy", "urgent", "window"):
            raise ValueError(f"mode must be lazy, urgent or window (got {mode!r})")
        return runner.register_version(os.path.abspath(code), mode, window_s)

    def versions(self, job_id: int) -> list[dict]:
        from stalwart.controller.versions import Versions
        return Versions(self.store).list(job_id)

    def cancel(self, job_id: int, reason: str = "cancelled by the user") -> None:
        runner = self.jobs.get(job_id)
        if runner is not None:
            runner.post("cancel", reason=reason)
