"""Dual-phase replay (papers.md §1.5.3): when checks found nothing and the failure came back after a
reattempt, replay the job on groups of machines, twice over two partitions, and evict the one
machine that a failing group of each phase shares.

The planner is `analyzer.replay` (pure). Each group runs the job's own command from a fresh start
with the job's TP and PP, DP = k, for `policy.replay_steps` steps, as a throw-away run (no
checkpoint is written or read). The job may shrink its model for the replay: the workers get
STALWART_REPLAY_LAYERS (= PP, one layer per stage), the SDK's `ctx.replay_layers`. A group fails
when a worker exits non-zero, reports a non-finite loss or gradient norm, or does not finish in time.
"""
from __future__ import annotations

import dataclasses
import math

from stalwart import protocol
from stalwart.analyzer import replay
from stalwart.controller.rules import policy
from stalwart.controller.rules.policy import Mechanism
from stalwart.controller.job.actions import CloseScratch, StartReplayGroup, StopWorkers
from stalwart.controller.job.flows.base import Actions, Ctx, Failures, record, save_data
from stalwart.controller.job.state import Incident, IncidentPhase, JobPhase, JobState, Replay, ReplayGroup


class ReplayFlow:
    def __init__(self, ctx: Ctx, *, failure: Failures):
        self.ctx = ctx
        self.failure = failure

    def possible(self, st: JobState) -> tuple[bool, str]:
        """Whether this job's layout admits a dual-phase replay, and why not."""
        t, p = self.ctx.topo, self.ctx.policy
        if not p.replay:
            return False, "disabled by policy.replay"
        if t.tp * t.cp * t.ep != self.ctx.G:
            return False, (f"one machine must hold exactly one tensor-parallel group "
                           f"(tp*cp*ep={t.tp * t.cp * t.ep}, {self.ctx.G} GPUs per machine)")
        try:
            self._plan(st)
        except ValueError as e:
            return False, str(e)
        return True, ""

    def _plan(self, st: JobState) -> replay.ReplayPlan:
        t, p = self.ctx.topo, self.ctx.policy
        k = p.replay_k or replay.choose_k(t.pp, t.dp, len(st.slots))
        return replay.plan(list(st.slots), t.pp, t.dp, k)

    def start(self, st: JobState, inc: Incident, res: policy.Resolution, now: float) -> Actions:
        plan = self._plan(st)
        inc.resolution = res
        st.replay = Replay(name=f"job{st.job_id}-replay{inc.seq}", plan=plan, started=now,
                           deadline=now + self.ctx.policy.replay_timeout_s)
        st.move(JobPhase.REPLAYING)
        inc.move(IncidentPhase.LOCALIZING)
        acts: Actions = [record("replay_started", now, incident=inc.seq, k=plan.k, m=plan.m, n=plan.n,
                                horizontal=[list(g) for g in plan.horizontal],
                                vertical=[list(g) for g in plan.vertical])]
        return acts + self._phase(st, now)

    def _phase(self, st: JobState, now: float) -> Actions:
        rp, p = st.replay, self.ctx.policy
        assert rp is not None
        rp.groups, rp.deadline, rp.running = {}, now + p.replay_timeout_s, -1
        acts: Actions = []
        for g, machines in enumerate(rp.plan.phases[rp.phase]):
            st.run_seq += 1
            rp.groups[st.run_seq] = ReplayGroup(group=g, machines=list(machines),
                                                world=len(machines) * self.ctx.G)
            acts.append(StartReplayGroup(name=rp.name, run=st.run_seq, machines=list(machines), dp=rp.plan.k,
                                         steps=p.replay_steps, code_path=st.code_path, version=st.version_id))
        return acts

    def restart_phase(self, st: JobState, now: float) -> Actions:
        """Run the current phase again (after a controller restart: its store died with it)."""
        rp = st.replay
        assert rp is not None
        acts: Actions = [StopWorkers(machines=list(g.machines), run=run) for run, g in rp.groups.items()]
        acts.append(CloseScratch(name=rp.name))
        rp.name = f"{rp.name}+"
        return acts + self._phase(st, now)

    def on_event(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        """Step, done and exit events of the replay groups' workers."""
        rp = st.replay
        assert rp is not None
        grp = rp.groups.get(getattr(ev, "run", None))  # type: ignore[arg-type]
        if grp is None or grp.failed is not None or len(grp.done) == grp.world:
            return []
        if isinstance(ev, protocol.Step):
            bad = [k for k in ("loss", "grad_norm")
                   if getattr(ev, k) is not None and not math.isfinite(getattr(ev, k))]
            if bad:
                grp.failed = f"rank {ev.rank} step {ev.step}: non-finite {' and '.join(bad)}"
        elif isinstance(ev, protocol.Done) or (isinstance(ev, protocol.WorkerExit) and ev.code == 0):
            grp.done.add(ev.rank)  # type: ignore[arg-type]
        elif isinstance(ev, protocol.WorkerExit) and not ev.expected:
            grp.failed = policy.describe_exit(ev.rank, machine, ev.code, ev.signal) + " (replay)"
        if grp.failed is None and len(grp.done) < grp.world:
            if now <= rp.deadline:
                return []   # this group still runs: `check` would wait too (without looking at every group)
        else:
            rp.group_ended()
        return self.check(st, now)

    def on_lost(self, st: JobState, machine: str, now: float) -> Actions:
        """A machine fell silent during the replay: that is certain evidence, no need to finish the
        replay. Its groups are stopped and the lost machines are evicted."""
        rp, inc = st.replay, st.incident
        if rp is None or inc is None or inc.resolution is None or st.reconciling:
            return []
        st.replay = None
        lost = sorted(m for m in inc.lost if m in st.slots)
        acts: Actions = [StopWorkers(machines=list(g.machines), run=run) for run, g in rp.groups.items()]
        acts += [CloseScratch(name=rp.name),
                 record("replay_done", now, incident=inc.seq, machines=lost, seconds=round(now - rp.started, 3))]
        res = dataclasses.replace(inc.resolution, mechanism=Mechanism.EVICT_RESTART, evict=lost, suspects=lost,
                                  cause=f"{inc.resolution.cause}; {', '.join(lost)} lost during the dual-phase replay")
        short = policy.standby_shortfall(lost, len(self.ctx.ready_standbys(st)))
        if short is not None:
            res = dataclasses.replace(res, mechanism=Mechanism.FAIL, fail_reason=short)
        return acts + self.failure.recover(st, inc, res, now)

    def check(self, st: JobState, now: float) -> Actions:
        rp = st.replay
        assert rp is not None
        groups = list(rp.groups.values())
        if now > rp.deadline and rp.still_running():
            for grp in groups:
                if grp.failed is None and len(grp.done) < grp.world:
                    grp.failed = f"did not finish {self.ctx.policy.replay_steps} steps in time"
            rp.running = 0
        if rp.still_running():
            return []
        acts: Actions = []
        for run, grp in rp.groups.items():
            acts.append(StopWorkers(machines=list(grp.machines), run=run))
            if grp.failed is not None:
                rp.failed[rp.phase].append(grp.group)
        inc = st.incident
        assert inc is not None
        acts.append(record("replay_phase_done", now, incident=inc.seq, phase=("horizontal", "vertical")[rp.phase],
                           failed={str(g.group): g.failed for g in groups if g.failed}))
        rp.phase += 1
        if rp.phase == 1 and rp.plan.m == 1:
            # one machine per horizontal group: the vertical groups are the same single machines
            rp.failed[1] = list(rp.failed[0])
            rp.phase = 2
        if rp.phase < 2:
            return acts + self._phase(st, now)
        return acts + self._replayed(st, now)

    def _replayed(self, st: JobState, now: float) -> Actions:
        rp, inc = st.replay, st.incident
        assert rp is not None and inc is not None and inc.resolution is not None
        st.replay = None
        plan, res = rp.plan, inc.resolution
        h, v = set(rp.failed[0]), set(rp.failed[1])
        everywhere = len(h) == len(plan.horizontal) and len(v) == len(plan.vertical)
        # every group failing points at no machine (the code, the data, the whole cluster): evicting
        # the intersection would evict every machine
        found = replay.locate(plan, h, v) if h and v and not everywhere else []
        took = round(now - rp.started, 3)
        inc.data["replay"] = {"k": plan.k, "failed_horizontal": sorted(h), "failed_vertical": sorted(v),
                              "machines": found, "seconds": took}
        acts: Actions = [CloseScratch(name=rp.name), save_data(inc),
                         record("replay_done", now, incident=inc.seq, machines=found, seconds=took)]
        if found:
            res = dataclasses.replace(res, mechanism=Mechanism.REPLAY, evict=list(found), suspects=list(found),
                                      cause=f"{res.cause}; dual-phase replay isolated {', '.join(found)} "
                                            f"in {took:.1f}s")
            short = policy.standby_shortfall(list(found), len(self.ctx.ready_standbys(st)))
            if short is not None:
                res = dataclasses.replace(res, mechanism=Mechanism.FAIL,
                                          fail_reason=f"dual-phase replay isolated {', '.join(found)} "
                                                      f"but {short}")
        else:
            what = "failed in every group: no machine to blame" if everywhere else "reproduced nothing"
            res = dataclasses.replace(res, mechanism=Mechanism.REPLAY,
                                      cause=f"{res.cause}; dual-phase replay {what} in {took:.1f}s")
        return acts + self.failure.recover(st, inc, res, now)
