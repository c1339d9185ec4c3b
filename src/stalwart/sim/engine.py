"""The simulation loop: stalwart's real job core on a simulated clock, against simulated machines.

A heap of timed happenings (faults, agents' answers, machines arriving, the core's ticks) is
played in time order. The job core (`controller.job.core.JobCore`, with the controller's flows,
policy, ladder, restore planner, standby pool and ledger) receives the protocol's events exactly as
the controller's runner hands them over, and its actions are carried out by the simulated agents
(`agents.py`) after the profile's durations. Nothing of the decision path is re-implemented here.

What is compressed, so that 1,200 machines x 90 days run in seconds:

- **ranks**: the core sees one rank per machine (a machine's 8 GPUs, one tensor-parallel group,
  fail, stop, restore and report together here), so the job is `machines` ranks with the real
  pipeline x data-parallel layout;
- **steps**: agents tell the core of training progress when it has something to decide (before
  every event it receives and every tick), one report of the last completed step per machine,
  with that step's true time and duration. The steps completed in between are written to the job's
  event log as one `step` record per stretch (split at durable checkpoints and at the last steps
  kept in memory), so the ETTR ledger accounts every second of training exactly;
- **quiet stretches**: while the job trains and nothing is pending, the core is not ticked (it
  would only see progress); it is ticked again before anything happens: a fault, an agent's
  answer, a machine arriving, a code version falling due. Before a hang or a slowdown the agents
  report every step for `PRE_STEPS` steps, so the core's hang timeout and throughput baseline are
  calibrated on real step times, as they would be on a real job;
- **ticks** while something is pending come every `tick_min_s`, spaced out by 5% of the time since
  the last change up to `tick_max_s` (the controller ticks every 0.2 s): a timer fires at most
  that late;
- per-step checkpoint reports (`ckpt` events) are not sent: the agents' inventories at each stop
  say what memory holds, as they do for the real controller; durable checkpoints are reported
  (the newest, when a run stops: only a restore reads them).
"""
from __future__ import annotations

import gc
import heapq
import math
import random
from typing import Any, Callable

from stalwart import protocol as p
from stalwart.controller.job import actions as a
from stalwart.controller.job import state as S
from stalwart.controller.job.core import JobCore
from stalwart.controller.job.events import (AgentEvent, AgentEvents, JobEvent, MachineLost, StepReport, StopReport,
                                            Tick)
from stalwart.controller.cluster.standby import p99_standbys
from stalwart.controller.cluster.roles import Role
from stalwart.controller.rules.restore import Availability
from stalwart.sim.agents import Agents
from stalwart.sim.cluster import SimCluster
from stalwart.sim.config import Config, Segment
from stalwart.sim.durations import Durations
from stalwart.sim.failures import Fault, Model
from stalwart.sim.injection import Injection
from stalwart.sim.pace import Pace
from stalwart.sim.peers import Platform
from stalwart.sim.profile import Profile
from stalwart.sim.training import Training
from stalwart.spec import JobSpec

T0 = 1_000_000.0          # the core's clock at the simulation's start
DAY = 86400.0
PRE_STEPS = 22            # steps reported one by one before a hang or a slowdown (the hang watch keeps 20)
HANG_FLOOR_S = 30.0       # the uncalibrated hang timeout (10x this) outlasts a restart at this scale
SLOW_WATCH_EXTRA_S = 600.0  # beyond the slowdown detectors' own windows (see `watching_slow`)
# the actions that are the store's and the rendezvous' business: nothing simulated
NOTHING_SIMULATED = (a.CreateRun, a.UpdateRun, a.SaveVersion, a.AddCheckpoint, a.CloseScratch)
GC_EVERY = 200_000          # allocations between the cyclic collector's young collections (see `run`)


