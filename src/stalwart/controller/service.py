"""The controller: machines, command queues, jobs, the heartbeat monitor. The HTTP API is in api.py;
each job's logic is its runner (`controller/job/`).

Restart-safe: jobs a previous controller left running are taken over (their saved state loaded,
their agents heard again, see `job/flows/reconcile.py`), unless it is started with
`abandon_running` (a fresh local cluster: the old one's machines are gone with it). A standby
(`lease`) waits for the lease (`controller/lease.py`) and then takes over the same way.

Store outages: the controller's threads wait them out (`Store.patient`) and are supervised
(`controller/supervise.py`): the heartbeat monitor keeps judging machines from memory while the
store is away, its writes (when this controller was last alive, a lost machine's last beat) go
through the `store-probe` thread, whose write every second is also what `/api/health` reads.
Times are the steady clock of `stalwart.clock`: a step of the host's clock moves no deadline.
"""
from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from typing import Callable
from collections.abc import Iterable

import msgspec

from stalwart import auth, clock, protocol
from stalwart.chaos import catalogue
from stalwart.controller import snapshot, versions
from stalwart.controller.beats import BeatLateness
from stalwart.controller.job import state as S
from stalwart.controller.commands import CommandQueues
from stalwart.controller.job.events import (AgentBack, AgentEvent, Cancel, Inject, MachineLost, Resumed,
                                            VersionRegistered)
from stalwart.controller.job.runner import JobRunner
from stalwart.controller.pool import standby_count
from stalwart.controller.rendezvous import Rendezvous
from stalwart.controller.reportcache import ReportCache
from stalwart.controller.restore import Availability
from stalwart.controller.store import Store
from stalwart.controller.supervise import supervised
from stalwart.errors import Conflict, InvalidRequest, NotFound
from stalwart.spec import JobSpec

log = logging.getLogger("stalwart.controller")
RUNNING_STATES = ("pending", "waiting", "running", "recovering", "tracing", "diagnosing", "replaying")
ALIVE_EVERY_S = 1.0
BACKEND_WATCH_S = 1.0     # how often the backend is asked whether the cluster took the machines away
REQUEST_TTL_S = 600.0     # a machine asked of the backend counts as coming for this long
MONITOR_EVERY_S = 0.1
STALL_S = 0.5             # the monitor woke this much later than asked: the controller stalled
CLOSE_WAIT_S = 10.0        # how long close waits for the job threads to finish the event in hand


def natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def overdue(machines: Iterable[dict], now: float, limit_s: float) -> tuple[list[dict], float]:
    """The alive machines whose agents have been silent for more than `limit_s` at `now`, and
    the earliest last beat among the alive others (inf: none): until `now - limit_s` passes it,
    no machine can be overdue, and the heartbeat monitor need not look at thousands of them ten
    times a second."""
    lost, earliest = [], math.inf
    for m in machines:
        if m["alive"]:
            if now - m["last_beat"] > limit_s:
                lost.append(m)
            elif m["last_beat"] < earliest:
                earliest = m["last_beat"]
    return lost, earliest


def monitor_wait(now: float, earliest_beat: float, limit_s: float, next_alive: float) -> float:
    """How long the heartbeat monitor may sleep: until a machine could be overdue (its earliest
    last beat plus the limit) or the next `alive_at` write, whichever is first; at least
    MONITOR_EVERY_S (the precision of a loss's detection), at most ALIVE_EVERY_S and half the
    limit (a machine that registers meanwhile is looked at before half its limit passed)."""
    return min(ALIVE_EVERY_S, max(MONITOR_EVERY_S, min(limit_s / 2, earliest_beat + limit_s - now,
                                                       next_alive - now)))


class MachineView:
    """The controller's registry as one job's core sees it (`ClusterView`)."""

    def __init__(self, ctl: "Controller", job_id: int):
        self.ctl, self.job_id = ctl, job_id

    def alive(self, machine: str) -> bool:
        return self.ctl.machine_alive(machine)

    def last_heard(self, machine: str) -> float | None:
        return self.ctl.last_heard(machine)

    def beat_late_s(self) -> float:
        return self.ctl.beat_late_s()

    def free(self) -> list[str]:
        return self.ctl.free_for(self.job_id)

    def labels(self, machine: str) -> dict[str, str]:
        return self.ctl.machine_labels(machine)


