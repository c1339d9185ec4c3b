"""Incidents: open one, stop the run, gather evidence, localize, recover (evict, restart) or fail.

Explicit failures (a worker's exit, a probe's alert, a lost machine) arrive here directly; the
implicit ones (hang, NaN, fail-slow, peer outlier) are found by `implicit.py` and open their
incident through `open`. Localization asks the pure `policy.resolve`; what it cannot pin on a
machine goes to the stop-time checks (`diagnosis.py`) before the recovery.
"""
from __future__ import annotations

import dataclasses
import logging

from stalwart import protocol
from stalwart.analyzer.classify import classify
from stalwart.controller.cluster import placement
from stalwart.controller.rules import policy
from stalwart.controller.code import versions
from stalwart.controller.rules.policy import Mechanism
from stalwart.controller.cluster.roles import Role
from stalwart.controller.job.actions import (AssignMachine, FinishJob, OpenIncident, StopWorkers,
                                             TraceStacks, UpdateIncident, UpdateRun)
from stalwart.controller.job.events import StopReport
from stalwart.controller.job.flows.base import Actions, Ctx, Detection, Diagnoses, HotUpdates, Replays, Restarts, record
from stalwart.controller.job.state import (Incident, IncidentPhase, JobPhase, JobState, PastIncident)

log = logging.getLogger("stalwart.controller")
IMPLICIT = ("hang", "nan", "loss_spike", "fail_slow", "peer_outlier", "trace_outlier")
CONTROL_PLANE = "control_plane"     # a run the controller's restart cut short
# Evidence keeps arriving for a moment after the first symptom (the probe alert behind a crash, the
# second network alert): localize no earlier than this after detection. Probes run every second.
EVIDENCE_SETTLE_S = 1.5
STOP_GRACE_EXTRA_S = 10.0    # machines that neither stop nor fall silent within this are lost
SILENCE_MARGIN_S = 1e-3      # the machines asked about beyond the silence limit (the rule decides)
# A network condition that still stands (a NIC down) while the job makes no step for this many of
# its step times (and at least NET_STALL_MIN_S) is failing the job: its incident opens then, not
# at the hang timeout. One occurrence that heals while the job trains on costs nothing (a flap's
# down state is reported standing until the probe's next check sees it up: a few seconds' margin).
NET_STALL_STEPS = 3
NET_STALL_MIN_S = 3.0


def to_alert(machine: str, ev: protocol.Health) -> policy.Alert:
    """A probe's health event as the rules read it (network probes name the occurrences they saw
    and whether the condition still stands)."""
    d = ev.detail if isinstance(ev.detail, dict) else {}
    ids = d.get("occurrences")
    return policy.Alert(machine=machine, kind=ev.kind, severity=ev.severity,
                        machine_certain=bool(ev.machine_certain), network=bool(ev.network),
                        detail=detail_text({k: v for k, v in d.items() if k not in ("occurrences", "standing")}
                                           if d else ev.detail), t=ev.t,
                        occurrences=tuple(str(i) for i in ids) if isinstance(ids, list) else (),
                        standing=bool(d.get("standing")))


def detail_text(detail) -> str:
    """A probe's detail as one readable line (its log text when it has one)."""
    if isinstance(detail, dict):
        if detail.get("text"):
            return str(detail["text"])
        return ", ".join(f"{k}={v}" for k, v in detail.items())
    return str(detail or "")


