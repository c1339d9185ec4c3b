"""The controller: machines, command queues, jobs, the heartbeat monitor. The HTTP API is in api.py;
each job's logic is its runner (`controller/job/`), which sees the controller's parts through the
interfaces of `job/ports.py` (built here, one `JobPorts` per job); the machine registry is
`machines.py`, what jobs ask of the cluster's backend `supply.py`.

Restart-safe: jobs a previous controller left running are taken over (their saved state loaded,
their agents heard again, see `job/flows/reconcile.py`), unless it is started with
`abandon_running` (a fresh local cluster: the old one's machines are gone with it). A standby
(`lease`) waits for the lease (`controller/store/lease.py`) and then takes over the same way.

Store outages: the controller's threads wait them out (`Store.patient`) and are supervised
(`controller/supervise.py`): the heartbeat monitor keeps judging machines from memory while the
store is away, its writes (when this controller was last alive, a lost machine's last beat) go
through the `store-probe` thread, whose write every second is also what `/api/health` reads.
Times are the steady clock of `stalwart.controller.clock`: a step of the host's clock moves no deadline.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import AbstractSet, Callable, Iterable

import msgspec

from stalwart import protocol
from stalwart.chaos import catalogue
from stalwart.controller import clock
from stalwart.controller.api.commands import CommandQueues
from stalwart.controller.api.rendezvous import Rendezvous
from stalwart.controller.cluster.beats import BeatLateness
from stalwart.controller.cluster.machines import AgentReply, Registry
from stalwart.controller.cluster.roles import Role
from stalwart.controller.cluster.standby import standby_count
from stalwart.controller.cluster.supply import Supply
from stalwart.controller.code import tree as snapshot
from stalwart.controller.code import versions
from stalwart.controller.job import state as S
from stalwart.controller.job.events import (
    AgentBack,
    AgentEvent,
    Cancel,
    Inject,
    MachineLost,
    Resumed,
    VersionRegistered,
)
from stalwart.controller.job.ports import JobPorts
from stalwart.controller.job.runner import JobRunner
from stalwart.controller.report.cache import ReportCache
from stalwart.controller.rules.restore import Availability
from stalwart.controller.store.db import Store
from stalwart.controller.store.lease import Lease
from stalwart.controller.store.ops import StartJob
from stalwart.controller.supervise import supervised
from stalwart.errors import Conflict, InvalidRequest, NotFound
from stalwart.security import auth
from stalwart.spec import JobSpec

log = logging.getLogger("stalwart.controller")
RUNNING_STATES = ("pending", "waiting", "running", "recovering", "tracing", "diagnosing", "replaying")
ALIVE_EVERY_S = 1.0
BACKEND_WATCH_S = 1.0     # how often the backend is asked whether the cluster took the machines away
MONITOR_EVERY_S = 0.1
STALL_S = 0.5             # the monitor woke this much later than asked: the controller stalled
CLOSE_WAIT_S = 10.0        # how long close waits for the job threads to finish the event in hand


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
        return self.ctl.registry.alive(machine)

    def last_heard(self, machine: str) -> float | None:
        return self.ctl.registry.last_heard(machine)

    def freshest(self, machines: Iterable[str]) -> float | None:
        return max((t for t in map(self.last_heard, machines) if t is not None), default=None)

    def unheard_since(self, machines: AbstractSet[str], t: float) -> dict[str, float | None]:
        heard = {m: self.last_heard(m) for m in machines}
        return {m: h for m, h in heard.items() if h is None or h <= t}

    def beat_late_s(self) -> float:
        return self.ctl.registry.late_s(clock.now())

    def free(self) -> list[str]:
        return self.ctl.free_for(self.job_id)

    def labels(self, machine: str) -> dict[str, str]:
        return self.ctl.registry.labels(machine)


class Controller:
    def __init__(self, db_url: str, state_dir: str, store_host: str = "127.0.0.1",
                 heartbeat_s: float = 1.0, missed_beats: int = 3, abandon_running: bool = False,
                 backend=None, secret_file: str | None = None, lease: str | None = None, url: str | None = None,
                 on_lease_lost=None, checkpoint_dir: str | None = None,
                 on_phase: Callable[[int, str], None] | None = None):
        """`secret_file`: the controller's secret (credentials and checkpoint keys derive from it;
        default: made once in the state dir). `lease`: share the store with other controllers under
        this holder name ("" for host:pid): wait here until this one holds the lease
        (`controller/store/lease.py`); `on_lease_lost` is called with the reason when another takes it
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
            self.lease = Lease(self.store, lease or None, url, on_lost=on_lease_lost)
            self.lease.acquire()
            self.lease.keep()
        self.reports = ReportCache(self.store)
        self.versions = versions.Versions(self.store)
        self.store_host = store_host
        self.heartbeat_s = heartbeat_s
        self.missed_beats = missed_beats
        self.backend = backend      # backends.base.Backend: evicts, refills, says when the cluster ended
        self._ended: str | None = None             # why the cluster took the machines away
        self.rendezvous = Rendezvous()
        self._lock = threading.Lock()        # (guards _beats_to_write)
        # the machines, with how late beats come on this host (silence rules)
        self.registry = Registry(self.store.machines(), BeatLateness(heartbeat_s))
        self.supply = Supply(backend, self.registry, self.store,
                             trusted=lambda m: not self.verify_identities or m in self.verified)
        self.command_queues = CommandQueues()
        self.jobs: dict[int, JobRunner] = {}
        self._taken_over: list[JobRunner] = []     # started once the API serves (see serving)
        self._down_at: float | None = None
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
        for m in self.registry.clear_roles():
            self.store.upsert_machine(m, state=Role.IDLE.value, job_id=None, reason=None)

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
            runner = JobRunner(self.job_ports(st.job_id), spec, st)
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
        rec = self.registry.register(machine, reg, now)
        self.store.upsert_machine(machine, state=rec.role.value, address=reg.address, info=rec.info,
                                  registered_at=now, last_beat=now, job_id=rec.job_id)
        log.info("machine %s registered (%s, %s)", machine, reg.address, rec.role.value)
        runner = self._runner_of(rec.job_id) or self._runner_holding(machine)
        if runner is not None:
            runner.post(AgentBack(machine=machine, reg=reg))
        return {"ok": True, "heartbeat_s": self.heartbeat_s, "missed_beats": self.missed_beats,
                "role": rec.role.value,
                "steps_batch": True}     # this controller takes merged step reports (protocol.Steps)

    def heartbeat(self, machine: str) -> AgentReply:
        """A machine's heartbeat: OK, or REREGISTER (a machine not alive here)."""
        return self.registry.beat(machine, clock.now())

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
            limit = self.heartbeat_s * self.missed_beats
            if lag > STALL_S:
                # this controller did not run for `lag` seconds (a loaded host, a long pause):
                # heartbeats it could not read are not the machines' silence
                log.warning("controller stalled for %.1fs; heartbeat deadlines extended", lag)
                self.registry.stalled(lag)
            lost = self.registry.lose_overdue(now, limit)
            wait = monitor_wait(now, self.registry.earliest_beat, limit, next_alive)
            if lost and self._cluster_ended():
                lost = []           # the jobs are cancelled with the cluster's reason
            for m in lost:
                last = m.last_beat if m.last_beat is not None else now
                log.warning("machine %s lost: no heartbeat for %.1fs", m.id, now - last)
                with self._lock:
                    self._beats_to_write[m.id] = last
                runner = self._runner_of(m.job_id)
                if runner is not None:
                    runner.post(MachineLost(machine=m.id))

    def _runner_of(self, job_id) -> JobRunner | None:
        return self.jobs.get(job_id) if isinstance(job_id, int) else None

    def _runner_holding(self, machine: str) -> JobRunner | None:
        """The live job whose state names the machine (a slot or a standby): the job's own record
        decides, whatever the machine's row says (a row can lag its job's decision by a moment)."""
        for runner in list(self.jobs.values()):
            if not runner.terminal and machine in runner.held():
                return runner
        return None

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

    def job_ports(self, job_id: int) -> JobPorts:
        """The parts of this controller one job's runner and executor use (`job/ports.py`)."""
        return JobPorts(store=self.store, agents=self.command_queues, machines=self.registry,
                        rendezvous=self.rendezvous, backend=self.supply, cluster=MachineView(self, job_id),
                        store_host=self.store_host, ckpt_dir=self.ckpt_dir(job_id), ckpt_key=self.ckpt_key(job_id),
                        on_phase=self.on_phase)

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
        return [m for m in self.registry.free() if m not in held]

    def machines(self) -> list[dict]:
        """Every machine as `/api/machines` shows it (`machines.Machine.row`)."""
        return self.registry.rows()

    # -- agents -------------------------------------------------------------------------------------
    async def commands(self, machine: str, wait: float) -> list[dict]:
        """The machine's commands, waiting up to `wait` s for one (on the API's event loop)."""
        return await self.command_queues.take(machine, wait)

    def agent_events(self, machine: str, events: list[dict]) -> AgentReply:
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

    def agent_events_typed(self, machine: str, events: list[protocol.Event]) -> AgentReply:
        """A batch of the machine's events; it counts as a heartbeat (an agent whose events flow
        skips its heartbeats). The reply says when the agent must register again, and when the
        batch was not taken (a machine this controller does not know: it restarted; the agent
        keeps the batch and sends it after its registration, so no event is lost)."""
        ack, job_id = self.registry.events(machine, clock.now())
        if not ack.taken:       # (a restarted controller): not taken, the agent sends it again
            return ack
        runner = self._runner_of(job_id)
        if runner is not None and events:
            runner.post_many([AgentEvent(machine=machine, event=ev) for ev in events])
        return ack

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
        self.store.commit(job_id, [StartJob()], S.dumps(st))
        runner = JobRunner(self.job_ports(job_id), spec, st)
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
            catalogue.validate_against(c, len(self.registry), runner.spec.gpus_per_machine,
                                       runner.spec.machines, slots=list(runner.state.slots),
                                       known=self.registry.ids())
            target = self.registry.get(c.machine_id())
            if target is not None and target.isolated is False:    # (None: not known yet, the agent says)
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