class Controller:
    def __init__(self, db_url: str, state_dir: str, store_host: str = "127.0.0.1",
                 heartbeat_s: float = 1.0, missed_beats: int = 3, abandon_running: bool = False,
                 backend=None, secret_file: str | None = None, lease: str | None = None, url: str | None = None,
                 on_lease_lost=None, checkpoint_dir: str | None = None,
                 on_phase: Callable[[int, str], None] | None = None):
        """`secret_file`: the controller's secret (credentials and checkpoint keys derive from it;
        default: made once in the state dir). `lease`: share the store with other controllers under
        this holder name ("" for host:pid): wait here until this one holds the lease
        (`controller/lease.py`); `on_lease_lost` is called with the reason when another takes it
        (the CLI exits). `checkpoint_dir`: where durable checkpoints go (default: the state dir's).
        `on_phase(job id, phase)`: called after each transition a job carried out (the control
        plane's chaos, `chaos/controller.py`)."""
        self.on_phase = on_phase
        self.state_dir = os.path.abspath(state_dir)
        # durable checkpoints: a directory every agent sees at the same path, or an fsspec URL
        self.checkpoint_dir = checkpoint_dir or os.path.join(self.state_dir, "checkpoints")
        snapshot.mark_state_dir(self.state_dir)
        self.secret = auth.controller_secret(self.state_dir, secret_file)
        self.verify_identities = False    # (the API sets it when it checks credentials)
        self.verified: set[str] = set()   # machines whose agent proved its machine's credential
        self.store = Store(db_url)
        self.store.patient()            # (the constructor's thread: a start waits an outage out)
        self.lease = None
        if lease is not None:
            from stalwart.controller.lease import Lease
            self.lease = Lease(self.store, lease or None, url, on_lost=on_lease_lost)
            self.lease.acquire()
            self.lease.keep()
        self.reports = ReportCache(self.store)
        self.versions = versions.Versions(self.store)
        self.store_host = store_host
        self.heartbeat_s = heartbeat_s
        self.missed_beats = missed_beats
        self.lateness = BeatLateness(heartbeat_s)   # how late beats come on this host (silence rules)
        self.backend = backend      # backends.base.Backend: evicts, refills, says when the cluster ended
        self._requested: dict[str, float] = {}     # machines asked of the backend -> when
        self._ended: str | None = None             # why the cluster took the machines away
        self.rendezvous = Rendezvous()
        self._lock = threading.RLock()
        self._machines: dict[str, dict] = {m["id"]: dict(m, alive=False, last_beat=None)
                                           for m in self.store.machines()}
        self.command_queues = CommandQueues()
        self.jobs: dict[int, JobRunner] = {}
        self._taken_over: list[JobRunner] = []     # started once the API serves (see serving)
        self._down_at: float | None = None
        self._earliest_beat = -math.inf      # no alive machine beat before this (see overdue)
        self._stop = threading.Event()
        self._beats_to_write: dict[str, float] = {}      # lost machines' last beats (store-probe writes)
        down_at = float(self.store.get_meta("alive_at") or clock.now())
        self.store.set_meta("alive_at", repr(clock.now()))
        if abandon_running:
            self._abandon()
        else:
            self._take_over(down_at)
        supervised("heartbeat-monitor", self._monitor, self._stop)
        supervised("store-probe", self._probe_store, self._stop)
        if backend is not None:
            supervised("backend-watch", self._watch_backend, self._stop)

    # -- a restart ----------------------------------------------------------------------------------
    def _abandon(self) -> None:
        """A fresh cluster: jobs an earlier one ran cannot be resumed, its machines are gone."""
        now = clock.now()
        for j in self.store.jobs_in_state(RUNNING_STATES):
            self.store.update_job(j["id"], state="failed", finished_at=now,
                                  reason="the cluster that ran it stopped (a new local cluster started)")
        for m in self._machines.values():
            if m["state"] != "idle" or m.get("job_id") is not None:
                m.update(state="idle", job_id=None, reason=None)
                self.store.upsert_machine(m["id"], state="idle", job_id=None, reason=None)

    def _take_over(self, down_at: float) -> None:
        """Load every job a previous controller left running and reconcile it with its agents."""
        up_at = clock.now()
        for j in self.store.jobs_in_state(RUNNING_STATES):
            raw = self.store.load_state(j["id"])
            try:
                spec = JobSpec.from_dict(j["spec"])
                st = S.loads(raw) if raw is not None else None
            except ValueError as e:
                st, why = None, str(e)
            else:
                why = "its saved state is missing"
            if st is None:
                self.store.update_job(j["id"], state="failed", finished_at=up_at,
                                      reason=f"the controller restarted and could not resume the job: {why}")
                continue
            runner = JobRunner(self, spec, st)
            self.jobs[st.job_id] = runner
            self._taken_over.append(runner)
            self._down_at = down_at
            log.info("job %s taken over in phase %s (controller down since %.1fs)", st.job_id,
                     st.phase.value, up_at - down_at)

    def serving(self) -> None:
        """The API listens: jobs taken over start reconciling now. Their agents can only come
        back from this moment, so the reconciliation's grace counts from here, not from the
        start of this process (which may take seconds to get to listening)."""
        up_at = clock.now()
        taken, self._taken_over = self._taken_over, []
        for runner in taken:
            runner.post(Resumed(down_at=self._down_at or up_at, up_at=up_at))
            runner.start()

    def close(self) -> None:
        """Stop serving. Jobs are left as they are: the next controller on this store takes them
        over (cancel a job through the API to end it)."""
        self._stop.set()
        runners = list(self.jobs.values())
        for runner in runners:
            runner.stop()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for runner in runners:       # (a runner mid-save finishes it: the store closes after)
            if runner.thread.is_alive():
                runner.thread.join(max(0.0, deadline - time.monotonic()))
        if self.lease is not None:
            self.lease.release()
        self.command_queues.close()
        self.rendezvous.close()
        self.store.close()

    # -- machines ---------------------------------------------------------------------------------
    def register(self, machine: str, body: protocol.Registration | dict) -> dict:
        try:
            reg = body if isinstance(body, protocol.Registration) else \
                msgspec.convert(body, protocol.Registration, strict=False)
        except msgspec.ValidationError as e:
            raise InvalidRequest(f"registration of {machine}: {e}") from None
        now = clock.now()
        with self._lock:
            m = self._machines.get(machine)
            state = m["state"] if m and m["state"] in ("active", "standby", "evicted") else "idle"
            rec = {"id": machine, "state": state, "address": reg.address, "info": protocol.encode(reg),
                   "registered_at": now, "last_beat": now, "alive": True, "isolated": reg.isolated,
                   "job_id": m.get("job_id") if m else None, "reason": m.get("reason") if m else None}
            self._machines[machine] = rec
            self._earliest_beat = min(self._earliest_beat, now)
        self.store.upsert_machine(machine, state=state, address=reg.address, info=rec["info"],
                                  registered_at=now, last_beat=now, job_id=rec["job_id"])
        log.info("machine %s registered (%s, %s)", machine, reg.address, state)
        runner = self._runner_of(rec["job_id"]) or self._runner_holding(machine)
        if runner is not None:
            runner.post(AgentBack(machine=machine, reg=reg))
        return {"ok": True, "heartbeat_s": self.heartbeat_s, "missed_beats": self.missed_beats, "role": state,
                "steps_batch": True}     # this controller takes merged step reports (protocol.Steps)

    _OK = {"ok": True}                      # (constant answers: never changed by a caller)
    _REREGISTER = {"ok": True, "reregister": True}
    _NOT_TAKEN = {"ok": False, "reregister": True, "taken": False}

    def heartbeat(self, machine: str) -> dict:
        with self._lock:
            m = self._machines.get(machine)
            if m is None or not m["alive"]:
                return {"reregister": True}
            self._heard(m)
        return self._OK

    def _heard(self, m: dict) -> None:
        """A live machine sent something (a beat or events): note when, and how late (under the lock)."""
        now = clock.now()
        self.lateness.heard(m["last_beat"], now)
        m["last_beat"] = now

    def _probe_store(self) -> None:
        """Every ALIVE_EVERY_S: when this controller was last alive (the next one books the gap
        from it) and the last beats of machines called lost, in one write. A write that waits
        (the store is away) makes `Store.unavailable` say so, which `/api/health` answers."""
        self.store.patient()
        while not self._stop.wait(ALIVE_EVERY_S):
            with self._lock:
                beats, self._beats_to_write = self._beats_to_write, {}
            self.store.set_meta("alive_at", repr(clock.now()))
            for machine, t in beats.items():
                self.store.upsert_machine(machine, last_beat=t)

    def _monitor(self) -> None:
        next_alive = 0.0
        last, wait = time.monotonic(), MONITOR_EVERY_S
        while not self._stop.wait(wait):
            now = clock.now()
            lag = time.monotonic() - last - wait
            last = time.monotonic()
            if now >= next_alive:
                next_alive = now + ALIVE_EVERY_S
            lost: list[dict] = []
            limit = self.heartbeat_s * self.missed_beats
            with self._lock:
                if lag > STALL_S:
                    # this controller did not run for `lag` seconds (a loaded host, a long pause):
                    # heartbeats it could not read are not the machines' silence
                    log.warning("controller stalled for %.1fs; heartbeat deadlines extended", lag)
                    for m in self._machines.values():
                        if m["alive"]:
                            m["last_beat"] += lag
                    self._earliest_beat = -math.inf
                if now - limit > self._earliest_beat:       # someone may be overdue: look
                    lost, self._earliest_beat = overdue(self._machines.values(), now, limit)
                    for m in lost:
                        m["alive"] = False
                wait = monitor_wait(now, self._earliest_beat, limit, next_alive)
            if lost and self._cluster_ended():
                lost = []           # the jobs are cancelled with the cluster's reason
            for m in lost:
                log.warning("machine %s lost: no heartbeat for %.1fs", m["id"], now - m["last_beat"])
                with self._lock:
                    self._beats_to_write[m["id"]] = m["last_beat"]
                runner = self._runner_of(m.get("job_id"))
                if runner is not None:
                    runner.post(MachineLost(machine=m["id"]))

    def _runner_of(self, job_id) -> JobRunner | None:
        return self.jobs.get(job_id) if isinstance(job_id, int) else None

    def _runner_holding(self, machine: str) -> JobRunner | None:
        """The live job whose state names the machine (a slot or a standby): the job's own record
        decides, whatever the machine's row says (a row can lag its job's decision by a moment)."""
        for runner in list(self.jobs.values()):
            if not runner.terminal and machine in runner.held():
                return runner
        return None

    def last_heard(self, machine: str) -> float | None:
        """When the machine's agent last sent anything (a heartbeat or events)."""
        with self._lock:
            m = self._machines.get(machine)
            return m["last_beat"] if m else None

    def beat_late_s(self) -> float:
        """The largest heartbeat lateness seen recently on this host (`beats.BeatLateness`)."""
        with self._lock:
            return self.lateness.late_s(clock.now())

    def machine_labels(self, machine: str) -> dict[str, str]:
        """The topology labels its agent registered with (`stalwart agent --label`)."""
        with self._lock:
            m = self._machines.get(machine)
            return dict((m.get("info") or {}).get("labels") or {}) if m else {}

    def machine_alive(self, machine: str) -> bool:
        with self._lock:
            m = self._machines.get(machine)
            return bool(m and m["alive"])

    def machine_state(self, machine: str) -> str | None:
        with self._lock:
            m = self._machines.get(machine)
            return m["state"] if m else None

    def assign_machine(self, machine: str, state: str, job_id: int, reason: str | None = None,
                       incident: int | None = None) -> None:
        """A job core gave a machine a role (its store row was written with the decision)."""
        with self._lock:
            rec = self._machines.setdefault(machine, {"id": machine, "alive": False, "last_beat": None})
            rec.update(state=state, reason=reason, job_id=None if state == "idle" else job_id)
        if state == "evicted" and self.backend is not None and self.verify_identities \
                and machine not in self.verified:
            # (draining a Slurm node or cordoning a Kubernetes node named by an agent's labels is
            # for machines that proved who they are, not for any caller of a machine id)
            log.warning("not asking the backend to evict %s: its identity was not verified", machine)
        elif state == "evicted" and self.backend is not None:
            from stalwart.backends.base import drain_reason
            labels = dict((rec.get("info") or {}).get("labels") or {})
            try:
                self.backend.evict(machine, drain_reason(incident, reason), labels)
            except Exception:       # the cluster keeps its own view; the job goes on
                log.exception("the backend could not evict %s", machine)

    def request_machines(self, job_id: int, count: int) -> list[str]:
        """A job's standby pool is short and no machine is free: ask the backend for `count`
        machines, less those asked before that have not registered yet."""
        if self.backend is None or count <= 0:
            return []
        now = clock.now()
        with self._lock:
            for m, t in list(self._requested.items()):
                if m in self._machines or now - t > REQUEST_TTL_S:
                    del self._requested[m]
            count -= len(self._requested)
        if count <= 0:
            return []
        try:
            names = self.backend.request(count)
        except Exception:
            log.exception("the backend could not provide %d machine(s)", count)
            return []
        with self._lock:
            self._requested.update({m: now for m in names})
        if names:
            log.info("job %s: asked the cluster for %s", job_id, ", ".join(names))
            self.store.commit(job_id, [("event", {"kind": "machines_requested", "t": now,
                                                  "data": {"machines": names, "backend": self.backend.kind}})],
                              None)
        return names

    def _watch_backend(self) -> None:
        """When the cluster takes the machines away (a time limit, a preemption, a cancel of the
        allocation), every live job ends, cancelled with the cluster's reason."""
        while not self._stop.wait(BACKEND_WATCH_S):
            self._cluster_ended()

    def _cluster_ended(self) -> bool:
        """Ask the backend whether the cluster ended; if so (once), cancel every live job with its
        reason. Also asked before lost machines are reported: agents that Slurm stopped at a time
        limit are the allocation's end, not machine faults to recover from."""
        if self._ended is not None:
            return True
        try:
            why = self.backend.ended() if self.backend is not None else None
        except Exception:
            log.exception("the backend could not say whether the cluster still runs")
            return False
        if why is None:
            return False
        self._ended = why
        log.warning("the cluster ended: %s", why)
        for runner in list(self.jobs.values()):
            if not runner.terminal:
                runner.post(Cancel(reason=why))
        return True

    def job_finished(self, job_id: int, machines: list[str]) -> None:
        """A job ended: its machines go back to the free pool, its stores close."""
        with self._lock:
            mine = [m for m in machines if self._machines.get(m, {}).get("state") in ("active", "standby")
                    and self._machines[m].get("job_id") == job_id]
            for m in mine:
                self._machines[m].update(state="idle", job_id=None)
        for m in mine:
            self.store.upsert_machine(m, state="idle", job_id=None)
        self.rendezvous.close_job(job_id)

    def peer_addr(self, machine: str | None) -> list | None:
        """Where a machine's agent serves checkpoint shards to its peers."""
        with self._lock:
            m = self._machines.get(machine) if machine else None
            return (m.get("info") or {}).get("peer") if m else None

    def view(self, job_id: int) -> MachineView:
        return MachineView(self, job_id)

    def free_for(self, job_id: int) -> list[str]:
        """Idle machines this job may take: jobs wait in submission order (FIFO), so only the
        oldest waiting job sees any, and a running job refills its standbys only while nobody
        waits. Machines a live job has just decided to take (its state names them before its
        assignment reaches this registry) are not free."""
        runners = sorted((r for r in list(self.jobs.values()) if not r.terminal), key=lambda r: r.job_id)
        waiting = [r.job_id for r in runners if r.waiting]
        if waiting and waiting[0] != job_id:
            return []
        held: set[str] = set()
        for r in runners:
            held |= r.held()
        return [m for m in self.free_machines() if m not in held]

    def free_machines(self) -> list[str]:
        with self._lock:
            return sorted((m["id"] for m in self._machines.values()
                           if m["alive"] and m["state"] == "idle"), key=natural_key)

    def machines(self) -> list[dict]:
        with self._lock:        # (copied under the lock, sorted outside: the API's loop beats take it)
            rows = [{k: v for k, v in m.items() if k != "info"} | {"address": m.get("address")}
                    for m in self._machines.values()]
        return sorted(rows, key=lambda m: natural_key(m["id"]))

    # -- commands to agents -------------------------------------------------------------------------
    def send(self, machine: str, cmd: protocol.Command) -> None:
        self.command_queues.put(machine, protocol.encode(cmd))   # wakes only that machine's poll

    async def commands(self, machine: str, wait: float) -> list[dict]:
        """The machine's commands, waiting up to `wait` s for one (on the API's event loop)."""
        return await self.command_queues.take(machine, wait)

    def agent_events(self, machine: str, events: list[dict]) -> dict:
        """A batch of the machine's events as JSON objects (HTTP), typed one by one: one that
        does not fit its kind is left out (logged), one of a kind this controller does not know
        too (a newer agent). See `agent_events_typed`."""
        typed: list[protocol.Event] = []
        for raw in events:
            try:
                ev = protocol.decode_event(raw)
            except msgspec.ValidationError as e:
                log.warning("event from %s ignored: %s", machine, e)
                continue
            if ev is not None:
                typed.append(ev)
        return self.agent_events_typed(machine, typed)

    def agent_events_typed(self, machine: str, events: list[protocol.Event]) -> dict:
        """A batch of the machine's events; it counts as a heartbeat (an agent whose events flow
        skips its heartbeats). The reply says when the agent must register again, and when the
        batch was not taken (a machine this controller does not know: it restarted; the agent
        keeps the batch and sends it after its registration, so no event is lost)."""
        with self._lock:
            m = self._machines.get(machine)
            job_id = m.get("job_id") if m else None
            if m is not None and m["alive"]:
                self._heard(m)
            if m is None:       # (a restarted controller): not taken, the agent sends it again
                return self._NOT_TAKEN
            reply = self._OK if m["alive"] else self._REREGISTER
        runner = self._runner_of(job_id)
        if runner is not None and events:
            runner.post_many([AgentEvent(machine=machine, event=ev) for ev in events])
        return reply

    # -- jobs ---------------------------------------------------------------------------------------
    def ckpt_key(self, job_id: int) -> str:
        """The job's checkpoint key (hex), for its agents alone (`auth.checkpoint_key`)."""
        return auth.checkpoint_key(self.secret, job_id)

    def ckpt_dir(self, job_id: int) -> str:
        return f"{self.checkpoint_dir.rstrip('/')}/job{job_id}"

    def submit(self, spec_dict: dict) -> int:
        try:
            spec = JobSpec.from_dict(spec_dict)
            chaos = [catalogue.parse(c) for c in spec.chaos]
            for c in chaos:
                catalogue.validate_against(c, spec.machines + standby_count(spec), spec.gpus_per_machine,
                                           spec.machines)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        now = clock.now()
        off = snapshot.versionable(spec.code_dir, self.state_dir)
        job_id = self.store.create_job(spec.name, spec.to_dict(), now, submitted=True)
        st = S.JobState(job_id=job_id, created_at=now, versioning_off=off,
                        chaos=[S.ChaosPlan(kind=c.kind, machine=c.machine, rank=c.rank, step=c.step,
                                           params=dict(c.params)) for c in chaos],
                        avail=Availability(memory={"own": max(2, spec.policy.mem_slots - 1), "backup": 2}))
        st.code_path = spec.code_dir
        if off is None and spec.code_dir is not None:
            try:
                row = self.versions.register(job_id, spec.code_dir, self.state_dir, "lazy",
                                             spec.policy.hot_update_window_s, now)
            except ValueError as e:
                self.store.update_job(job_id, state="failed", finished_at=now, reason=str(e))
                raise InvalidRequest(f"cannot snapshot the code: {e}") from None
            st.versions, st.version_id, st.code_path = [row], row["id"], row["path"]
        else:
            log.info("job %s: hot update off: %s", job_id, off)
        self.store.commit(job_id, [("job", {"state": "running"})], S.dumps(st))
        runner = JobRunner(self, spec, st)
        self.jobs[job_id] = runner
        runner.start()
        return job_id

    def resolve_job(self, job: str | int, acting: bool = False) -> int:
        """A job's id from an id or 'latest'. An action (inject, cancel, update) on 'latest' while
        several jobs run is refused: it must say which."""
        live = sorted(j for j, r in list(self.jobs.items()) if not r.terminal)
        if acting and job in ("latest", "current") and len(live) > 1:
            raise InvalidRequest(f"{len(live)} jobs run on this controller ({', '.join(map(str, live))}): "
                                 f"say which with --job ID")
        if job in ("latest", "current"):
            row = self.store.latest_job()
            if row is None:
                raise NotFound("no job has been submitted yet")
            return row["id"]
        try:
            job_id = int(job)
        except ValueError:
            raise NotFound(f"no job {job!r}") from None
        if job_id in self.jobs:          # (a job this controller runs or ran: no database read)
            return job_id
        if not 0 < job_id < 2**63 or self.store.job(job_id) is None:      # (the store's integers)
            raise NotFound(f"no job {job_id}")
        return job_id

    def live_status(self, job_id: int) -> dict:
        """A running job's live progress alone (what a progress line shows each second), without
        its report: no database read, no ledger. An ended job's is its whole report."""
        runner = self.jobs.get(job_id)
        if runner is None or runner.terminal:
            return self.status(job_id)
        live = runner.live()
        return {"job": job_id, "state": "running", "steps_target": live["steps_target"], "live": live}

    def status(self, job_id: int) -> dict:
        rep = self.reports.report(job_id, now=clock.now())
        runner = self.jobs.get(job_id)
        if runner is not None:
            rep["live"] = runner.live()
        return rep

    def _running(self, job_id: int) -> JobRunner:
        runner = self.jobs.get(job_id)
        if runner is None or runner.terminal:
            raise Conflict(f"job {job_id} is not running")
        return runner

    def inject(self, job_id: int, text: str) -> dict:
        runner = self._running(job_id)
        try:
            c = catalogue.parse(text)
            catalogue.validate_against(c, len(self._machines), runner.spec.gpus_per_machine,
                                       runner.spec.machines, slots=list(runner.state.slots),
                                       known=set(self._machines))
            if self._machines[c.machine_id()].get("isolated") is False:    # (not known yet: the agent says)
                catalogue.check_isolated(c.kind, False)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        runner.post(Inject(kind=c.kind, machine=c.machine, rank=c.rank, params=dict(c.params)))
        return {"ok": True, "chaos": c.to_dict()}

    def register_version(self, job_id: int, code: str, mode: str, window_s: float | None) -> dict:
        runner = self._running(job_id)
        if mode not in versions.MODES:
            raise InvalidRequest(f"mode must be lazy, urgent or window (got {mode!r})")
        if runner.state.versioning_off:
            raise Conflict(f"hot update is off for this job: {runner.state.versioning_off}")
        try:
            row = self.versions.register(job_id, os.path.abspath(code), self.state_dir, mode, window_s,
                                         clock.now())
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        runner.post(VersionRegistered(row=row))
        return row

    def list_versions(self, job_id: int) -> list[dict]:
        return self.versions.list(job_id)

    def cancel(self, job_id: int, reason: str = "cancelled by the user") -> None:
        runner = self.jobs.get(job_id)
        if runner is not None:
            runner.post(Cancel(reason=reason))
