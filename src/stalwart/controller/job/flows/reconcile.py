"""Taking a job over after a controller restart.

The new controller loads the saved `JobState`, hears the agents re-register with what they run
(run, live ranks, steps, checkpoint slots), and reconciles once every machine of the job is back
or a bound passed:

- a run that kept training (every machine reports the run with all its ranks alive or finished
  cleanly, and the run had completed a step, so its rendezvous is done) is adopted as it is: the
  steps and `done` its workers sent meanwhile arrive from the agents' outboxes;
- a run whose start was cut short (no step completed: its workers may wait on the rendezvous
  store, which died with the old controller), or whose ranks are gone, is restarted through an
  incident (`control_plane`);
- a recovery that was half done is finished from its recorded phase: stops, stack captures,
  stop-time checks and replay groups are sent again (their scratch stores died too);
- machines that do not come back are lost, as they would be without a restart.

The controller's absence is booked by the ledger as `control_plane` time (events
`control_plane_down` and `control_plane_reconciled`).
"""
from __future__ import annotations

import logging

from stalwart import protocol
from stalwart.controller.job.actions import StopWorkers, TraceStacks
from stalwart.controller.job.flows.base import Actions, Ctx, Diagnoses, Failures, Replays, Standbys, record
from stalwart.controller.job.state import ControlPlaneGap, JobPhase, JobState

log = logging.getLogger("stalwart.controller")


class ReconcileFlow:
    def __init__(self, ctx: Ctx, *, pool: Standbys, failure: Failures, diagnosis: Diagnoses, replay: Replays):
        self.ctx = ctx
        self.pool = pool
        self.failure = failure
        self.diagnosis = diagnosis
        self.replay = replay

    def grace_s(self) -> float:
        """How long a machine may take to come back: its agent knocks again within one capped
        backoff delay of the controller listening; two of them and the missed beats leave room
        for a slow registration on a loaded host."""
        p = self.ctx.policy
        return p.heartbeat_s * p.missed_beats + 2 * protocol.AGENT_RETRY_CAP_S + 1.0

    def on_resumed(self, st: JobState, down_at: float, up_at: float, now: float) -> Actions:
        st.gaps.append(ControlPlaneGap(down_at=down_at, up_at=up_at))
        log.info("job %s: taken over after a controller restart (down %.1fs); reconciling",
                 st.job_id, up_at - down_at)
        return [record("control_plane_down", up_at, down_at=down_at, up_at=up_at)]

    def on_agent_back(self, st: JobState, machine: str, reg: protocol.Registration, now: float) -> Actions:
        if not st.reconciling:
            return []
        gap = st.gaps[-1]
        gap.reports[machine] = reg
        if set(st.slots) | set(st.pool.standby) <= set(gap.reports):
            return self.finish(st, now)
        return []

    def tick(self, st: JobState, now: float) -> Actions:
        gap = st.gaps[-1]
        if now - gap.up_at >= self.grace_s():
            return self.finish(st, now)
        return []

    def finish(self, st: JobState, now: float) -> Actions:
        """Every machine reported (or the bound passed): adopt, resend or restart."""
        gap = st.gaps[-1]
        gap.reconciled_at = now
        reports, gap.reports = gap.reports, {}
        acts: Actions = [record("control_plane_reconciled", now, down_at=gap.down_at)]
        missing = [m for m in st.slots if m not in reports]
        if st.run is not None and st.run.hang is not None:
            st.run.hang.resume(now)         # nobody watched the steps meanwhile: no hang verdict on that
        for m in [m for m in st.pool.standby if m in reports and not reports[m].warm]:
            acts += self.pool.prewarm(st, m)     # its spares died with an agent restart
        if st.phase == JobPhase.WAITING or st.terminal:
            return acts
        for m in missing:
            if self.ctx.cluster.alive(m):
                # heard from (it registered or beats) but its report did not reach the job: it is
                # not lost; a running run is checked below as one whose ranks cannot be confirmed
                log.warning("job %s: %s is alive but its re-registration did not reach the job", st.job_id, m)
                continue
            log.warning("job %s: %s did not come back within %.0fs of the controller restart: lost",
                        st.job_id, m, now - gap.up_at)
            acts.append(record("machine_not_back", now, machine=m, after_s=now - gap.up_at))
            acts += self.failure.on_machine_lost(st, m, now)   # as without a restart
        if st.phase == JobPhase.RUNNING:
            acts += self._running(st, reports, now)
        elif st.phase == JobPhase.TRACING and st.incident is not None:
            st.incident.trace_wait -= set(missing)
            st.incident.trace_sent = now
            acts.append(TraceStacks(machines=sorted(st.incident.trace_wait), run=st.run_seq))
        elif st.phase == JobPhase.RECOVERING and st.incident is not None:
            st.incident.stop_sent = now
            if st.incident.awaiting:
                acts.append(StopWorkers(machines=sorted(st.incident.awaiting), run=st.run_seq,
                                        grace_s=self.ctx.policy.stop_grace_s))
            else:       # every stop arrived while reconciling: decide now
                acts += self.failure.check_stopped(st, now)
        elif st.phase == JobPhase.DIAGNOSING and st.diag is not None and st.incident is not None:
            d = st.diag
            st.diag = None
            acts += self.diagnosis.start(st, st.incident, d.checks, now)
        elif st.phase == JobPhase.REPLAYING and st.replay is not None:
            acts += self.replay.restart_phase(st, now)
        return acts

    def _running(self, st: JobState, reports: dict[str, protocol.Registration], now: float) -> Actions:
        run = st.run
        if run is None or st.incident is not None:
            return []
        G = self.ctx.G
        gone = []
        for i, m in enumerate(st.slots):
            reg = reports.get(m)
            if reg is None:
                if self.ctx.cluster.alive(m):
                    gone.append(m)          # alive but unreported: its ranks cannot be confirmed
                continue
            want = set(range(i * G, (i + 1) * G))
            if reg.running_run != run.seq or not want <= set(reg.ranks) | set(reg.done_ranks):
                gone.append(m)
        if run.committed == 0:
            why = (f"the controller restarted before run {run.seq} completed a step; its workers may "
                   f"wait on the rendezvous store that died with it")
        elif gone:
            why = f"after the controller restart {', '.join(gone)} no longer run all ranks of run {run.seq}"
        else:
            log.info("job %s: run %s kept training through the restart; adopted", st.job_id, run.seq)
            for reg in reports.values():
                for r in reg.done_ranks if reg.running_run == run.seq else ():
                    run.finished(r)                 # (a rank that finished while nobody listened)
            return [record("run_adopted", now, run=run.seq, step=st.steps_done)]
        acts = self.failure.open(st, "control_plane", now)
        if st.incident is not None:
            st.incident.reason = why
            st.incident.data["analysis"] = why
        return acts