class Sim:
    t0 = T0

    def __init__(self, cfg: Config, platform: Platform, profile: Profile, model: Model, faults: list[Fault],
                 seed: int):
        cfg.check()
        self.cfg, self.platform, self.model, self.seed = cfg, platform, model, seed
        self.now = T0
        self.profile: Any = Durations(profile, model, seed, lambda: self.now)
        self.rng = random.Random(f"{seed}/{platform.name}/sim")
        self.faults = faults
        self.end = T0 + cfg.days * DAY
        self.heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self.spec = self._spec()
        topo = self.spec.topology()
        self.dp = topo.dp
        self.ckpt_every = self.spec.ckpt_every
        self.backed_up_by: list[list[int]] = [[] for _ in range(cfg.machines)]
        for r in range(cfg.machines):
            self.backed_up_by[topo.backup_machine(r)].append(r)
        self.standbys = self.spec.standby if isinstance(self.spec.standby, int) else 0
        self.cluster = SimCluster(cfg.machines, cfg.pp, self.dp, free=self.standbys, seed=seed,
                                  show_labels=platform.topology)
        self.agents = Agents(self)
        self.injection = Injection(self, self.agents, model, lambda m: self.cluster.true_labels(m).get("switch"),
                                   platform.hot_update, lambda: self.profile.storage_outage_s, self.rng)
        self.pace = Pace(cfg, self.dp, self.ckpt_every, seed, model.slowdown,
                         lambda: self.profile.memckpt_overhead if platform.memory_ckpt else 0.0,
                         self.cluster.true_labels, self.pipeline_slots)
        self.core: JobCore | None = None
        self.st: S.JobState | None = None
        self.seg: Segment | None = None
        self.segments: list[Segment] = []
        self.gaps: list[tuple[float, float, str]] = []
        self.training: Training | None = None
        self.last_slots: list[str] | None = None
        self.slow_since = 0.0         # when the current run's first machine turned slow
        pol = self.spec.policy        # how long the slowdown detectors may take (see `watching_slow`)
        self.slow_watch_s = 2 * (pol.similarity_window_s + pol.similarity_continuity_s
                                 + pol.failslow_rounds * pol.failslow_period_s) + SLOW_WATCH_EXTRA_S
        self.stuck = False
        self.warm_at: dict[str, float] = {}
        self.last_change = T0
        self.busy_until = T0
        self.next_tick = math.inf
        self.dirty = False           # the core acted: its timers may want a tick sooner
        self.open_symptom: str | None = None
        self.incidents: list[dict] = []
        self._inc: dict[tuple[int, int], dict] = {}
        self._pipes: dict[int, list[int]] = {}
        self.coming = 0               # machines the scheduler is providing
        self.resume_from_memory = False
        self.stats = {"core_events": 0, "ticks": 0, "reports": 0, "dead_drained": 0}

    # -- the job ----------------------------------------------------------------------------------
    def _spec(self) -> JobSpec:
        cfg, plat, pr = self.cfg, self.platform, self.profile
        # the hang watch's uncalibrated timeout (10 x its floor) must outlast a (re)start's longest
        # time to the first step, or every slow start is taken for a hang
        start_s = pr.bound("restart_s") + pr.bound("warmup_s") + pr.bound("durable_load_s")
        floor = max(HANG_FLOOR_S, 1.05 * start_s / 10.0)
        policy: dict[str, Any] = {"hang_timeout_floor_s": floor,
                                  "replay_timeout_s": max(90.0, 2 * pr.bound("replay_phase_s")),
                                  "diag_timeout_s": max(10.0, pr.bound("checks_s")),
                                  # the simulated agents start their workers at once (restart_s is
                                  # the whole time to the first step) and send no start report
                                  "worker_start_s": 0.0}
        if plat.nccl_hang:
            # a hang is seen when the collective times out (nccl_timeout_s: ByteRobust's 10 minutes of
            # zero RDMA traffic, PyTorch's NCCL timeout), from the first step on: the hang watch's
            # calibrated timeout (safety x step) and its warm-up one (10 x floor) are both that long
            policy.update(hang_timeout_floor_s=max(floor, pr.nccl_timeout_s / 10.0),
                          hang_safety_factor=max(1.0, pr.nccl_timeout_s / cfg.step_s))
        policy.update(plat.policy)
        policy["daily_failure_rate"] = self.model.daily_rate
        self.warm_standbys = 0
        if plat.standby:
            self.warm_standbys = p99_standbys(cfg.machines, self.model.daily_rate) if cfg.standby == "auto" \
                else int(cfg.standby)
        # the scheduler reschedules an eviction's shortfall (the paper's policy): the job core may count
        # on up to a pipeline group of machines, those beyond the warm pool arriving after provision_s
        standby = max(self.warm_standbys, cfg.pp) if plat.reschedule and plat.standby else self.warm_standbys
        return JobSpec.from_dict({
            "name": "sim", "machines": cfg.machines, "gpus_per_machine": 1, "tp": 1, "pp": cfg.pp,
            "steps": 10 ** 12, "ckpt_every": max(1, round(cfg.durable_every_s / cfg.step_s)),
            "command": ["train.py"], "standby": standby, "code_dir": "/sim/code/v1", "policy": policy})

    def version_row(self, n: int, status: str, mode: str) -> dict:
        return {"id": n, "job_id": 1, "hash": f"{n:064x}", "path": f"/sim/code/v{n}", "source": "/sim/code",
                "status": status, "mode": mode, "window_s": self.spec.policy.hot_update_window_s,
                "created_at": self.now, "applied_at": self.now if status == "stable" else None,
                "applied_step": 0 if status == "stable" else None, "reason": None}

    # -- the loop ---------------------------------------------------------------------------------
    def later(self, delay: float, fn: Callable, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (self.now + max(0.0, delay), self._seq, fn, args))

    def run(self) -> "Sim":
        # The loop allocates millions of short-lived objects (events, actions, records) while the
        # job's state holds hundreds of thousands of live ones: at the collector's default pace (a
        # collection every 700 allocations, whole-heap ones as the live set grows) a third of the
        # CPU went to collections that found no cycles. Rarer collections, the same results.
        thresholds = gc.get_threshold()
        gc.set_threshold(GC_EVERY, *thresholds[1:])
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)

    def _run(self) -> "Sim":
        for f in self.faults:
            self.later(f.t, self.injection.inject, f)
            if f.freezes:
                self.prewindow(T0 + f.t, f.kind != "slow")
        self.later(0.0, self.submit, 0)
        if self.cfg.compute_times:   # what-if mode: every step reported for a while each hour (rank_times)
            for h in range(1, int(self.cfg.days * 24) + 1):
                self.later(h * 3600.0, self.busy, T0 + h * 3600.0 + (PRE_STEPS - 1) * self.cfg.step_s * 1.1)
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            if t > self.end:
                break
            self.now = self.cluster.now = t
            fn(*args)
            if self.dirty or self.next_tick == math.inf:
                self.dirty = False
                self.schedule_tick()
        self.now = self.cluster.now = self.end
        self.flush()
        if self.seg is not None and self.seg.end is None:
            self.seg.end = self.end
        return self

    def prewindow(self, t: float, hang_only: bool = False) -> None:
        """Report every step for PRE_STEPS steps before `t`, when a fault that only the hang watch or
        the throughput watch may see shows: their timeouts are calibrated on step times.
        `hang_only`: only the hang watch needs them (see `busy`)."""
        self.later(max(0.0, t - self.now - PRE_STEPS * self.cfg.step_s * 1.1), self.busy, t + 1.0, hang_only)

    def busy(self, until: float, hang_only: bool = False) -> None:
        tr = self.training
        warmup = self.spec.policy.hang_warmup_steps
        if hang_only and tr is not None and tr.stepping and tr.reports <= warmup:
            # a run whose ranks reported no more than their warm-up steps: the hang watch calibrates
            # on the very next intervals, so warm-up + 2 reports of single steps do
            short = (warmup + 2) * tr.pace * 1.1
            if until - 1.0 - self.now > short + 1e-6:
                self.later(until - 1.0 - short - self.now, self.busy, until, False)
                return
        self.busy_until = max(self.busy_until, until)
        self.schedule_tick()

    def submit(self, resume_step: int) -> None:
        """(Re)submit the job: a fresh job state on the machines that are free."""
        seg = Segment(index=len(self.segments) + 1, start=self.now, resume_step=resume_step)
        seg.log.append({"t": self.now, "kind": "job_submitted", "data": {"segment": seg.index}})
        self.segments.append(seg)
        self.seg = seg
        st = S.JobState(job_id=seg.index, created_at=self.now,
                        avail=Availability(memory={"own": max(2, self.spec.policy.mem_slots - 1), "backup": 2}))
        if self.platform.hot_update:
            version = self.injection.version
            st.versions = [self.version_row(version, "stable", "lazy")]
            st.version_id, st.code_path = version, f"/sim/code/v{version}"
        else:
            st.versioning_off, st.code_path = "hot update is off in this policy", self.spec.code_dir
        self.st, self.core = st, JobCore(self.spec, self.cluster)
        self.training, self.last_slots = None, None
        self.last_change = self.now
        self.deliver(Tick())
        self.injection.submitted()
        self.schedule_tick()

    # -- delivering to the core ------------------------------------------------------------------
    def deliver(self, ev: JobEvent) -> None:
        if self.st is None or self.st.terminal:
            return
        self.flush()
        self._handle(ev)

    def _handle(self, ev: JobEvent) -> None:
        assert self.core is not None and self.st is not None
        if self.st.terminal:
            return
        self.stats["core_events"] += len(ev.items) if isinstance(ev, AgentEvents) else \
            len(ev.ranks) if isinstance(ev, StepReport) else len(ev.machines) if isinstance(ev, StopReport) else 1
        acts = self.core.handle(self.st, ev, self.now)
        if acts:
            if not all(isinstance(x, a.Record) and x.kind in ("step", "rank_times") for x in acts):
                self.last_change = self.now
                self.dirty = True
            self.perform(acts)

    def agent_event(self, machine: str, ev: p.Event, seg: int) -> None:
        if machine in self.cluster.dead_at or self.seg is None or self.seg.index != seg:
            return                  # a dead machine says nothing; a finished submission hears nothing
        self.deliver(AgentEvent(machine=machine, event=ev))

    def agent_events(self, items: list[tuple[str, p.Event]], seg: int) -> None:
        """Every machine's answer to one command: one event of the core (`AgentEvents`)."""
        if self.seg is None or self.seg.index != seg:
            return
        dead = self.cluster.dead_at
        live = tuple((m, ev) for m, ev in items if m not in dead)
        if live:
            self.deliver(AgentEvents(items=live))

    def stop_report(self, rep: StopReport, seg: int) -> None:
        """Every machine's answer to a stop (`StopReport`), less the machines dead meanwhile."""
        if self.seg is None or self.seg.index != seg:
            return
        dead = self.cluster.dead_at
        if any(m in dead for m in rep.machines):
            rep = rep.only(m for m in rep.machines if m not in dead)
        if rep.machines:
            self.deliver(rep)

    def machine_lost(self, machine: str, seg: int) -> None:
        if self.seg is not None and self.seg.index == seg:
            self.deliver(MachineLost(machine=machine))

    def machine_dies(self, machine: str) -> None:
        self.cluster.kill(machine)
        pol = self.spec.policy
        self.later(pol.heartbeat_s * pol.missed_beats, self.machine_lost, machine, self.seg.index if self.seg else 0)

    # -- ticks ------------------------------------------------------------------------------------
    def quiet(self) -> bool:
        st, tr = self.st, self.training
        return (st is not None and st.phase == S.JobPhase.RUNNING and st.incident is None and tr is not None
                and tr.stepping and not self.watching_slow() and st.signals.failslow is None
                and self.now >= self.busy_until
                and (tr.begins > self.now or self.now - self.last_change >= self.cfg.settle_s))

    def slowed(self, machine: str) -> None:
        """`machine` computes slowly from now on (until it is evicted or the run ends)."""
        if not self.pace.slow:
            self.slow_since = self.now
        self.pace.slow.add(machine)
        self.pace.repace(self.training, self.now)

    def watching_slow(self) -> bool:
        """A slow machine's steps are reported one by one (with per-rank compute times) for as long
        as the core's slowdown detectors could still act on them: the peer watch's window and
        continuity and the fail-slow rounds, twice over. A policy whose detectors are off (or that
        let it pass) then sees stretches again, as for any quiet training."""
        return bool(self.pace.slow) and self.now < self.slow_since + self.slow_watch_s

    def schedule_tick(self) -> None:
        if self.st is None or self.st.terminal or self.quiet():
            return
        since = self.now - self.last_change
        dt = min(self.cfg.tick_max_s, max(self.cfg.tick_min_s, self.cfg.tick_backoff * since))
        tr = self.training
        if tr is not None and tr.stepping and tr.begins <= self.now:
            dt = min(dt, max(self.cfg.tick_min_s, tr.done_at(tr.last_done(self.now) + 1) - self.now + 1e-3))
        self.wake(self.now + dt)

    def wake(self, t: float) -> None:
        if t < self.next_tick - 1e-9:
            self.next_tick = t
            self.later(t - self.now, self.tick_at, t)

    def tick_at(self, t: float) -> None:
        if t != self.next_tick:
            return
        self.next_tick = math.inf
        self.stats["ticks"] += 1
        self.deliver(Tick())
        self.schedule_tick()

    # -- progress reports -------------------------------------------------------------------------
    def flush(self) -> None:
        """Tell the core of the steps completed since its last report (see the module's notes)."""
        tr, st, seg = self.training, self.st, self.seg
        if tr is None or st is None or seg is None or st.run_seq != tr.run or st.phase != S.JobPhase.RUNNING:
            return
        k = tr.last_done(self.now)
        if k <= tr.reported:
            return
        self.pace.max_step = max(self.pace.max_step, k)
        self.pace.stretch(tr, tr.reported + 1, k - 1, seg.log)
        t_k = tr.done_at(k)
        dur = t_k - tr.done_at(k - 1)
        nan = tr.nan_from is not None and t_k >= tr.nan_from
        loss = math.nan if nan else 2.0
        comp = self.pace.compute_times(tr, dur)
        tr.reported = k
        tr.reports += 1
        self.stats["reports"] += 1
        self._handle(StepReport(run=tr.run, step=k, t=t_k, dur=dur, machines=tuple(tr.slots),
                                ranks=range(len(tr.slots)), compute_s=tuple(comp) if comp else None,
                                loss=loss, grad_norm=loss, local_grad_norm=1.0))

    def report_durable(self, tr: Training) -> None:
        """The newest durable checkpoints of a stopped run, as its agents reported them when
        written (`Pace.durable_reports`): a restore is the only decision that reads them."""
        if self.st is None or self.st.terminal or self.st.run_seq != tr.run:
            return
        for ev in self.pace.durable_reports(tr, self.now, self.platform.memory_ckpt):
            self._handle(ev)

    # -- actions ----------------------------------------------------------------------------------
    def perform(self, acts: list[a.Action]) -> None:
        seg = self.seg
        assert seg is not None
        log = seg.log
        for act in acts:
            kind = type(act)
            if kind in NOTHING_SIMULATED:    # (the most frequent, one per rank: no isinstance chain)
                continue
            if isinstance(act, a.Record):
                log.append({"t": act.t, "kind": act.kind, "data": act.data})
            elif isinstance(act, a.OpenIncident):
                inc: dict[str, Any] = {
                       "segment": seg.index, "seq": act.seq, "symptom": act.symptom, "category": act.category,
                       "detected_at": act.detected_at - T0, "mechanism": None, "evicted": 0,
                       "fault": "update" if act.symptom == "hot_update" else
                       (blame.category if (blame := self.injection.blame) is not None else "none")}
                self._inc[(seg.index, act.seq)] = inc
                self.incidents.append(inc)
                self.open_symptom = act.symptom
            elif isinstance(act, a.UpdateIncident):
                known = self._inc.get((seg.index, act.seq))
                if known is not None:
                    for k in ("mechanism", "symptom", "category"):
                        if k in act.fields:
                            known[k] = act.fields[k]
                    if "evicted" in act.fields:
                        known["evicted"] = len(act.fields["evicted"] or [])
                        known["evicted_machines"] = list(act.fields["evicted"] or [])
            elif isinstance(act, a.AssignMachine):
                self.assign(act)
            elif isinstance(act, a.StartRun):
                self.start_run(act)
            elif isinstance(act, a.StopWorkers):
                self.agents.stop(act)
            elif isinstance(act, a.Prewarm):
                self.warm_at[act.machine] = self.now + self.profile.prewarm_s
            elif isinstance(act, a.PrepareSpares):
                self.agents.spares(act)
            elif isinstance(act, a.TraceStacks):
                self.agents.trace(act)
            elif isinstance(act, a.RunChecks):
                self.agents.checks(act)
            elif isinstance(act, a.StartReplayGroup):
                self.agents.replay(act)
            elif isinstance(act, a.FinishJob):
                self.finish(act)
            elif isinstance(act, a.RequestMachines):
                self.request(act.count)
            elif isinstance(act, NOTHING_SIMULATED):
                pass            # the store's and the rendezvous' business: nothing simulated
            else:               # SendChaos (the simulator injects no chaos) or a new action kind
                raise TypeError(f"the simulator cannot perform {act!r}")

    def assign(self, act: a.AssignMachine) -> None:
        if act.state == Role.EVICTED and act.machine in self.cluster.out:
            return                      # drained already, its replacement coming
        self.cluster.assign(act.machine, act.state)
        if act.state == Role.EVICTED:
            self.injection.bad.pop(act.machine, None)
            self.pace.slow.discard(act.machine)
            self.coming += 1            # the scheduler replaces a drained machine
            self.later(self.provision_delay(), self.provision)

    def request(self, count: int) -> None:
        """The pool is short and nothing is free: the scheduler provides what is not already coming."""
        for _ in range(max(0, count - self.coming)):
            self.coming += 1
            self.later(self.provision_delay(), self.provision)

    def provision_delay(self) -> float:
        """A replacement arrives after provision_s, or for part of the fleet after hours (repairs,
        quota, a machine that fails its own node checks first)."""
        if self.model.slow_replacement_share and self.rng.random() < self.model.slow_replacement_share:
            return float(self.profile.slow_replacement_s)
        return float(self.profile.provision_s)

    def provision(self) -> None:
        self.coming = max(0, self.coming - 1)
        self.cluster.new_machine()
        self.last_change = self.now
        self.wake(self.now + 1e-3)

    def pipeline_slots(self, slot: int) -> list[int]:
        if slot not in self._pipes:
            assert self.core is not None
            self._pipes[slot] = self.core.ctx.placement_group(slot)
        return self._pipes[slot]

    def start_run(self, act: a.StartRun) -> None:
        pr, plat, inj = self.profile, self.platform, self.injection
        first = self.last_slots is None
        planned, self.open_symptom = self.open_symptom == "hot_update", None
        if plat.restart == "requeue" and not first:
            fo = pr.requeue_s
            for m in act.slots:                  # the scheduler gives the job healthy machines again
                if m in inj.bad and inj.bad[m].hard:
                    del inj.bad[m]
        else:
            fo = pr.hot_update_s if planned else pr.restart_s if plat.restart == "warm" else pr.peer_restart_s
            durable = "durable" in act.restore.best_tiers() or \
                (act.restore_step < 0 and self.seg is not None and self.seg.resume_step > 0
                 and not self.resume_from_memory)
            if durable:
                fo += pr.durable_load_s
            self.resume_from_memory = False
        new = 0
        for i, m in enumerate(act.slots):
            if first or self.last_slots[i] != m:        # type: ignore[index]
                self.pace.seat(i, m)
                if not first:
                    new += 1
                    fo = max(fo, self.warm_at.get(m, self.now) - self.now + pr.restart_s)
        if new > self.warm_standbys:     # the shortfall beyond the warm pool is rescheduled: pods built
            fo = max(fo, pr.provision_s + pr.restart_s)
        fo += pr.warmup_s                    # to the first full-speed step (communicators, data, compilation)
        if inj.storage_until > self.now:    # workers cannot load their data until storage is back
            fo = max(fo, inj.storage_until - self.now + pr.restart_s)
        self.last_slots = list(act.slots)
        start = act.restore_step + 1 if act.restore_step >= 0 else (self.seg.resume_step if self.seg else 0)
        version = act.version if act.version is not None else inj.version
        self.pace.slow = set()
        self.stuck = False
        tr = Training(run=act.run, slots=list(act.slots), start_step=start, begins=self.now + fo,
                      pace=self.pace.of(act.slots), version=version, seg=self.seg.index if self.seg else 0)
        self.training = tr
        inj.run_started(tr, fo, first)

    def freeze(self, t: float) -> None:
        self.pace.freeze(self.training, t)

    def changed(self) -> None:
        """Something happened that the core will act on: ticks come close together again."""
        self.last_change = self.now
        self.schedule_tick()

    # -- the end of a submission --------------------------------------------------------------------
    def finish(self, act: a.FinishJob) -> None:
        seg = self.seg
        assert seg is not None
        running = self.training.version if self.training is not None else None
        self.freeze(self.now)
        for m in act.machines:
            self.cluster.assign(m, "idle")
        # a machine that died under the job and was not evicted (the job ended first: a planned
        # maintenance, a failure handed to a person) is drained and replaced by the scheduler like
        # an evicted one; left idle, it would never come back and a job of the whole pool would
        # wait for it forever
        for m in act.machines:
            if m in self.cluster.dead_at and m not in self.cluster.out:
                self.stats["dead_drained"] += 1
                self.assign(a.AssignMachine(machine=m, state=Role.EVICTED))
        seg.end, seg.state, seg.reason = self.now, act.state, act.reason
        self.training = None
        pr, inj = self.profile, self.injection
        last = self.pace.max_step
        durable = last - (last + 1) % self.ckpt_every
        self.resume_from_memory = False
        if act.state == "cancelled":          # a planned requeue: a checkpoint is written at the stop
            resume, delay, why = last + 1, pr.requeue_s, "requeue"
            if act.reason == "planned maintenance":
                delay += pr.planned_s
        else:
            reason = act.reason or ""
            human = "standby machine(s) ready" not in reason
            if human:         # someone finds the bad machines and the bad code, then resubmits
                sdc = any(f.kind == "nan" for f in inj.bad.values())
                user = bool(inj.bugs.get(inj.version) or (running is not None and inj.bugs.get(running)))
                delay = (pr.manual_sdc_s if sdc else pr.user_fix_s if user else pr.manual_s) + pr.requeue_s
                drain = [m for m in act.machines if m in inj.bad]
                for v in (inj.version, running):      # the person fixes the code that failed
                    if v is not None:
                        inj.bugs[v] = None
            else:             # the scheduler drains what the job wanted evicted and requeues it
                delay = pr.requeue_s
                inc = self.incidents[-1] if self.incidents else {}
                drain = list(inc.get("evicted_machines") or [])
            for m in drain:
                self.assign(a.AssignMachine(machine=m, state=Role.EVICTED))
            resume, why = durable + 1, "manual" if human else "requeue"
            if not human and self.platform.reschedule:
                # only the shortfall is rescheduled: the other machines keep their memory copies
                # (backups live outside every parallel group), the job goes on when the pods are up
                delay = pr.provision_s
                if self.platform.memory_ckpt:
                    resume, self.resume_from_memory = last + 1, True
        seg.lost_after = resume - 1
        self.gaps.append((self.now, self.now + delay, why))
        self.later(delay, self.submit, resume)
