"""The job core: routes each event to the flow that owns it and runs the flows' timers.

    handle(state, event, now) -> [Action]        tick(state, now) -> [Action]

Pure: it reads the state, the spec and the cluster view, mutates the state and returns actions;
the controller's runner (`runner.py`) executes them, a unit test asserts them, and the cluster
simulator drives the same core on a simulated clock.
"""
from __future__ import annotations

import logging

from stalwart import protocol as p
from stalwart.controller.job.events import (AgentBack, AgentEvent, AgentEvents, Cancel, ClusterView, Inject, JobEvent,
                                            MachineLost, Resumed, StepReport, StopReport, Tick, VersionRegistered)
from stalwart.controller.job.flows.base import Actions, Ctx
from stalwart.controller.job.flows.diagnosis import DiagnosisFlow
from stalwart.controller.job.flows.failure import FailureFlow
from stalwart.controller.job.flows.hotupdate import HotUpdateFlow
from stalwart.controller.job.flows.implicit import ImplicitFlow
from stalwart.controller.job.flows.pool import PoolFlow
from stalwart.controller.job.flows.reconcile import ReconcileFlow
from stalwart.controller.job.flows.replay import ReplayFlow
from stalwart.controller.job.flows.run import RunFlow
from stalwart.controller.job.state import ChaosPlan, JobPhase, JobState
from stalwart.spec import JobSpec

log = logging.getLogger("stalwart.controller")
REPLAY_EVENTS = (p.Step, p.Done, p.WorkerExit)


