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
from stalwart.controller.cluster import placement
from stalwart.controller.job import actions as a
from stalwart.controller.job import state as S
from stalwart.controller.job.core import JobCore
from stalwart.controller.job.events import (AgentEvent, AgentEvents, Cancel, JobEvent, MachineLost, StepReport, Tick,
                                            VersionRegistered)
from stalwart.controller.cluster.standby import p99_standbys
from stalwart.controller.cluster.roles import Role
from stalwart.controller.rules.restore import Availability
from stalwart.sim.agents import Agents
from stalwart.sim.cluster import PENALTY, SimCluster, job_labels
from stalwart.sim.config import Config, Segment
from stalwart.sim.durations import Durations
from stalwart.sim.failures import Fault, Model
from stalwart.sim.peers import Platform
from stalwart.sim.profile import Profile
from stalwart.sim.training import Training
from stalwart.spec import JobSpec

T0 = 1_000_000.0          # the core's clock at the simulation's start
DAY = 86400.0
PRE_STEPS = 22            # steps reported one by one before a hang or a slowdown (the hang watch keeps 20)
MEM_KEEP = 3              # steps kept one by one at the end of a stretch (restores from memory land there)
HANG_FLOOR_S = 30.0       # the uncalibrated hang timeout (10x this) outlasts a restart at this scale
SLOW_WATCH_EXTRA_S = 600.0  # beyond the slowdown detectors' own windows (see `watching_slow`)
GC_EVERY = 200_000          # allocations between the cyclic collector's young collections (see `run`)
IMMEDIATE = ("slow", "network")     # faults (besides dead hardware) that show again as soon as a run starts


