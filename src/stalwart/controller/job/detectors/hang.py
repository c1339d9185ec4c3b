"""Hangs: no progress past the calibrated timeout (`hangwatch`), then every machine's stacks and
flight-recorder summaries single out the stuck machine (`controller.implicit`)."""
from __future__ import annotations

from stalwart import protocol
from stalwart.controller.rules import hangstacks as implicit
from stalwart.controller.job.detectors.base import Actions, BaseDetector
from stalwart.controller.job.flows.base import record, save_data
from stalwart.controller.job.state import JobPhase, JobState

ABNORMAL_STATES = ("stopped", "disk-sleep", "tracing-stop")  # a worker stuck by the machine itself
TRACE_TIMEOUT_S = 10.0          # how long to wait for every machine's stacks


class HangDetector(BaseDetector):
    name = "hang"

    def tick(self, st: JobState, now: float) -> Actions:
        run = st.run
        if run is None or run.hang is None:
            return []
        verdict = run.hang.check(now)
        if verdict is None:
            return []
        acts = self.incidents.open(st, "hang", now, trace=True)
        if st.incident is not None:
            st.incident.reason = verdict.reason
            st.incident.data["hang"] = {"timeout_s": round(verdict.timeout_s, 3), "calibrated": verdict.calibrated,
                                        "stalled_since": verdict.stalled_since,
                                        "stalled_ranks": sorted(verdict.stalled)}
        return acts

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
