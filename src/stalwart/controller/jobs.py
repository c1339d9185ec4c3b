"""One state machine per job: waiting for machines -> running -> recovering -> ... -> finished.

The runner owns a job's live state and executes what the pure rules in `policy` decide. Everything
it learns arrives in its inbox (agent events, lost machines, injections, cancel) and is handled on
its own thread, so no lock is needed around the job's state. Every step of every incident is written
to the store as an event with a timestamp, which is what the ETTR ledger is rebuilt from.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from stalwart.agent.classify import classify
from stalwart.chaos import catalogue
from stalwart.controller import policy, restore, versions
from stalwart.controller.diagnose_flow import DiagnoseFlow
from stalwart.controller.hangwatch import HangWatch
from stalwart.controller.hotupdate import HotUpdateFlow, version_env, versionable
from stalwart.controller.implicit_flow import TRACE_TIMEOUT_S, ImplicitFlow
from stalwart.controller.pool import PoolFlow, standby_count
from stalwart.controller.replay_flow import ReplayFlow
from stalwart.spec import JobSpec

if TYPE_CHECKING:
    from stalwart.controller.service import Controller

log = logging.getLogger("stalwart.controller")
TERMINAL = ("succeeded", "failed", "cancelled")
# Evidence keeps arriving for a moment after the first symptom (the probe alert behind a crash, the
# second network alert): localize no earlier than this after detection. Probes run every second.
EVIDENCE_SETTLE_S = 1.5


def _detail_text(detail) -> str:
    """A probe's detail as one readable line (its log text when it has one)."""
    if isinstance(detail, dict):
        if detail.get("text"):
            return str(detail["text"])
        return ", ".join(f"{k}={v}" for k, v in detail.items())
    return str(detail or "")


