"""Stop-time diagnostics: run the checks the ladder asks for on every machine, read their verdict,
and pick the next rung (evict, reattempt, roll back, replay). The pure parts are `ladder` (which
checks, what the results mean, which rung) and `stalwart.diag.pairs`; the agents run
`stalwart.diag.worker` (agent/diagnose.py)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from stalwart import protocol
from stalwart.controller.rules import ladder
from stalwart.controller.rules import policy
from stalwart.controller.code import versions
from stalwart.controller.rules.policy import Mechanism
from stalwart.controller.job.actions import CloseScratch, RunChecks
from stalwart.controller.job.flows.base import Actions, Ctx, Failures, Replays, record, save_data
from stalwart.controller.job.state import Diagnosis, Incident, IncidentPhase, JobPhase, JobState, PastIncident
from stalwart.diag.pairs import round_count

DIAG_GRACE_S = 15.0      # start-up of the check processes (torch import) on top of their bounds
# (the agent kills its check processes at START_GRACE_S + bound x (2 + rounds); we wait 5 s more)


class DiagnosisFlow:
    def __init__(self, ctx: Ctx, *, failure: Failures, replay: Replays):
        self.ctx = ctx
        self.failure = failure
        self.replay = replay

    def maybe_diagnose(self, st: JobState, inc: Incident, res: policy.Resolution, now: float) -> Actions | None:
        """Start stop-time checks when `res` found no machine to blame, or when its evictions are
        a guess that outnumbers the ready standbys (a check confirms them first); None when no
        check starts (the caller recovers at once)."""
        p = self.ctx.policy
        inc.resolution = res
        if res.evict and not self._confirm(st, inc, res):
            return None
        if not res.evict and res.mechanism != Mechanism.REATTEMPT:
            return None
        checks = ladder.checks_for(res.symptom, res.category, len(st.slots), p.stop_time_checks,
                                   p.alignment_test)
        if inc.confirm and not checks:
            return None
        if not checks and not self.replay.possible(st)[0]:
            return None
        return self.start(st, inc, checks, now)

    def _confirm(self, st: JobState, inc: Incident, res: policy.Resolution) -> bool:
        """A guess (a hang's over-eviction, a stack verdict, network alerts) that would evict more
        machines than there are ready standbys is confirmed by a check first instead of failing
        the job on it (machine-certain evidence is never second-guessed)."""
        short = policy.standby_shortfall(res.evict, len(self.ctx.ready_standbys(st)))
        guess = inc.implicit or not res.certain
        if short is None or not guess or inc.lost or not self.ctx.policy.stop_time_checks:
            return False
        if res.fail_reason not in (None, short):      # failing for another reason (no progress)
            return False
        inc.confirm = True
        inc.resolution = dataclasses.replace(res, mechanism=Mechanism.REATTEMPT, fail_reason=None,
                                             cause=f"{res.cause}; {short}: confirming with stop-time checks")
        return True

    def start(self, st: JobState, inc: Incident, checks: list[str], now: float) -> Actions:
        st.diag_seq += 1
        name = f"job{st.job_id}-diag{st.diag_seq}"
        ring = list(st.slots) if "inter" in checks and len(st.slots) >= 2 else []
        bound = self.ctx.policy.diag_timeout_s
        rounds = round_count(len(ring)) or 1
        st.diag = Diagnosis(name=name, checks=checks, ring=ring, wait=set(st.slots) if checks else set(),
                            started=now, deadline=now + DIAG_GRACE_S + bound * (2 + rounds) + 5.0)
        st.move(JobPhase.DIAGNOSING)
        inc.move(IncidentPhase.LOCALIZING)
        acts: Actions = [record("checks_started", now, incident=inc.seq, checks=checks)]
        if checks:
            acts.append(RunChecks(name=name, checks=checks, machines=sorted(st.diag.wait), ring=ring,
                                  timeout_s=bound))
            return acts
        return acts + self.diagnosed(st, now)

    def on_result(self, st: JobState, machine: str, ev: protocol.DiagResult, now: float) -> Actions:
        d = st.diag
        if d is None or ev.id != d.name or machine not in d.wait or st.reconciling:
            return []       # (while a restart is reconciled: the checks are run again after it)
        d.answers[machine] = ev.results
        d.wait.discard(machine)
        return self.diagnosed(st, now) if not d.wait else []

    def on_results(self, st: JobState, items: Sequence[tuple[str, protocol.DiagResult]], now: float) -> Actions:
        """Several machines' results at one instant, in order: what `on_result` does for each in
        turn (the job's checks end with the last one awaited; the rest then change nothing)."""
        acts: Actions = []
        d = st.diag
        if d is None or st.reconciling or st.terminal:
            return acts
        name, wait, answers = d.name, d.wait, d.answers
        for machine, ev in items:
            if ev.id != name or machine not in wait:
                continue
            answers[machine] = ev.results      # (kept as sent: never changed)
            wait.discard(machine)
            if not wait:
                return self.diagnosed(st, now)      # st.diag is None now: the rest are not looked at
        return acts

    def on_lost(self, st: JobState, machine: str, now: float) -> Actions:
        """A machine fell silent during the checks: certain evidence, so the checks stop (its
        partners would only wait out their bound for it) and the incident is localized again with
        the machine lost: it is evicted, nobody else is blamed for its silence."""
        d, inc = st.diag, st.incident
        if d is None or inc is None or st.reconciling:
            return []
        st.diag = None
        took = round(now - d.started, 3)
        rows, left_out = ladder.kept_rows(d.answers, d.ring, ())
        inc.data["stop_time_checks"] = {"checks": d.checks, "seconds": took, "aborted": f"{machine} lost",
                                        "results": rows, "rows_left_out": left_out}
        acts: Actions = [CloseScratch(name=d.name), save_data(inc),
                         record("checks_done", now, incident=inc.seq, seconds=took, evict=[],
                                aborted=f"{machine} lost")]
        # a guess being confirmed (`_confirm`) stays unconfirmed: the lost machine alone is evicted
        res = self.failure.resolution(st, inc, now, guesses=not inc.confirm)
        return acts + self.failure.recover(st, inc, res, now)

    def tick(self, st: JobState, now: float) -> Actions:
        d = st.diag
        if d is not None and d.wait and now > d.deadline:
            return self.diagnosed(st, now)
        return []

    def diagnosed(self, st: JobState, now: float) -> Actions:
        d, inc = st.diag, st.incident
        assert d is not None and inc is not None and inc.resolution is not None
        st.diag = None
        res = inc.resolution
        v = ladder.verdict(d.answers, st.slots, d.ring, missing=sorted(d.wait),
                           lost=sorted(m for m in inc.lost if m in st.slots))
        ready = len(self.ctx.ready_standbys(st))
        evict, why = ladder.evictions(v, ready)
        took = round(now - d.started, 3)
        rows, left_out = ladder.kept_rows(d.answers, d.ring, v["bad"])
        inc.data["stop_time_checks"] = {"checks": d.checks, "seconds": took, "bad": v["bad"],
                                        "links": v["links"], "pairs": v["pairs"], "results": rows,
                                        "rows_left_out": left_out, "inconclusive": v.get("inconclusive")}
        acts: Actions = [CloseScratch(name=d.name), save_data(inc),
                         record("checks_done", now, incident=inc.seq, seconds=took, evict=evict)]
        if evict:
            res = dataclasses.replace(res, evict=evict, suspects=list(evict), mechanism=Mechanism.EVICT_RESTART,
                                      cause=f"{res.cause}; stop-time checks: {why}")
            short = policy.standby_shortfall(evict, ready)
            if short is not None:
                res = dataclasses.replace(res, mechanism=Mechanism.FAIL, fail_reason=f"stop-time checks: {short}")
            return acts + self.failure.recover(st, inc, res, now)
        if v.get("inconclusive"):
            res = dataclasses.replace(res, cause=f"{res.cause}; stop-time checks inconclusive: {v['inconclusive']}")
        elif d.checks:
            res = dataclasses.replace(
                res, cause=f"{res.cause}; stop-time checks ({', '.join(d.checks)}) passed in {took:.1f}s")
        if inc.confirm:
            res = dataclasses.replace(res, evict=[], suspects=[], mechanism=Mechanism.REATTEMPT,
                                      cause=f"{res.cause}; no machine confirmed: evicting none")
        previous = ladder.streak([dataclasses.asdict(h) for h in st.history], self.ctx.policy.ladder_window_s,
                                 inc.detected_at)
        possible, why_not = self.replay.possible(st)
        rung = ladder.next_rung(previous, possible)
        rollback = None
        if st.version_id is not None:
            current = dataclasses.asdict(inc_summary(inc, res))
            rollback = versions.rollback_reason(st.version(), [dataclasses.asdict(h) for h in st.history]
                                                + [current], now + 1e-6)
        if rung == "replay" and rollback is None:
            return acts + self.replay.start(st, inc, res, now)
        if previous and not possible:
            res = dataclasses.replace(res, cause=f"{res.cause}; no dual-phase replay: {why_not}")
        return acts + self.failure.recover(st, inc, res, now)


def inc_summary(inc: Incident, res: policy.Resolution) -> PastIncident:
    """The incident as the ladder and the rollback rule read it."""
    return PastIncident(id=inc.seq, detected_at=inc.detected_at, symptom=res.symptom, category=res.category,
                        mechanism=res.mechanism, evicted=list(res.evict), cause=res.cause)