class Sim:
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
        self.core: JobCore | None = None
        self.st: S.JobState | None = None
        self.seg: Segment | None = None
        self.segments: list[Segment] = []
        self.gaps: list[tuple[float, float, str]] = []
        self.training: Training | None = None
        self.last_slots: list[str] | None = None
        self.penalty: dict[int, float] = {}
        self.bad: dict[str, Fault] = {}
        self.shown: dict[int, list[str]] = {}       # id(fault) -> machines it shows on in this run
        self.slow_machines: set[str] = set()
        self.slow_since = 0.0         # when the current run's first machine turned slow
        pol = self.spec.policy        # how long the slowdown detectors may take (see `watching_slow`)
        self.slow_watch_s = 2 * (pol.similarity_window_s + pol.similarity_continuity_s
                                 + pol.failslow_rounds * pol.failslow_period_s) + SLOW_WATCH_EXTRA_S
        self.stuck = False
        self.warm_at: dict[str, float] = {}
        self.version = 1
        self.bugs: dict[int, str | None] = {}
        self.pending_updates: list[Fault] = []
        self.last_change = T0
        self.busy_until = T0
        self.next_tick = math.inf
        self.dirty = False           # the core acted: its timers may want a tick sooner
        self.blame: Fault | None = None
        self.open_symptom: str | None = None
        self.incidents: list[dict] = []
        self._inc: dict[tuple[int, int], dict] = {}
        self.injected: dict[str, int] = {}
        self.max_step = -1
        self.rngs: dict[int, random.Random] = {}
        self._pipes: dict[int, list[int]] = {}
        self._penalties: dict[tuple[int, str], float] = {}
        self.coming = 0               # machines the scheduler is providing
        self.storage_until = T0       # the storage service is out until then
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
                                  "diag_timeout_s": max(10.0, pr.bound("checks_s"))}
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
            self.later(f.t, self.inject, f)
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
            st.versions = [self.version_row(self.version, "stable", "lazy")]
            st.version_id, st.code_path = self.version, f"/sim/code/v{self.version}"
        else:
            st.versioning_off, st.code_path = "hot update is off in this policy", self.spec.code_dir
        self.st, self.core = st, JobCore(self.spec, self.cluster)
        self.training, self.last_slots = None, None
        self.last_change = self.now
        self.deliver(Tick())
        for f in self.pending_updates:
            self.register(f)
        self.pending_updates = []
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
            len(ev.ranks) if isinstance(ev, StepReport) else 1
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
        if not self.slow_machines:
            self.slow_since = self.now
        self.slow_machines.add(machine)
        self.repace()

    def watching_slow(self) -> bool:
        """A slow machine's steps are reported one by one (with per-rank compute times) for as long
        as the core's slowdown detectors could still act on them: the peer watch's window and
        continuity and the fail-slow rounds, twice over. A policy whose detectors are off (or that
        let it pass) then sees stretches again, as for any quiet training."""
        return bool(self.slow_machines) and self.now < self.slow_since + self.slow_watch_s

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
        self.max_step = max(self.max_step, k)
        self._stretch(tr, tr.reported + 1, k - 1)
        t_k = tr.done_at(k)
        dur = t_k - tr.done_at(k - 1)
        nan = tr.nan_from is not None and t_k >= tr.nan_from
        loss = math.nan if nan else 2.0
        comp = self.compute_times(tr, dur)
        tr.reported = k
        tr.reports += 1
        self.stats["reports"] += 1
        self._handle(StepReport(run=tr.run, step=k, t=t_k, dur=dur, machines=tuple(tr.slots),
                                ranks=tuple(range(len(tr.slots))), compute_s=tuple(comp) if comp else None,
                                loss=loss, grad_norm=loss, local_grad_norm=1.0))

    def report_durable(self, tr: Training) -> None:
        """The newest durable checkpoints of a stopped run (one, two without memory copies), as its
        agents reported them when written: a restore is the only decision that reads them."""
        if self.st is None or self.st.terminal or self.st.run_seq != tr.run:
            return
        k = tr.last_done(self.now)
        d0 = k - (k + 1) % self.ckpt_every          # the newest durable checkpoint (after step d0)
        newest = [d for d in (d0, d0 - self.ckpt_every)[:1 if self.platform.memory_ckpt else 2]
                  if d > tr.durable_reported and d >= tr.start_step - 1]
        for d in reversed(newest):
            t_d, where = tr.done_at(d), f"durable/{d}"
            self._handle(AgentEvents(items=tuple(
                (m, p.Ckpt(run=tr.run, rank=i, step=d, tier="durable", location=where, t=t_d))
                for i, m in enumerate(tr.slots))))
        if newest:
            tr.durable_reported = newest[0]

    def _stretch(self, tr: Training, lo: int, hi: int) -> None:
        """Log records for steps lo..hi, which the core was not told of one by one."""
        if hi < lo or self.seg is None:
            return
        ends = {hi} | set(range(max(lo, hi - MEM_KEEP + 1), hi + 1))
        first = lo + (self.ckpt_every - 1 - lo % self.ckpt_every) % self.ckpt_every
        ends |= set(range(first, hi + 1, self.ckpt_every))
        prev = lo - 1
        for e in sorted(ends):
            t0, t1 = tr.done_at(prev), tr.done_at(e)
            self.seg.log.append({"t": t1, "kind": "step", "data": {
                "run": tr.run, "step": e, "dur": t1 - t0, "steps": e - prev, "sim": "stretch"}})
            prev = e

    def compute_times(self, tr: Training, dur: float) -> list[float] | None:
        """Per-rank compute seconds: reported while a machine is slow (evidence) and in what-if mode."""
        if not (self.slow_machines or self.cfg.compute_times):
            return None
        rng = random.Random(hash((self.seed, tr.run, tr.reported)))
        base = dur / (self.model.slowdown if self.slow_machines else 1.0) * 0.6
        out = []
        for i, m in enumerate(tr.slots):
            c = base * (1.15 if i // self.dp == self.cfg.pp - 1 else 1.0) * rng.lognormvariate(0.0, 0.02)
            out.append(c * (self.model.slowdown if m in self.slow_machines else 1.0))
        return out

    # -- actions ----------------------------------------------------------------------------------
    def perform(self, acts: list[a.Action]) -> None:
        seg = self.seg
        assert seg is not None
        for act in acts:
            if isinstance(act, a.Record):
                seg.log.append({"t": act.t, "kind": act.kind, "data": act.data})
            elif isinstance(act, a.OpenIncident):
                inc: dict[str, Any] = {
                       "segment": seg.index, "seq": act.seq, "symptom": act.symptom, "category": act.category,
                       "detected_at": act.detected_at - T0, "mechanism": None, "evicted": 0,
                       "fault": "update" if act.symptom == "hot_update" else
                       (self.blame.category if self.blame is not None else "none")}
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
            elif isinstance(act, (a.CreateRun, a.UpdateRun, a.SaveVersion, a.AddCheckpoint, a.CloseScratch)):
                pass            # the store's and the rendezvous' business: nothing simulated
            else:               # SendChaos (the simulator injects no chaos) or a new action kind
                raise TypeError(f"the simulator cannot perform {act!r}")

    def assign(self, act: a.AssignMachine) -> None:
        if act.state == Role.EVICTED and act.machine in self.cluster.out:
            return                      # drained already, its replacement coming
        self.cluster.assign(act.machine, act.state)
        if act.state == Role.EVICTED:
            self.bad.pop(act.machine, None)
            self.slow_machines.discard(act.machine)
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
        pr, plat = self.profile, self.platform
        first = self.last_slots is None
        planned, self.open_symptom = self.open_symptom == "hot_update", None
        if plat.restart == "requeue" and not first:
            fo = pr.requeue_s
            for m in act.slots:                  # the scheduler gives the job healthy machines again
                if m in self.bad and self.bad[m].hard:
                    del self.bad[m]
        else:
            fo = pr.hot_update_s if planned else pr.restart_s if plat.restart == "warm" else pr.peer_restart_s
            durable = any(c and c[0].tier == "durable" for c in act.restore.values()) or \
                (act.restore_step < 0 and self.seg is not None and self.seg.resume_step > 0
                 and not self.resume_from_memory)
            if durable:
                fo += pr.durable_load_s
            self.resume_from_memory = False
        new = 0
        for i, m in enumerate(act.slots):
            if first or self.last_slots[i] != m:        # type: ignore[index]
                self.penalty[i] = self.slot_penalty(i, m)
                if not first:
                    new += 1
                    fo = max(fo, self.warm_at.get(m, self.now) - self.now + pr.restart_s)
        if new > self.warm_standbys:     # the shortfall beyond the warm pool is rescheduled: pods built
            fo = max(fo, pr.provision_s + pr.restart_s)
        fo += pr.warmup_s                    # to the first full-speed step (communicators, data, compilation)
        if self.storage_until > self.now:    # workers cannot load their data until storage is back
            fo = max(fo, self.storage_until - self.now + pr.restart_s)
        self.last_slots = list(act.slots)
        start = act.restore_step + 1 if act.restore_step >= 0 else (self.seg.resume_step if self.seg else 0)
        version = act.version if act.version is not None else self.version
        self.slow_machines = set()
        self.stuck = False
        self.shown = {}
        tr = Training(run=act.run, slots=list(act.slots), start_step=start, begins=self.now + fo,
                      pace=self.pace(act.slots), version=version, seg=self.seg.index if self.seg else 0)
        self.training = tr
        for m in act.slots:
            f = self.bad.get(m)
            if f is not None:
                delay = 1.0 if f.hard or f.kind in IMMEDIATE else self.draw_exp(f, self.model.recur_mean_s)
                self.later(fo + delay, self.recur, f, m, tr)
                if f.freezes:
                    self.prewindow(self.now + fo + delay, f.kind != "slow")
        bug = self.bugs.get(version)
        if bug:                  # a faulty version fails in its first step
            self.later(fo + 0.5 * tr.pace, self._bug, bug, version, tr)
        elif not first and self.model.restart_fail_share and self.rng.random() < self.model.restart_fail_share:
            # the restart itself fails (a rendezvous or NCCL set-up error on some machine)
            slot = self.rng.randrange(len(act.slots))
            self.later(fo + 0.5 * tr.pace, self.recur, Fault(self.now - T0, "restart_failure", "crash", slot, False,
                                                            seed=self.rng.getrandbits(32)), act.slots[slot], tr)

    def slot_penalty(self, slot: int, machine: str) -> float:
        """The step-time penalty of `machine` in `slot` (its distance from the slot's pipeline);
        a machine's labels never change, so each pair is computed once."""
        key = (slot, machine)
        got = self._penalties.get(key)
        if got is None:
            home = [job_labels(j, self.cfg.pp, self.dp) for j in self.pipeline_slots(slot)]
            got = self._penalties[key] = PENALTY[placement.distance(self.cluster.true_labels(machine), home)]
        return got

    def pace(self, slots: list[str]) -> float:
        p_ = self.cfg.step_s * (1 + (self.profile.memckpt_overhead if self.platform.memory_ckpt else 0.0))
        p_ *= 1 + max((self.penalty.get(i, 0.0) for i in range(len(slots))), default=0.0)
        if any(m in self.slow_machines for m in slots):
            p_ *= self.model.slowdown
        return p_

    def repace(self) -> None:
        tr = self.training
        if tr is not None:
            tr.set_pace(self.now, self.pace(tr.slots))

    def freeze(self, t: float) -> None:
        tr = self.training
        if tr is not None:
            self.max_step = max(self.max_step, tr.last_done(t))
            tr.freeze(t)

    # -- faults -----------------------------------------------------------------------------------
    def draw(self, f: Fault) -> float:
        return self.rngs.setdefault(f.seed, random.Random(f.seed)).random()

    def draw_exp(self, f: Fault, mean: float) -> float:
        return -mean * math.log(1.0 - self.draw(f))

    def active_faults(self) -> list[tuple[Fault, list[str]]]:
        by_id = {id(f): f for f in self.bad.values()}
        return [(by_id[k], ms) for k, ms in self.shown.items() if k in by_id]

    def inject(self, f: Fault) -> None:
        self.injected[f.category] = self.injected.get(f.category, 0) + 1
        if f.kind == "update":
            self.update(f)
            return
        if f.kind == "planned":
            if self.st is not None and not self.st.terminal:
                self.deliver(Cancel(reason="planned maintenance"))
            return
        if f.kind == "storage":
            self.storage_until = max(self.storage_until, self.now + float(self.profile.storage_outage_s))
        tr = self.training
        if f.kind == "user":          # the running code version fails (a data-dependent bug)
            self.bugs[self.version] = "exception"
            if tr is not None:
                self._bug("exception", self.version, tr, "user_code")
            return
        slots = tr.slots if tr is not None else self.last_slots
        if not slots:
            return
        if f.switch is not None:
            under = set(f.switch)
            machines = [m for m in slots if self.cluster.true_labels(m).get("switch") in under]
            if not machines:
                return
        else:
            machines = [slots[f.slot]]
        if f.persistent:
            for m in machines:
                self.bad[m] = f
        if tr is None or not tr.stepping or tr.begins > self.now or self.st is None \
                or self.st.phase != S.JobPhase.RUNNING:
            return                                  # shows when its machine next runs (if persistent)
        self.show(f, machines)

    def show(self, f: Fault, machines: list[str]) -> None:
        self.flush()
        self.blame = f
        self.shown[id(f)] = machines
        self.agents.manifest(f, machines)
        self.last_change = self.now
        self.schedule_tick()

    def recur(self, f: Fault, machine: str, run: Training) -> None:
        tr = self.training
        if (f.persistent and self.bad.get(machine) is not f) or tr is not run or not tr.stepping \
                or machine not in tr.slots or self.st is None or self.st.phase != S.JobPhase.RUNNING:
            return
        self.show(f, [machine])

    def _bug(self, kind: str, version: int, run: Training, category: str = "update") -> None:
        tr = self.training
        if tr is None or tr is not run or not tr.stepping or self.bugs.get(version) != kind or self.st is None \
                or self.st.phase != S.JobPhase.RUNNING:
            return
        self.flush()
        self.blame = Fault(self.now - T0, category, "update", 0, False, bug=kind)
        self.agents.bug(kind, version)
        self.last_change = self.now
        self.schedule_tick()

    def update(self, f: Fault) -> None:
        """A code/data adjustment: a new version for a hot update, or a requeue without it."""
        if self.seg is None or self.st is None or self.st.terminal:
            self.pending_updates.append(f)
            return
        self.register(f)

    def register(self, f: Fault) -> None:
        self.version += 1
        self.bugs[self.version] = f.bug
        if self.platform.hot_update:
            mode = "urgent" if f.urgent else "lazy"
            self.deliver(VersionRegistered(row=self.version_row(self.version, "urgent" if f.urgent else "pending",
                                                                mode)))
        else:
            self.deliver(Cancel(reason=f"requeue for code version {self.version}"))

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
        pr = self.profile
        last = self.max_step
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
                sdc = any(f.kind == "nan" for f in self.bad.values())
                user = bool(self.bugs.get(self.version) or (running is not None and self.bugs.get(running)))
                delay = (pr.manual_sdc_s if sdc else pr.user_fix_s if user else pr.manual_s) + pr.requeue_s
                drain = [m for m in act.machines if m in self.bad]
                for v in (self.version, running):      # the person fixes the code that failed
                    if v is not None:
                        self.bugs[v] = None
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