class JobCore:
    def __init__(self, spec: JobSpec, cluster: ClusterView):
        ctx = self.ctx = Ctx.of(spec, cluster)
        # Each flow is given the flows it calls (typed by the protocols of `flows/base.py`), at
        # construction where they are built already; the failure flow, which calls the flows that
        # call it, and the hot update (it restarts the run, whose steps promote it) get the rest
        # once those are built.
        self.pool = PoolFlow(ctx)
        self.failure = FailureFlow(ctx)
        self.implicit = ImplicitFlow(ctx, incidents=self.failure)
        self.replay = ReplayFlow(ctx, failure=self.failure)
        self.diagnosis = DiagnosisFlow(ctx, failure=self.failure, replay=self.replay)
        self.hotupdate = HotUpdateFlow(ctx, pool=self.pool, failure=self.failure)
        self.run = RunFlow(ctx, failure=self.failure, implicit=self.implicit, pool=self.pool,
                           hotupdate=self.hotupdate)
        self.reconcile = ReconcileFlow(ctx, pool=self.pool, failure=self.failure, diagnosis=self.diagnosis,
                                       replay=self.replay)
        self.hotupdate.connect(run=self.run)
        self.failure.connect(run=self.run, implicit=self.implicit, diagnosis=self.diagnosis, replay=self.replay,
                             hotupdate=self.hotupdate)

    # -- events ---------------------------------------------------------------------------------
    def handle(self, st: JobState, ev: JobEvent, now: float) -> Actions:
        if st.terminal:
            return []
        if isinstance(ev, Tick):
            return self.tick(st, now)
        if isinstance(ev, AgentEvent):
            return self.on_agent(st, ev.machine, ev.event, now)
        if isinstance(ev, AgentEvents):
            return self.on_agents(st, ev.items, now)
        if isinstance(ev, StepReport):
            if st.phase == JobPhase.REPLAYING:      # a replay group's steps: each rank in turn
                return self.on_agents(st, ev.as_agent_events().items, now)
            return self.run.on_steps(st, ev, now)
        if isinstance(ev, StopReport):
            return self.failure.on_stops(st, ev, now)
        if isinstance(ev, MachineLost):
            return self.failure.on_machine_lost(st, ev.machine, now)
        if isinstance(ev, Inject):
            return self.run.inject(st, ChaosPlan(kind=ev.kind, machine=ev.machine, rank=ev.rank, step=None,
                                                 params=dict(ev.params or {})), now)
        if isinstance(ev, Cancel):
            return self.failure.finish(st, "cancelled", ev.reason, now)
        if isinstance(ev, VersionRegistered):
            return self.hotupdate.on_registered(st, ev.row, now)
        if isinstance(ev, AgentBack):
            return self.reconcile.on_agent_back(st, ev.machine, ev.reg, now)
        if isinstance(ev, Resumed):
            return self.reconcile.on_resumed(st, ev.down_at, ev.up_at, now)
        raise TypeError(f"unknown job event {ev!r}")

    def on_agents(self, st: JobState, items: tuple[tuple[str, p.Event], ...], now: float) -> Actions:
        """Events of several agents at one instant, in order (`AgentEvents`)."""
        acts: Actions = []
        i, n = 0, len(items)
        while i < n and not st.terminal:
            machine, ev = items[i]
            kind = type(ev)
            if kind is p.DiagResult or kind is p.Ckpt:     # a run of them is taken at once
                j = i + 1
                while j < n and type(items[j][1]) is kind:
                    j += 1
                if kind is p.DiagResult:
                    acts += self.diagnosis.on_results(st, items[i:j], now)    # type: ignore[arg-type]
                else:
                    acts += self.run.on_ckpts(st, [x[1] for x in items[i:j]])  # type: ignore[misc]
                i = j
                continue
            acts += self.on_agent(st, machine, ev, now)
            i += 1
        return acts

    def on_agent(self, st: JobState, machine: str, ev: p.Event, now: float) -> Actions:
        if isinstance(ev, p.Steps):         # several ranks' reports of one step: each in turn
            acts: Actions = []
            for one in ev.expand():
                acts += self.on_agent(st, machine, one, now)
            return acts
        if st.phase == JobPhase.REPLAYING and isinstance(ev, REPLAY_EVENTS):
            return self.replay.on_event(st, machine, ev, now)
        if isinstance(ev, p.Step):
            return self.run.on_step(st, ev, now)
        if isinstance(ev, p.Ckpt):
            return self.run.on_ckpt(st, ev)
        if isinstance(ev, p.Metrics):
            return self.implicit.observe(st, machine, ev, now)
        if isinstance(ev, p.Activity):
            return self.run.on_activity(st, ev, now) + self.implicit.observe(st, machine, ev, now)
        if isinstance(ev, p.Script):
            return self.run.on_script(st, ev, now)
        if isinstance(ev, p.WorkerExit):
            return self.failure.on_worker_exit(st, machine, ev, now)
        if isinstance(ev, p.Health):
            return self.failure.on_health(st, machine, ev, now)
        if isinstance(ev, p.Stopped):
            return self.failure.on_stopped(st, machine, ev, now)
        if isinstance(ev, p.Stacks):
            return self.implicit.observe(st, machine, ev, now)
        if isinstance(ev, p.DiagResult):
            return self.diagnosis.on_result(st, machine, ev, now)
        if isinstance(ev, p.Done):
            return self.run.on_done(st, ev, now)
        if isinstance(ev, p.Started):
            return self.run.on_started(st, machine, ev, now)
        if isinstance(ev, p.Hello):
            return self.run.on_hello(st, ev)
        if isinstance(ev, p.RestoreSourceUsed):
            return self.run.on_restore_source(st, ev, now)
        if isinstance(ev, p.RestoreFailed):
            return self.run.on_restore_failed(st, ev, now)
        if isinstance(ev, p.ChaosApplied):
            return self.run.on_chaos_applied(st, machine, ev, now)
        if isinstance(ev, p.StandbyReady):
            return self.pool.on_standby_ready(st, machine, ev.pid)
        if isinstance(ev, p.SparesReady):
            return self.hotupdate.on_spares_ready(st, machine, ev.key, now)
        if isinstance(ev, p.CommandFailed):
            return self.failure.on_command_failed(st, machine, ev, now)
        return []          # restored, prewarmed: the agent's own business

    # -- timers ---------------------------------------------------------------------------------
    def tick(self, st: JobState, now: float) -> Actions:
        if st.terminal:
            return []
        if st.reconciling:
            return self.reconcile.tick(st, now)
        phase = st.phase
        acts: Actions = []
        if phase == JobPhase.WAITING:
            acts += self.run.try_start(st, now)
        elif phase == JobPhase.RECOVERING:
            acts += self.failure.check_stopped(st, now)
        elif phase == JobPhase.DIAGNOSING:
            acts += self.diagnosis.tick(st, now)
        elif phase == JobPhase.REPLAYING:
            acts += self.replay.check(st, now)
        elif phase == JobPhase.TRACING:
            acts += self.implicit.trace_tick(st, now)
        elif phase == JobPhase.RUNNING:
            acts += self.hotupdate.tick(st, now)
        if st.phase == JobPhase.RUNNING:
            acts += self.pool.refill(st, now)
            acts += self.failure.network_stall(st, now)
            acts += self.implicit.tick(st, now)       # the detectors, each while the run trains
        return acts

    # -- what the status API shows --------------------------------------------------------------
    def live(self, st: JobState) -> dict:
        return {"state": st.phase.value, "run": st.run_seq, "step": st.steps_done,
                "steps_target": self.ctx.spec.steps, "loss": st.last_loss, "script": st.script,
                "steps_per_s": RunFlow.steps_per_s(st), "slots": list(st.slots),
                "standby": list(st.pool.standby), "standby_target": self.ctx.standbys,
                "standby_warm": self.pool.warm_ready(st),
                "spares_warm": self.pool.spares_ready(st),
                "reason": st.reason}
