"""Network faults from the kernel's per-connection figures: a pair of machines whose connections
leave the RTT and loss they showed while healthy, while the pairs they share no machine with do not
(`analyzer.links`: a slow link, a flapping NIC, a partition, which the collective traces cannot tell
apart from a uniformly slower job).

It learns with the trace detector (policy `trace_detector`, `trace_train_s`): each pair's healthy
figures over the first `trace_train_s` of the job's first run that sends them, after two windows of
start-up; the model is kept across runs on the same machines. Windows are LINK_WINDOW_S long and
close when an agent's sample arrives after their end (and on the job's timer): a flapping NIC is
named within a second or two, before its probe stops the run. A window's finding names the machine
common to the abnormal pairs (a partition's pair: both ends); named by losses in one window, or by
RTT in LINK_STREAK windows in a row, it raises the trace detector's alert, `trace_suspect` with
`link: true`, at most once per TRACE_REALERT_S per machine. The alert evicts on the trace detector's
terms only (`trace.why_not_evict`: `trace_evict` on, named TRACE_EVICT_STREAK windows in a row, the
job slowed, at most half the job, standbys ready): never on the figures alone.
"""
from __future__ import annotations

import math

from stalwart import protocol
from stalwart.analyzer.links import MEMORY_S, Finding, LinkWatch, ends
from stalwart.controller.job.detectors.base import Actions
from stalwart.controller.job.detectors.trace import TRACE_EVICT_STREAK, AlertingDetector
from stalwart.controller.job.flows.base import record
from stalwart.controller.job.state import JobPhase, JobState

LINK_WINDOW_S = 1.0         # a window of the agents' samples (two heartbeats at 0.5 s)
LINK_STREAK = 2             # windows in a row an RTT finding needs before it is an alert
MIN_TRAIN_WINDOWS = 3


class LinkDetector(AlertingDetector):
    name = "links"

    def new_run(self, st: JobState, now: float) -> None:
        p = self.ctx.policy
        if not p.trace_detector:
            st.signals.links = None
            return
        old = st.signals.links
        machines = sorted(st.slots)
        model = old.model if old is not None and old.machines == machines else None
        st.signals.links = LinkWatch(window_s=LINK_WINDOW_S, train_s=p.trace_train_s, machines=machines,
                                     model=model, owner=dict(old.owner) if old is not None else {},
                                     last_alert=dict(old.last_alert) if old is not None else {})

    def observe(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        lw = st.signals.links
        if not isinstance(ev, protocol.Activity) or lw is None or ev.run != st.run_seq or not ev.links:
            return []
        if not lw.window_end:
            lw.start(now, warmup_s=2 * self.ctx.policy.trace_window_s)
        acts = self._close(st, lw, now) if now >= lw.window_end else []
        lw.add(machine, ev.links)
        return acts

    def tick(self, st: JobState, now: float) -> Actions:
        lw = st.signals.links
        if lw is None or not lw.window_end or now < lw.window_end:
            return []
        return self._close(st, lw, now)

    def _close(self, st: JobState, lw: LinkWatch, now: float) -> Actions:
        window = lw.close(now)
        if lw.model is None:
            if st.phase != JobPhase.RUNNING or now <= lw.train_until - lw.train_s:
                return []                     # the run's start-up, or an incident: no healthy figures
            if window:
                lw.learn(window)
            if now < lw.train_until or lw.learned < MIN_TRAIN_WINDOWS:
                return []
            model = lw.fit()
            return [record("link_model_fitted", now, run=st.run_seq, windows=model.windows,
                           pairs=len(model.pairs),
                           healthy={k: {"rtt_ms": None if math.isnan(pm.center) else round(math.exp(pm.center), 3),
                                        "retrans": pm.retrans, "backoff": pm.stuck}
                                    for k, pm in sorted(model.pairs.items())})]
        finding = lw.judge(window, now)
        streak = lw.track(finding)
        if not finding.machines or (not finding.loss and streak < LINK_STREAK):
            return []
        return self._alert(st, lw, finding, streak, now)

    def _alert(self, st: JobState, lw: LinkWatch, finding: Finding, streak: int, now: float) -> Actions:
        machines = [m for m in finding.machines if m in st.slots]
        if not machines:
            return []
        may_evict = self.gate(st, lw.last_alert, machines,
                              st.phase == JobPhase.RUNNING and streak >= TRACE_EVICT_STREAK, now)
        if may_evict is None:
            return []
        pairs = [f"{' - '.join(ends(k))}: {why}" for k, why in sorted(finding.pairs.items())]
        reason = (f"the workers' connections between {'; '.join(pairs)} left what they showed while healthy, "
                  f"and the pairs without {', '.join(machines)} did not: {', '.join(machines)} named (common "
                  f"to the pairs found abnormal in the last {MEMORY_S:g} s; a lone pair names both its ends when "
                  "it loses packets)")
        acts: Actions = [record("trace_suspect", now, run=st.run_seq, machines=machines, ranks=[],
                                group="", score=float(streak), collectives=[], reason=reason, link=True,
                                pairs=dict(sorted(finding.pairs.items())))]
        if not may_evict:
            return acts
        return acts + self.evict(st, machines, reason, now,
                                 links={"machines": machines, "pairs": finding.pairs})
