"""Hangs: no progress past the calibrated timeout (`hangwatch`), then every machine's stacks and
flight-recorder summaries single out the stuck machine (`controller.implicit`).

A hang after the training ended is no failure to recover from: when every rank still running is
stalled and the others exited 0, the script finished on those and the stalled ones are stuck
leaving it (while some still show activity, they are left to finish first). No collective can
complete any more with a peer that exited, so there is nothing left to train; restarting would
redo whatever the script's last snapshot did not hold. The job ends as succeeded, the stuck
workers are stopped, and an ``exit_hang`` record names them; the steps every finished rank
reported are committed for them too (their own last reports may never come). The case is
common: a gloo process group destroyed while the script's last references to it go (the model
returned from ``main``) joins its worker threads holding the interpreter lock, and a worker
thread releasing a tensor needs that lock, so the process never exits (torch's deadlock; under
torchrun the job would wait forever).
"""
from __future__ import annotations

import logging

from stalwart import protocol
from stalwart.controller.rules import hangstacks as implicit
from stalwart.controller.job.detectors.base import Actions, BaseDetector
from stalwart.controller.job.flows.base import record, save_data
from stalwart.controller.job.state import JobPhase, JobState
from stalwart.controller.rules.hangwatch import HangVerdict

ABNORMAL_STATES = ("stopped", "disk-sleep", "tracing-stop")  # a worker stuck by the machine itself
TRACE_TIMEOUT_S = 10.0          # how long to wait for every machine's stacks

log = logging.getLogger(__name__)


class HangDetector(BaseDetector):
    name = "hang"

    def tick(self, st: JobState, now: float) -> Actions:
        run = st.run
        if run is None or run.hang is None:
            return []
        verdict = run.hang.check(now)
        if verdict is None:
            return []
        done = run.hang.done()
        if done:
            if len(done) + len(verdict.stalled) == self.ctx.world:
                return self._exit_hang(st, done, verdict, now)
            return []       # some ranks still work on their way out: judged when they are done
        acts = self.incidents.open(st, "hang", now, trace=True)
        if st.incident is not None:
            st.incident.reason = verdict.reason
            st.incident.data["hang"] = {"timeout_s": round(verdict.timeout_s, 3), "calibrated": verdict.calibrated,
                                        "stalled_since": verdict.stalled_since,
                                        "stalled_ranks": sorted(verdict.stalled)}
        return acts

    def _exit_hang(self, st: JobState, done: list[int], verdict: HangVerdict, now: float) -> Actions:
        """Every rank still running is stalled and the others exited 0: the training is over."""
        ranks = sorted(verdict.stalled)
        machines = [st.slots[i] for i in self.ctx.topo.machines_of(ranks)]
        reason = (f"rank(s) {ranks} on {', '.join(machines)} stuck {now - verdict.stalled_since:.1f} s "
                  f"(timeout {verdict.timeout_s:.1f} s) after the other {len(done)} finished (exit 0): the "
                  f"training ended, a hang on the way out; stopped them")
        log.warning("job %s: %s", st.job_id, reason)
        acts: Actions = [record("exit_hang", now, run=st.run_seq, ranks=ranks, machines=machines,
                                done=done, stalled_since=verdict.stalled_since, timeout_s=verdict.timeout_s)]
        return acts + self.incidents.finish_stuck(st, ranks, reason, now)

    def observe(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        inc = st.incident
        if not isinstance(ev, protocol.Stacks) or ev.run != st.run_seq or st.phase != JobPhase.TRACING \
                or inc is None:
            return []
        inc.stacks[machine] = list(ev.records)
        inc.trace_wait.discard(machine)
        return self.finish_trace(st, now) if not inc.trace_wait else []

    def trace_tick(self, st: JobState, now: float) -> Actions:
        """While tracing: the stacks that came within TRACE_TIMEOUT_S are all there will be."""
        inc = st.incident
        if inc is not None and inc.trace_sent is not None and now - inc.trace_sent > TRACE_TIMEOUT_S:
            return self.finish_trace(st, now)
        return []

    def finish_trace(self, st: JobState, now: float) -> Actions:
        """Stacks are in: single out the stuck machines (a stopped/frozen worker names its machine
        outright; otherwise group the stacks and over-evict the outliers' parallel group)."""
        inc = st.incident
        assert inc is not None
        stacks = inc.stacks
        odd = sorted({rec["rank"] for recs in stacks.values() for rec in recs
                      if rec.get("role") == "worker" and rec.get("status") in ABNORMAL_STATES})
        # each rank's flight-recorder summary, where its agent had one (agent/progress.py)
        fr = {rec["rank"]: rec["flight_recorder"] for recs in stacks.values() for rec in recs
              if rec.get("role") == "worker" and isinstance(rec.get("rank"), int)
              and isinstance(rec.get("flight_recorder"), dict)}
        evidence = implicit.flightrec_evidence(fr, self.ctx.topo, now) if fr else None
        if odd:
            machines = [st.slots[i] for i in self.ctx.topo.machines_of(odd)]
            reason = f"rank(s) {odd} stopped or frozen on {', '.join(machines)}"
            if evidence is not None:
                reason += f"; flight recorder: {evidence['summary']}"
        elif stacks:
            d = implicit.decide_hang(stacks, self.ctx.topo, list(st.slots), fr_dumps=fr or None)
            machines, reason = list(d.machines), d.reason
            if evidence is not None and d.source != "flightrec":
                reason += f"; flight recorder: {evidence['summary']}"
            if machines and not self.ctx.policy.over_evict:
                reason = f"{reason}; not evicting on stacks (policy.over_evict is off): stop-time checks decide"
                machines = []
        else:
            machines, reason = [], "no machine answered the stack capture"
        inc.implicit_evict = machines
        inc.reason = f"{inc.reason or 'hang'}; {reason}"
        inc.data.update(stacks=stacks, analysis=inc.reason)
        if evidence is not None:
            inc.data["flight_recorder"] = evidence
        acts: Actions = [save_data(inc), record("incident_traced", now, incident=inc.seq, machines=machines)]
        return acts + self.incidents.stop_run(st, now)