class JobRunner(ImplicitFlow, HotUpdateFlow, DiagnoseFlow, ReplayFlow, PoolFlow):
    def __init__(self, ctl: "Controller", job_id: int, spec: JobSpec):
        self.ctl, self.store, self.job_id, self.spec = ctl, ctl.store, job_id, spec
        self.topo = spec.topology()
        self.world = self.topo.world_size
        self.G = spec.gpus_per_machine
        self.inbox: queue.Queue = queue.Queue()
        self.state = "waiting"
        self.reason: str | None = None
        self.slots: list[str] = []            # slot i (ranks i*G..) -> machine id
        self.standby: list[str] = []          # machines kept warm for this job
        self.warm: set[str] = set()           # standbys whose workers are pre-spawned
        self.run_seq = 0
        self.run_id: int | None = None
        self.run_started_at = 0.0
        self.steps_done = 0                   # steps completed and not lost (next step to run)
        self.best_steps = 0
        self.progress_at_run_start = 0
        self.restarts_without_progress = 0
        self.pending_steps: dict[int, dict] = {}
        self.last_loss: float | None = None
        self.step_times: list[tuple[float, int]] = []
        self.done_ranks: set[int] = set()
        self.chaos_pending = [catalogue.parse(c) for c in spec.chaos]
        self.incident: dict | None = None     # the open incident, with its evidence
        self.awaiting_resume: list[int] = []  # incidents whose new run has not completed a step
        self.alerts: list[policy.Alert] = []
        self.chaos_applied: list[dict] = []
        # every rank's checkpoint copies, by tier
        self.avail = restore.Availability(memory={"own": max(2, spec.policy.mem_slots - 1), "backup": 2})
        self.bad_steps: set[int] = set()      # steps some rank could not restore
        self.restore_tiers: dict[int, str] = {}
        self.restore_skipped: dict[int, list[str]] = {}   # tiers tried first and why they failed
        self.hang: HangWatch | None = None
        self.versions = versions.Versions(self.store)
        self.code_path = spec.code_dir          # where the workers' code lives (a version snapshot)
        self.version: dict | None = None        # the code version the workers run
        self.versioning_off: str | None = None
        self.spares_prep: dict | None = None    # spares warming up on a coming version (hotupdate)
        self.loss_hist: list[float] = []
        self.step_durs: list[float] = []       # committed step durations of this run (fail-slow)
        self.rank_times: list[dict] = []       # recent steps: rank -> (step s, compute s)
        self.failslow: dict | None = None      # fail-slow rounds in progress
        self.failslow_quiet_until = 0.0
        self.failslow_ref_s: float | None = None   # the fastest 20-step pace of this run (fail-slow)
        self.grad_hist: list[float] = []
        self.diag: dict | None = None          # stop-time checks in progress (diagnose_flow)
        self.replay: dict | None = None        # dual-phase replay in progress (replay_flow)
        self.created_at = time.time()
        self.thread = threading.Thread(target=self._loop, name=f"job-{job_id}", daemon=True)

    # -- plumbing ---------------------------------------------------------------------------
    def start(self) -> None:
        self.event("job_submitted", {"spec": self.spec.to_dict()}, t=self.created_at)
        self.thread.start()

    def post(self, kind: str, **data) -> None:
        self.inbox.put((kind, data))

    def event(self, kind: str, data: dict, t: float | None = None) -> None:
        self.store.add_event(self.job_id, kind, data, t=t)

    def _loop(self) -> None:
        last_tick = 0.0
        while self.state not in TERMINAL:
            try:
                kind, data = self.inbox.get(timeout=0.2)
            except queue.Empty:
                kind, data = "tick", {}
            self._handle(kind, data)
            if kind != "tick" and time.time() - last_tick >= 0.2 and self.state not in TERMINAL:
                self._handle("tick", {})          # timers run even while events keep flowing
            if kind == "tick" or time.time() - last_tick >= 0.2:
                last_tick = time.time()

    def _handle(self, kind: str, data: dict) -> None:
        try:
            getattr(self, f"_on_{kind}")(**data)
        except Exception as e:  # a bug must not leave the job silently stuck
            log.exception("job %s: handling %s failed", self.job_id, kind)
            self._finish("failed", f"internal error while handling {kind}: {e}")
        self.ctl.job_finished(self)

    # -- waiting for machines ------------------------------------------------------------------
    def _on_tick(self) -> None:
        now = time.time()
        if self.state == "waiting":
            self._try_start(now)
        elif self.state == "recovering":
            self._check_stopped(now)
        elif self.state == "diagnosing":
            self._diagnose_tick(now)
        elif self.state == "replaying":
            self._replay_check(now)
        elif self.state == "tracing" and now - self.incident["trace_sent"] > TRACE_TIMEOUT_S:
            self._finish_trace(now)
        elif self.state == "running" and self.version is not None and self._update_ready(now):
            self._open_incident("hot_update", now)
        elif self.state == "running" and self.failslow is not None:
            self._failslow_tick(now)
        if self.state == "running":
            self._similarity_tick(now)
            self._refill_pool(now)
        if self.state == "running" and self.hang is not None:
            verdict = self.hang.check(now)
            if verdict is not None:
                self._open_incident("hang", now, trace=True)
                self.incident["reason"] = verdict.reason

    def _try_start(self, now: float) -> None:
        free = self.ctl.free_machines()
        want_standby = standby_count(self.spec)
        enough_all = len(free) >= self.spec.machines + want_standby
        waited = now - self.created_at > self.spec.policy.max_standby_wait_s
        if not enough_all and not (len(free) >= self.spec.machines and waited):
            return
        self.slots = free[: self.spec.machines]
        self.standby = free[self.spec.machines: self.spec.machines + want_standby]
        for m in self.slots:
            self.ctl.set_machine(m, state="active", job_id=self.job_id)
        self.versioning_off = versionable(self.spec.code_dir, self.ctl.state_dir)
        if self.versioning_off is None:
            self._use_version(self.versions.register(self.job_id, self.spec.code_dir, self.ctl.state_dir,
                                                     "lazy", self.spec.policy.hot_update_window_s, now))
        else:
            log.info("job %s: hot update off: %s", self.job_id, self.versioning_off)
        for m in self.standby:    # after the version: standbys warm up on the code the runs use
            self.ctl.set_machine(m, state="standby", job_id=self.job_id)
            self._prewarm(m)
        self.store.update_job(self.job_id, state="running")
        self._start_run(-1, {})

    def _prewarm(self, m: str) -> None:
        self.ctl.send(m, {"type": "prewarm", "command": self.spec.command, "cwd": self.code_path,
                          "count": self.G, "env": self._common_env(run=None, port=None)})
        self.warm.add(m)

    # -- runs ------------------------------------------------------------------------------------
    def _common_env(self, run: int | None, port: int | None, version: dict | None = None) -> dict:
        """The environment every worker of a run gets (`version`: of another code version than
        the current one, for spares warming up on it)."""
        s, t = self.spec, self.topo
        version = version or self.version
        env = dict(s.env)
        env.update({"WORLD_SIZE": self.world, "LOCAL_WORLD_SIZE": self.G,
                    "STALWART_JOB": self.job_id, "STALWART_TP": t.tp, "STALWART_PP": t.pp,
                    "STALWART_DP": t.dp, "STALWART_CP": t.cp, "STALWART_EP": t.ep, "STALWART_REPLAY": 0,
                    "STALWART_MACHINES": s.machines, "STALWART_GPUS_PER_MACHINE": self.G,
                    "STALWART_STEPS": s.steps, "STALWART_CKPT_EVERY": s.ckpt_every,
                    "STALWART_MEM_SLOTS": s.policy.mem_slots,
                    "STALWART_CKPT_DIR": self.ctl.ckpt_dir(self.job_id),
                    "TORCHELASTIC_RUN_ID": f"stalwart-{self.job_id}"})
        if version is not None:
            env.update(version_env(version["path"], version["id"]))
        if run is not None:
            env.update({"STALWART_RUN": run, "MASTER_ADDR": self.ctl.store_host, "MASTER_PORT": port,
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": run})
        return env

    def _workers_of(self, i: int) -> list[dict]:
        """The worker entries of a start command for the i-th machine of a run (ranks i*G..)."""
        return [{"rank": r, "env": {"RANK": r, "LOCAL_RANK": r - i * self.G, "GROUP_RANK": i}}
                for r in range(i * self.G, (i + 1) * self.G)]

    def _start_run(self, restore_step: int, cands: dict[int, list[dict]]) -> None:
        self.run_seq += 1
        port = self.ctl.rendezvous.open(self.job_id, self.run_seq)
        env = self._common_env(self.run_seq, port)
        env["STALWART_RESTORE_STEP"] = restore_step
        start_step = restore_step + 1
        self.restore_tiers, self.restore_skipped = {}, {}
        for i, m in enumerate(self.slots):
            workers = self._workers_of(i)
            for w in workers:
                if cands.get(w["rank"]):
                    w["restore"] = [dict(c, addr=self.ctl.peer_addr(c["holder"])) if c["tier"] == "backup"
                                    else c for c in cands[w["rank"]]]
            backup = self.slots[self.topo.backup_machine(i)] if self.spec.machines > 1 else None
            ckpt = {"durable_dir": self.ctl.ckpt_dir(self.job_id), "every": self.spec.ckpt_every,
                    "backup": {"machine": backup, "addr": self.ctl.peer_addr(backup)}
                    if backup and self.ctl.peer_addr(backup) else None}
            cmd = {"run": self.run_seq, "command": self.spec.command, "cwd": self.code_path,
                   "env": env, "workers": workers, "ckpt": ckpt}
            if m in self.warm:
                self.warm.discard(m)
                self.ctl.send(m, dict(cmd, type="activate"))
            else:
                self.ctl.send(m, dict(cmd, type="start"))
        now = time.time()
        self.run_id = self.store.create_run(self.job_id, self.run_seq, start_step, now,
                                            {str(i): m for i, m in enumerate(self.slots)},
                                            {"step": restore_step} if restore_step >= 0 else None)
        self.event("run_started", {"run": self.run_seq, "start_step": start_step,
                                   "machines": list(self.slots)}, t=now)
        self.state, self.run_started_at = "running", now
        self.hang = HangWatch(self.spec.policy, ranks=range(self.world), started_at=now)
        self.step_durs, self.failslow, self.rank_times, self.failslow_ref_s = [], None, [], None
        self._new_peerwatch(now)
        self.pending_steps.clear()
        self.done_ranks.clear()
        self.steps_done = start_step
        self.progress_at_run_start = self.best_steps

    # -- agent events ----------------------------------------------------------------------------
    def _on_agent_event(self, machine: str, ev: dict) -> None:
        kind = ev.get("type")
        if self.state == "replaying" and kind in ("step", "done", "worker_exit"):
            return self._replay_event(machine, ev)
        handler = getattr(self, f"_agent_{kind}", None)
        if handler is not None:
            handler(machine, ev)

    def _agent_step(self, machine: str, ev: dict) -> None:
        if ev.get("run") != self.run_seq or self.state != "running":
            return
        s = int(ev["step"])
        acc = self.pending_steps.setdefault(s, {"ranks": set(), "t": 0.0, "dur": 0.0})
        acc["ranks"].add(ev["rank"])
        acc.setdefault("local", {})[ev["rank"]] = ev.get("local_grad_norm")
        acc.setdefault("times", {})[ev["rank"]] = (ev.get("dur"), ev.get("compute_s"))
        if self.hang is not None:
            self.hang.on_step(ev["rank"], s, ev["t"])
        acc["t"] = max(acc["t"], ev["t"])
        acc["dur"] = max(acc["dur"], ev.get("dur") or 0.0)
        if ev["rank"] == 0 or "loss" not in acc:
            for k in ("loss", "grad_norm", "tokens"):
                if ev.get(k) is not None:
                    acc[k] = ev[k]
        if len(acc["ranks"]) == self.world:
            self._commit_step(s, self.pending_steps.pop(s))

    def _commit_step(self, s: int, acc: dict) -> None:
        data = {"run": self.run_seq, "step": s, "dur": acc["dur"], "loss": acc.get("loss"),
                "grad_norm": acc.get("grad_norm"), "tokens": acc.get("tokens")}
        self.event("step", data, t=acc["t"])
        self.steps_done = max(self.steps_done, s + 1)
        self.best_steps = max(self.best_steps, self.steps_done)
        self.last_loss = acc.get("loss", self.last_loss)
        if self._training_anomaly(s, acc):
            return
        self._watch_throughput(acc["dur"], acc["t"], acc.get("times", {}))
        self._peer_times(acc["t"], acc.get("times", {}))
        if self.version is not None and self.version["status"] == "applied" \
                and versions.is_healthy(self.version, self.steps_done):
            promoted = self.versions.promote_if_healthy(self.job_id, self.steps_done, time.time())
            if promoted is not None:
                self._use_version(promoted)
        self.step_times.append((acc["t"], s))
        self.step_times = self.step_times[-50:]
        for inc_id in self.awaiting_resume:
            self.store.update_incident(inc_id, resumed_at=acc["t"])
            self.event("incident_resumed", {"incident": inc_id}, t=acc["t"])
        self.awaiting_resume.clear()
        self._fire_chaos()

    def _fire_chaos(self) -> None:
        due = [c for c in self.chaos_pending if c.step is not None and self.steps_done >= c.step]
        for c in due:
            self.chaos_pending.remove(c)
            self.inject(c)

    def inject(self, c: catalogue.ChaosSpec) -> None:
        m = c.machine_id()
        self.event("chaos_sent", c.to_dict())
        self.ctl.send(m, {"type": "chaos", "kind": c.kind, "rank": c.rank, "step": self.steps_done,
                          "from_step": self.steps_done, **c.params})

    def _on_inject(self, spec: dict) -> None:
        self.inject(catalogue.ChaosSpec(**spec))

    def _agent_chaos_applied(self, machine: str, ev: dict) -> None:
        self.chaos_applied.append(ev)
        self.event("chaos_applied", {"machine": machine, "kind": ev.get("kind"),
                                     "rank": ev.get("rank")}, t=ev.get("injected_at"))

    def _agent_ckpt(self, machine: str, ev: dict) -> None:
        rank, step, tier = int(ev["rank"]), int(ev["step"]), ev["tier"]
        if tier == "durable":
            self.store.add_checkpoint(self.job_id, step, rank, tier, ev["location"],
                                      ev.get("checksum", ""), ev["t"])
            self.avail.add(rank, tier, step, ev["location"])
        else:
            self.avail.add(rank, tier, step, ev["holder"])

    def _agent_started(self, machine: str, ev: dict) -> None:
        if ev.get("run") == self.run_seq:
            self.event("workers_started", {"run": ev["run"], "machine": machine, "warm": bool(ev.get("warm"))})

    def _agent_restore_source(self, machine: str, ev: dict) -> None:
        if ev.get("run") != self.run_seq:
            return
        self.restore_tiers[int(ev["rank"])] = ev["tier"]
        if ev.get("skipped"):
            self.restore_skipped[int(ev["rank"])] = ev["skipped"]
        if len(self.restore_tiers) == self.world:
            self.store.update_run(self.run_id, restore={
                "step": ev["step"], "tiers": {str(r): t for r, t in sorted(self.restore_tiers.items())},
                "skipped": {str(r): e for r, e in sorted(self.restore_skipped.items())}})
        self.event("restore_source", {"run": self.run_seq, "rank": ev["rank"], "tier": ev["tier"],
                                      "step": ev["step"], "skipped": ev.get("skipped", [])})

    def _agent_restore_failed(self, machine: str, ev: dict) -> None:
        if ev.get("run") != self.run_seq:
            return
        self.bad_steps.add(int(ev["step"]))
        self.event("restore_failed", {"run": self.run_seq, "rank": ev["rank"], "error": ev.get("error")})
        if self.state == "running":
            self._open_incident("restore_failed", ev["t"])

    def _agent_worker_exit(self, machine: str, ev: dict) -> None:
        if ev.get("run") != self.run_seq or ev.get("expected") or ev.get("rank") is None:
            return
        if ev.get("code") == 0:
            self.done_ranks.add(ev["rank"])
            if len(self.done_ranks) == self.world and self.state == "running":
                self._finish("succeeded", None)
            return
        sym = classify(ev.get("log_tail") or "", ev.get("code"), ev.get("signal"), self.code_path)
        exit_ = policy.Exit(machine=machine, rank=ev["rank"], code=ev.get("code"),
                            signal=ev.get("signal"), symptom=sym.name, category=sym.category,
                            secondary=sym.secondary, machine_certain=sym.machine_certain,
                            user_code=sym.user_code, detail=sym.detail, t=ev["t"],
                            location=sym.location)
        self._open_incident(exit_.symptom, ev["t"])
        self.incident["exits"].append(exit_)

    def _agent_command_failed(self, machine: str, ev: dict) -> None:
        """A command the agent could not carry out (e.g. a chaos kind this host cannot do)."""
        log.warning("job %s: %s on %s failed: %s", self.job_id, ev.get("kind") or ev.get("command"),
                    machine, ev.get("error"))
        self.event("command_failed", {"machine": machine, "command": ev.get("command"),
                                      "kind": ev.get("kind"), "error": ev.get("error")})

    def _agent_done(self, machine: str, ev: dict) -> None:
        """An SDK worker finished its last step (it exits right after)."""
        if ev.get("run") == self.run_seq and self.state == "running":
            self.done_ranks.add(ev["rank"])
            if len(self.done_ranks) == self.world and self.steps_done >= self.spec.steps:
                self._finish("succeeded", None)

    def _agent_stopped(self, machine: str, ev: dict) -> None:
        for tier, held in (ev.get("inventory") or {}).items():
            self.avail.replace_held(machine, tier, {int(r): v for r, v in held.items()})
        if self.incident is not None and ev.get("run") == self.run_seq:
            self.incident["awaiting"].discard(machine)
            if self.state == "recovering" and not self.incident["awaiting"]:
                self._check_stopped(time.time())    # the last one: no need to wait for a tick

    def _agent_health(self, machine: str, ev: dict) -> None:
        alert = policy.Alert(machine=machine, kind=ev["kind"], severity=ev["severity"],
                             machine_certain=bool(ev.get("machine_certain")),
                             network=bool(ev.get("network")), detail=_detail_text(ev.get("detail")),
                             t=ev["t"])
        self.event("health", {"machine": machine, "kind": alert.kind, "severity": alert.severity},
                   t=alert.t)
        snap = self._snapshot()
        self.alerts = [a for a in self.alerts if alert.t - a.t <= self.spec.policy.network_alert_window_s]
        if self.incident is not None:
            self.incident["alerts"].append(alert)
        elif self.state == "running" and policy.should_open_incident(alert, snap, alert.t):
            self._open_incident(alert.kind, alert.t)
            self.incident["alerts"].extend(self.alerts + [alert])
        self.alerts.append(alert)

    def _on_machine_lost(self, machine: str) -> None:
        if machine in self.slots and self.state in ("running", "recovering"):
            self._open_incident("machine_lost", time.time())
            self.incident["lost"].add(machine)
            self.incident["awaiting"].discard(machine)
        if machine in self.standby:
            self.standby.remove(machine)
            self.warm.discard(machine)

    def _on_cancel(self, reason: str) -> None:
        self._finish("cancelled", reason)

    # -- incidents ------------------------------------------------------------------------------
    def _open_incident(self, symptom: str, t: float, trace: bool = False) -> None:
        """Open an incident and stop the run; with `trace`, first capture every machine's stacks."""
        if self.incident is not None:
            return
        now = time.time()
        implicit_kind = symptom in ("hang", "nan", "loss_spike", "fail_slow", "peer_outlier")
        planned = symptom == "hot_update"
        inc_id = self.store.create_incident(self.job_id, run_seq=self.run_seq, symptom=symptom,
                                            category="implicit" if implicit_kind else
                                            "manual" if planned else "explicit",
                                            detected_at=now, suspects=[], evicted=[], data={})
        self.incident = {"id": inc_id, "detected_at": now, "exits": [], "lost": set(),
                         "alerts": [], "awaiting": set(self.slots), "stop_sent": now,
                         "symptom": symptom, "implicit": implicit_kind, "stacks": {}, "planned": planned}
        self.event("incident_opened", {"incident": inc_id, "symptom": symptom, "injected_at": None,
                                       "planned": planned}, t=now)
        if trace:
            self.state = "tracing"
            self.incident.update(trace_wait=set(self.slots), trace_sent=now)
            for m in self.slots:
                self.ctl.send(m, {"type": "trace", "run": self.run_seq})
            return
        self._stop_run(now)

    def _stop_run(self, now: float) -> None:
        self.incident["stop_sent"] = now
        self.state = "recovering"
        for m in self.slots:
            self.ctl.send(m, {"type": "stop", "run": self.run_seq,
                              "grace_s": self.spec.policy.stop_grace_s})
        log.info("job %s: incident %s; stopping run %s", self.job_id, self.incident["id"], self.run_seq)

    def _check_stopped(self, now: float) -> None:
        inc = self.incident
        limit = inc["stop_sent"] + 10.0 + self.spec.policy.heartbeat_s * self.spec.policy.missed_beats
        hb = self.spec.policy.heartbeat_s
        for m in policy.silent_during_stop(inc["awaiting"], {m: self.ctl.last_heard(m) for m in inc["awaiting"]},
                                           now, hb):
            inc["awaiting"].discard(m)
            inc["lost"].add(m)
            log.warning("job %s: %s silent for %d heartbeats after the stop: lost", self.job_id, m,
                        policy.SILENT_BEATS)
        explained = policy.cause_in_hand(inc["planned"], tuple(inc["exits"]), tuple(inc["alerts"]),
                                         tuple(inc["lost"]))
        if (inc["awaiting"] and now < limit) or \
                (not explained and now < inc["detected_at"] + EVIDENCE_SETTLE_S):
            return
        for m in inc["awaiting"]:  # alive but did not stop: cannot be trusted with ranks
            inc["lost"].add(m)
        inc["awaiting"] = set()
        self.event("run_stopped", {"run": self.run_seq})
        self.store.update_run(self.run_id, stopped_at=now, end_step=self.steps_done)
        self._localize(now)

    def _snapshot(self) -> policy.Snapshot:
        p = self.spec.policy
        ready = tuple(m for m in self.standby if self.ctl.machine_alive(m))
        return policy.Snapshot(active=tuple(self.slots), standby_ready=ready,
                               restarts_without_progress=self.restarts_without_progress,
                               max_restarts_without_progress=p.max_restarts_without_progress,
                               network_alert_count=p.network_alert_count,
                               network_alert_window_s=p.network_alert_window_s,
                               recent_alerts=tuple(self.alerts))

    def _localize(self, now: float) -> None:
        inc = self.incident
        if self.best_steps <= self.progress_at_run_start:
            self.restarts_without_progress += 1
        else:
            self.restarts_without_progress = 0
        if inc["planned"]:
            return self._apply_update(inc, now)
        snap = self._snapshot()
        ev = policy.Evidence(exits=tuple(inc["exits"]), lost=tuple(sorted(inc["lost"])),
                             alerts=tuple(inc["alerts"]),
                             implicit_symptom=inc["symptom"] if inc["implicit"] else None,
                             implicit_evict=tuple(inc.get("implicit_evict", ())),
                             implicit_reason=inc.get("reason", ""))
        res = policy.resolve(snap, ev, now)
        if self._maybe_diagnose(inc, res, now):
            return
        self._recover(inc, res, now)

    def _recover(self, inc: dict, res: policy.Resolution, now: float) -> None:
        """Record how the incident was localized and restart (or fail) accordingly."""
        injected = [c["injected_at"] for c in self.chaos_applied
                    if c.get("injected_at") and c["injected_at"] <= inc["detected_at"] + 0.5
                    and inc["detected_at"] - c["injected_at"] < 120]
        injected_at = max(injected) if injected else None
        self.store.update_incident(inc["id"], symptom=res.symptom, category=res.category,
                                   cause=res.cause, suspects=res.suspects, evicted=res.evict,
                                   mechanism=res.mechanism, localized_at=now,
                                   injected_at=injected_at)
        self.event("incident_localized", {"incident": inc["id"], "injected_at": injected_at,
                                          "mechanism": res.mechanism}, t=now)
        self.incident = None
        self.awaiting_resume.append(inc["id"])
        if self.version is not None and res.mechanism in ("fail", "reattempt") and not res.evict:
            why = versions.rollback_reason(self.versions.current(self.job_id),
                                           self.store.incidents(self.job_id), now + 1e-6)
            if why is not None:       # the new code is to blame: back to the last stable version
                self._use_version(self.versions.rollback(self.job_id, why, now))
                self.store.update_incident(inc["id"], mechanism="rollback", cause=f"{res.cause}; {why}")
                self.event("version_rolled_back", {"incident": inc["id"], "to": self.version["id"]})
                res.mechanism = "rollback"
        if res.mechanism == "fail":
            self._finish("failed", res.fail_reason)
            return
        plan = policy.replacement_plan(tuple(self.slots), res.evict, self._snapshot().standby_ready)
        for m in set(inc["lost"]) | set(res.evict):
            self.avail.drop_machine(m)     # its memory (own shards, peers' backups) is gone
        for old, new in plan.items():
            self.ctl.set_machine(old, state="evicted", reason=res.cause)
            self.ctl.send(old, {"type": "stop", "run": None})
            self.slots[self.slots.index(old)] = new
            self.standby.remove(new)
            self.ctl.set_machine(new, state="active")
        if self.version is not None and res.mechanism != "rollback":
            due = self._due_version(now, at_failure=True)   # lazy updates ride on the recovery
            if due is not None:
                self._use_version(self.versions.apply(due["id"], now, self.steps_done, "lazy update at "
                                                      f"the restart after incident {inc['id']}"))
                self.event("version_applied", {"version": due["id"], "incident": inc["id"]})
        self._restart()

    def _restart(self) -> None:
        next_machine = {r: self.slots[self.topo.machine_of(r)] for r in range(self.world)}
        alive = {m for m in self.slots if self.ctl.machine_alive(m)}
        step, cands = restore.plan(self.avail, self.world, next_machine, alive, self.bad_steps)
        self._start_run(step, cands)

    # -- the end -------------------------------------------------------------------------------
    def _finish(self, state: str, reason: str | None) -> None:
        if self.state in TERMINAL:
            return
        self.state, self.reason = state, reason
        now = time.time()
        for m in self.slots + self.standby:
            self.ctl.send(m, {"type": "stop", "run": None})
            if self.ctl.machine_state(m) in ("active", "standby"):
                self.ctl.set_machine(m, state="idle", job_id=None)
        if self.run_id is not None:
            self.store.update_run(self.run_id, stopped_at=now, end_step=self.steps_done)
        self.event("job_finished", {"state": state, "reason": reason}, t=now)
        self.store.update_job(self.job_id, state=state, reason=reason, finished_at=now)
        self.ctl.rendezvous.close_job(self.job_id)
        log.info("job %s %s%s", self.job_id, state, f": {reason}" if reason else "")

    # -- live status -----------------------------------------------------------------------------
    def live(self) -> dict:
        rate = None
        if len(self.step_times) >= 2:
            (t0, s0), (t1, s1) = self.step_times[0], self.step_times[-1]
            if t1 > t0 and s1 > s0:
                rate = (s1 - s0) / (t1 - t0)
        return {"state": self.state, "run": self.run_seq, "step": self.steps_done,
                "steps_target": self.spec.steps, "loss": self.last_loss, "steps_per_s": rate,
                "slots": list(self.slots), "standby": list(self.standby), "reason": self.reason}