class FailureFlow:
    run: Restarts
    implicit: Detection
    diagnosis: Diagnoses
    replay: Replays
    hotupdate: HotUpdates

    def __init__(self, ctx: Ctx):
        self.ctx = ctx

    def connect(self, *, run: Restarts, implicit: Detection, diagnosis: Diagnoses, replay: Replays,
                hotupdate: HotUpdates) -> None:
        """The flows that also call this one, once they are built."""
        self.run = run
        self.implicit = implicit
        self.diagnosis = diagnosis
        self.replay = replay
        self.hotupdate = hotupdate

    # -- opening and stopping -------------------------------------------------------------------
    def open(self, st: JobState, symptom: str, now: float, trace: bool = False) -> Actions:
        """Open an incident and stop the run; with `trace`, first capture every machine's stacks.
        Nothing happens while another incident is open (its evidence grows instead)."""
        if st.incident is not None:
            return []
        implicit, planned = symptom in IMPLICIT, symptom == "hot_update"
        st.incident_seq += 1
        inc = Incident(seq=st.incident_seq, symptom=symptom, detected_at=now, implicit=implicit,
                       planned=planned, run=st.run_seq, awaiting=set(st.slots))
        st.incident = inc
        category = ("implicit" if implicit else "manual" if planned
                    else CONTROL_PLANE if symptom == CONTROL_PLANE else "explicit")
        acts: Actions = [OpenIncident(seq=inc.seq, run=st.run_seq, symptom=symptom, category=category,
                                      detected_at=now),
                         record("incident_opened", now, incident=inc.seq, symptom=symptom,
                                injected_at=None, planned=planned)]
        if trace:
            st.move(JobPhase.TRACING)
            inc.move(IncidentPhase.TRACING)
            inc.trace_wait, inc.trace_sent = set(st.slots), now
            return acts + [TraceStacks(machines=list(st.slots), run=st.run_seq)]
        return acts + self.stop_run(st, now)

    def stop_run(self, st: JobState, now: float) -> Actions:
        inc = st.incident
        assert inc is not None
        inc.stop_sent = now
        inc.move(IncidentPhase.STOPPING)
        st.move(JobPhase.RECOVERING)
        log.info("job %s: incident %s (%s); stopping run %s", st.job_id, inc.seq, inc.symptom, st.run_seq)
        return [StopWorkers(machines=list(st.slots), run=st.run_seq, grace_s=self.ctx.policy.stop_grace_s)]

    def check_stopped(self, st: JobState, now: float) -> Actions:
        """While stopping: machines silent for two beats (more where this host's beats came late)
        are lost; once every machine stopped (or the bound passed) and the evidence had its moment,
        localize."""
        inc = st.incident
        assert inc is not None and inc.stop_sent is not None
        if st.reconciling:
            # a restarted controller decides nothing until its machines are back (a standby not yet
            # re-registered is not a missing standby); stops delivered late are kept meanwhile
            return []
        p = self.ctx.policy
        limit = inc.stop_sent + STOP_GRACE_EXTRA_S + p.heartbeat_s * p.missed_beats
        # silent relative to the job's freshest machine, not to the clock: a controller too busy to
        # read heartbeats (a backlog after a restart, a loaded host) hears every machine late, and
        # that is no machine's fault; a dead machine falls behind the live ones
        # (only the machines still awaited are judged: their times alone are kept, the freshest
        # time is any slot's)
        # (a machine awaited outside the slots is never heard). The cluster names the machines not
        # heard for about the silence limit; the rule then judges those exactly.
        heard: dict[str, float | None] = {}
        latest = now
        late = 0.0
        if inc.awaiting:
            cluster = self.ctx.cluster
            freshest = cluster.freshest(st.slots)
            latest = now if freshest is None else freshest
            late = cluster.beat_late_s()
            near = latest - policy.silence_limit(p.heartbeat_s, late) + SILENCE_MARGIN_S
            outside = inc.awaiting.difference(st.slots)      # (none unless the slots changed since)
            heard = cluster.unheard_since(inc.awaiting - outside if outside else inc.awaiting, near)
            heard.update(dict.fromkeys(outside))
        noted: Actions = []
        for m in policy.silent_during_stop(heard, heard, latest, p.heartbeat_s, late):
            inc.awaiting.discard(m)
            inc.lost.add(m)
            seen = heard.get(m)
            silent_s = None if seen is None else latest - seen
            log.warning("job %s: %s silent after the stop (%s behind the freshest machine): lost",
                        st.job_id, m, "never heard" if silent_s is None else f"{silent_s:.1f}s")
            noted.append(record("machine_silent", now, machine=m, incident=inc.seq, behind_s=silent_s))
        # an implicit symptom that already names its machines (the non-finite local gradients, the
        # outlier stacks) is its own evidence: nothing a probe says next changes whom it evicts
        explained = bool(inc.implicit and inc.implicit_evict) or policy.cause_in_hand(
            inc.planned or inc.symptom == CONTROL_PLANE, tuple(inc.exits), tuple(inc.alerts), tuple(inc.lost))
        if (inc.awaiting and now < limit) or (not explained and now < inc.detected_at + EVIDENCE_SETTLE_S):
            return noted
        if inc.awaiting:                  # alive but did not stop: cannot be trusted with ranks
            noted.append(record("machine_unstopped", now, machine=sorted(inc.awaiting), incident=inc.seq))
        inc.lost |= inc.awaiting
        inc.awaiting = set()
        acts: Actions = noted + [record("run_stopped", now, run=st.run_seq),
                         UpdateRun(seq=st.run_seq, fields={"stopped_at": now, "end_step": st.steps_done})]
        return acts + self.localize(st, now)

    # -- localizing and recovering ---------------------------------------------------------------
    def localize(self, st: JobState, now: float) -> Actions:
        inc = st.incident
        assert inc is not None
        if st.best_steps <= st.progress_at_run_start:
            st.restarts_without_progress += 1
        else:
            st.restarts_without_progress = 0
        if inc.planned:
            return self.hotupdate.apply_planned(st, inc, now)
        if inc.symptom == CONTROL_PLANE and not (inc.exits or inc.lost or inc.alerts):
            res = policy.Resolution(symptom=CONTROL_PLANE, category=CONTROL_PLANE, suspects=[],
                                    cause=inc.reason or "the controller restarted", mechanism=Mechanism.REATTEMPT)
            return self.recover(st, inc, res, now)
        res = self.resolution(st, inc, now)
        started = self.diagnosis.maybe_diagnose(st, inc, res, now)
        if started is not None:
            return started
        return self.recover(st, inc, res, now)

    def resolution(self, st: JobState, inc: Incident, now: float, guesses: bool = True) -> policy.Resolution:
        """What the incident's evidence so far says (`policy.resolve`). `guesses=False` leaves out
        the network alerts and the stacks' over-eviction: a guess the checks were confirming when
        they ended without a verdict (a machine lost meanwhile) evicts nobody."""
        alerts, standing = self.evidence_alerts(st, inc, now)
        implicit_evict = tuple(inc.implicit_evict)
        if not guesses:
            alerts, standing, implicit_evict = tuple(a for a in alerts if not a.network), (), ()
        ev = policy.Evidence(exits=tuple(inc.exits), lost=tuple(sorted(inc.lost)), alerts=alerts,
                             implicit_symptom=inc.symptom if inc.implicit else None,
                             implicit_evict=implicit_evict, implicit_reason=inc.reason,
                             standing=standing)
        res = policy.resolve(self.ctx.snapshot(st), ev, now)
        if not guesses:
            res = dataclasses.replace(res, cause=f"{res.cause}; the guess the checks were confirming was "
                                                 f"not confirmed and evicts nobody")
        return res

    def _injected_at(self, st: JobState, inc: Incident) -> float | None:
        near = [t for t in st.chaos_applied if t <= inc.detected_at + 0.5 and inc.detected_at - t < 120]
        return max(near) if near else None

    def recover(self, st: JobState, inc: Incident, res: policy.Resolution, now: float) -> Actions:
        """Record how the incident was localized and restart (or fail) accordingly."""
        injected_at = self._injected_at(st, inc)
        acts: Actions = [
            UpdateIncident(seq=inc.seq, fields=dict(
                symptom=res.symptom, category=res.category, cause=res.cause, suspects=res.suspects,
                evicted=res.evict, mechanism=res.mechanism, localized_at=now, injected_at=injected_at)),
            record("incident_localized", now, incident=inc.seq, injected_at=injected_at,
                   mechanism=res.mechanism)]
        st.incident = None
        st.awaiting_resume.append(inc.seq)
        past = PastIncident(id=inc.seq, detected_at=inc.detected_at, symptom=res.symptom,
                            category=res.category, mechanism=res.mechanism, evicted=list(res.evict),
                            cause=res.cause)
        st.history.append(past)
        if st.version_id is not None and res.mechanism in (Mechanism.FAIL, Mechanism.REATTEMPT) and not res.evict:
            why = versions.rollback_reason(st.version(), [dataclasses.asdict(h) for h in st.history],
                                           now + 1e-6)
            if why is not None:       # the new code is to blame: back to the last stable version
                acts += self.hotupdate.rollback(st, why, now)
                res = dataclasses.replace(res, mechanism=Mechanism.ROLLBACK, cause=f"{res.cause}; {why}")
                past.mechanism, past.cause = res.mechanism, res.cause
                acts += [UpdateIncident(seq=inc.seq, fields={"mechanism": Mechanism.ROLLBACK, "cause": res.cause}),
                         record("version_rolled_back", now, incident=inc.seq, to=st.version_id)]
        if res.mechanism == Mechanism.FAIL:
            inc.move(IncidentPhase.FAILED)
            return acts + self.finish(st, "failed", res.fail_reason, now)
        inc.move(IncidentPhase.RESTARTING)
        acts += self.replace_machines(st, inc, res, now)
        if st.version_id is not None and res.mechanism != Mechanism.ROLLBACK:
            acts += self.hotupdate.apply_due_at_failure(st, inc, now)   # lazy updates ride along
        return acts + self.run.restart(st, now)

    def replace_machines(self, st: JobState, inc: Incident, res: policy.Resolution, now: float) -> Actions:
        """Evicted machines leave; standbys take their slots (their memory is gone, too)."""
        acts: Actions = []
        ready = self.ctx.ready_standbys(st)
        labels = {m: self.ctx.cluster.labels(m) for m in ready}
        groups = {m: [self.ctx.cluster.labels(st.slots[i]) for i in self.ctx.placement_group(st.slots.index(m))]
                  for m in res.evict if m in st.slots} if any(labels.values()) else {}
        plan = placement.replacement_plan(st.slots, res.evict, ready, groups, labels)
        for m in set(inc.lost) | set(res.evict):
            st.avail.drop_machine(m)      # its memory (own shards, peers' backups) is gone
        for old, new in plan.items():
            acts += [AssignMachine(machine=old, state=Role.EVICTED, reason=res.cause, incident=inc.seq),
                     StopWorkers(machines=[old], run=None)]
            st.slots[st.slots.index(old)] = new
            st.pool.standby.remove(new)
            acts.append(AssignMachine(machine=new, state=Role.ACTIVE))
            if groups:        # where the standby sits relative to the group: switch, pod or far
                near = placement.distance(labels[new], groups.get(old, ()))
                acts.append(record("standby_placed", now, machine=new, replaces=old, incident=inc.seq,
                                   near=placement.LEVELS[near] if near < len(placement.LEVELS) else "far"))
        return acts

    # -- the end --------------------------------------------------------------------------------
    def finish_stuck(self, st: JobState, ranks: list[int], reason: str, now: float) -> Actions:
        acts = self.run.fill_steps(st, ranks, now)
        if st.phase != JobPhase.RUNNING:        # a filled step was an anomaly: its incident decides
            return acts
        return acts + self.finish(st, "succeeded", reason, now)

    def finish(self, st: JobState, state: str, reason: str | None, now: float) -> Actions:
        if st.terminal:
            return []
        st.move(JobPhase(state))
        st.reason = reason
        machines = list(st.slots) + list(st.pool.standby)
        acts: Actions = [StopWorkers(machines=machines, run=None)]
        if st.gaps and st.gaps[-1].reconciled_at is None:      # it ended while being taken over
            st.gaps[-1].reconciled_at = now
            acts.append(record("control_plane_reconciled", now, down_at=st.gaps[-1].down_at))
        if st.run is not None:
            acts.append(UpdateRun(seq=st.run_seq, fields={"stopped_at": now, "end_step": st.steps_done}))
        acts += [record("job_finished", now, state=state, reason=reason),
                 FinishJob(state=state, reason=reason, machines=machines, t=now)]
        log.info("job %s %s%s", st.job_id, state, f": {reason}" if reason else "")
        return acts

    # -- evidence from agents and the controller -------------------------------------------------
    def on_worker_exit(self, st: JobState, machine: str, ev: protocol.WorkerExit, now: float) -> Actions:
        if ev.run != st.run_seq or ev.expected or ev.rank is None:
            return []
        if ev.code == 0:
            if st.run is not None:
                st.run.finished(ev.rank)
                if len(st.run.done_ranks) == self.ctx.world and st.phase == JobPhase.RUNNING:
                    return self.finish(st, "succeeded", None, now)
            return []
        sym = classify(ev.log_tail or "", ev.code, ev.signal, st.code_path)
        exit_ = policy.Exit(machine=machine, rank=ev.rank, code=ev.code, signal=ev.signal, symptom=sym.name,
                            category=sym.category, secondary=sym.secondary,
                            machine_certain=sym.machine_certain, user_code=sym.user_code,
                            detail=sym.detail, t=ev.t, location=sym.location)
        acts = self.open(st, exit_.symptom, now) if st.phase == JobPhase.RUNNING else []
        if st.incident is not None:
            st.incident.exits.append(exit_)
        return acts

    def on_health(self, st: JobState, machine: str, ev: protocol.Health, now: float) -> Actions:
        alert = to_alert(machine, ev)
        acts: Actions = [record("health", alert.t, machine=machine, kind=alert.kind, severity=alert.severity)]
        snap = self.ctx.snapshot(st)
        st.alerts = st.open_alerts(alert.t, self.ctx.policy.network_alert_window_s)
        if st.incident is not None:
            st.incident.alerts.append(alert)
        elif st.phase == JobPhase.RUNNING and policy.should_open_incident(alert, snap, alert.t):
            acts += self.open(st, alert.kind, now)
            assert st.incident is not None
            st.incident.alerts.append(alert)      # the earlier ones join at localization
        if alert.network:                         # kept for counting recurrences
            st.alerts.append(alert)
        return acts

    def network_stall(self, st: JobState, now: float) -> Actions:
        """Open an incident when a network condition stands on an active machine and the job has
        made no step since it appeared (the job fails with it; the standing rule localizes it)."""
        if st.phase != JobPhase.RUNNING or st.incident is not None:
            return []
        standing = policy.standing_since(st.alerts)
        if not standing:
            return []
        last_step = st.signals.step_times[-1][0] if st.signals.step_times else None
        recent = sorted(st.signals.step_durs[-5:])
        limit = max(NET_STALL_MIN_S, NET_STALL_STEPS * (recent[len(recent) // 2] if recent else 0.0))
        for machine, (since, alert) in sorted(standing.items()):
            if machine not in st.slots or (last_step is not None and last_step >= since) or now - since < limit:
                continue
            acts = self.open(st, alert.kind, now)
            if st.incident is not None:
                st.incident.alerts.append(alert)
                st.incident.reason = f"{alert.kind} on {machine} for {now - since:.1f}s without a step"
            return acts
        return []

    def evidence_alerts(self, st: JobState, inc: Incident, now: float) -> tuple[tuple[policy.Alert, ...],
                                                                                tuple[str, ...]]:
        """The incident's alerts with the network alerts of the window before it (a recurrence
        counts occurrences from before the incident), and the machines whose network condition was
        still reported as standing while the incident was open."""
        window = self.ctx.policy.network_alert_window_s
        earlier = [a for a in st.open_alerts(now, window) if a.network and a not in inc.alerts]
        alerts = earlier + inc.alerts
        # standing: its latest report says so and came while the incident was open
        standing = sorted(m for m, (_, latest) in policy.standing_since(alerts).items() if latest in inc.alerts)
        return tuple(alerts), tuple(standing)

    def on_stopped(self, st: JobState, machine: str, ev: protocol.Stopped, now: float) -> Actions:
        for tier, held in (ev.inventory or {}).items():
            st.avail.replace_held(machine, tier, {int(r): v for r, v in held.items()})
        return self._stopped(st, machine, ev.run, now)

    def on_stops(self, st: JobState, rep: StopReport, now: float) -> Actions:
        """Every machine's answer to a stop (`StopReport`): what `on_stopped` does for each in
        turn, its inventory taken from the report's columns (the rest once the job ends: none).
        The machines up to the one whose answer completes the stop (`_stopped` acts on it) take
        their inventories in one pass per tier, then that one acts, and so on."""
        acts: Actions = []
        avail, own, backup = st.avail, list(rep.own), list(rep.backup)
        machines, n, i = rep.machines, len(rep.machines), 0
        while i < n and not st.terminal:
            j, last = n, False
            inc = st.incident
            if inc is not None and rep.run == st.run_seq:
                awaiting, recovering = inc.awaiting, st.phase == JobPhase.RECOVERING
                for k in range(i, n):
                    awaiting.discard(machines[k])
                    if recovering and not awaiting:
                        j, last = k + 1, True
                        break
            held = [k for k in range(i, j) if rep.own_ranks[k] is not None]
            if held:
                who = [machines[k] for k in held]
                avail.replace_columns("own", who, [rep.own_ranks[k] or () for k in held], own)
                avail.replace_columns("backup", who, [rep.backup_ranks[k] for k in held], backup)
            if last:
                acts += self.check_stopped(st, now)      # the last one: no need to wait for a tick
            i = j
        return acts

    def _stopped(self, st: JobState, machine: str, run: int | None, now: float) -> Actions:
        inc = st.incident
        if inc is not None and run == st.run_seq:
            inc.awaiting.discard(machine)
            if st.phase == JobPhase.RECOVERING and not inc.awaiting:
                return self.check_stopped(st, now)      # the last one: no need to wait for a tick
        return []

    def on_machine_lost(self, st: JobState, machine: str, now: float) -> Actions:
        acts: Actions = []
        if machine in st.slots and st.phase in (JobPhase.RUNNING, JobPhase.RECOVERING, JobPhase.TRACING):
            acts += self.open(st, "machine_lost", now)
            inc = st.incident
            assert inc is not None
            inc.lost.add(machine)
            inc.awaiting.discard(machine)
            inc.trace_wait.discard(machine)
            if st.phase == JobPhase.TRACING and not inc.trace_wait:
                acts += self.implicit.finish_trace(st, now)
        elif machine in st.slots and st.incident is not None and st.phase in (JobPhase.DIAGNOSING,
                                                                              JobPhase.REPLAYING):
            st.incident.lost.add(machine)      # evicted with the verdict: never restarted on
            acts.append(record("machine_lost", now, machine=machine, incident=st.incident.seq))
            acts += (self.diagnosis.on_lost(st, machine, now) if st.phase == JobPhase.DIAGNOSING
                     else self.replay.on_lost(st, machine, now))
        if machine in st.pool.standby:
            st.pool.standby.remove(machine)
            st.pool.warm.discard(machine)
        return acts

    def on_command_failed(self, st: JobState, machine: str, ev: protocol.CommandFailed, now: float) -> Actions:
        """A command the agent could not carry out (e.g. a chaos kind this host cannot do)."""
        log.warning("job %s: %s on %s failed: %s", st.job_id, ev.kind or ev.command, machine, ev.error)
        return [record("command_failed", ev.t or now, machine=machine, command=ev.command, kind=ev.kind,
                       error=ev.error)]
