"""Partial anomalies from execution traces: a rank whose collectives leave the distribution its job
showed while healthy (`analyzer.traces`: peer-relative window features, a one-class density model).

The model learns from the first `trace_train_s` of the job's first run that has traces (after the
run's start-up windows; a fail-slow suspicion does not pause it: a busy host's early stalls raise
one, and the features are relative to the peers); it is kept across the job's
later runs (the same layout: the same peers). Every `trace_window_s` each rank's window is scored;
a rank abnormal in TRACE_STREAK windows in a row raises an implicit alert (`trace_suspect`)
naming its machine, the parallel group the abnormal ranks share, and the collectives that look
abnormal. As the paper's rule asks, an eviction must be explained: the alert evicts only with
`trace_evict` on, when the ranks stayed abnormal TRACE_EVICT_STREAK windows in a row, while the job
is slowed (its recent steps, or the step under way, slower than the healthy pace by the fail-slow
drop), when the machines named are at most half the job and standbys are ready for them;
otherwise it only alerts, at most once per TRACE_REALERT_S per machine (an alert that may evict is
raised whenever the rank stays abnormal).

A stall (a window in which a peer group entered no collective) is judged without the model: a rank
stuck before the collective its peers wait in, using no CPU, for TRACE_STREAK windows in a row is
named the same way (`analyzer.traces.stall_laggards`). That alert never evicts: no step finishes in
a stall, so nothing says the job is slowed rather than paused; the hang detector decides, and the
alert has named the machine seconds before its timeout.
"""
from __future__ import annotations

from statistics import median

from stalwart import protocol
from stalwart.analyzer.failslow import healthy_step_s
from stalwart.analyzer.traces import TraceWatch, describe, op_key
from stalwart.controller.rules import hangstacks as implicit
from stalwart.controller.job.detectors.base import Actions, BaseDetector
from stalwart.controller.job.flows.base import Ctx, record, save_data
from stalwart.controller.job.state import JobPhase, JobState

TRACE_STREAK = 2            # abnormal windows in a row before a rank is named
TRACE_EVICT_STREAK = 4      # ... and before an alert may evict (a busy host's stall passes sooner)
TRACE_REALERT_S = 60.0      # a machine is named again at most this often
MIN_TRAIN_WINDOWS = 3       # windows the model needs before it judges
RECENT_N = 5                # the recent steps that tell whether the job is slowed


class AlertingDetector(BaseDetector):
    """What the detectors that name machines from a learned model share: how often a machine is
    named, and when an alert evicts (on `why_not_evict`'s terms, through a `trace_outlier`
    incident)."""

    def gate(self, st: JobState, last_alert: dict[str, float], machines: list[str], steady: bool,
             now: float) -> bool | None:
        """None: nothing to raise (every machine was named less than TRACE_REALERT_S ago and the
        alert may not evict); else whether it may evict. The machines count as named now."""
        fresh = any(now - last_alert.get(m, -1e18) >= TRACE_REALERT_S for m in machines)
        may_evict = steady and why_not_evict(self.ctx, st, machines, now) is None
        if not fresh and not may_evict:
            return None
        for m in machines:
            last_alert[m] = now
        return may_evict

    def evict(self, st: JobState, machines: list[str], reason: str, now: float, **evidence) -> Actions:
        """An incident that evicts `machines` for the alert, with its evidence under `evidence`'s
        key; nothing while another incident is open (its evidence is its own)."""
        if st.incident is not None:
            return []
        acts = self.incidents.open(st, "trace_outlier", now)
        inc = st.incident
        if inc is None:
            return acts
        slowed = job_slowdown(st, now)
        inc.implicit_evict = machines
        inc.reason = f"{reason}; the job runs {slowed:.1f}x slower than its healthy pace"
        inc.data.update(analysis=inc.reason, **evidence)
        return acts + [save_data(inc)]


class TraceDetector(AlertingDetector):
    name = "trace"

    def new_run(self, st: JobState, now: float) -> None:
        p = self.ctx.policy
        if not p.trace_detector:
            st.signals.traces = None
            return
        old = st.signals.traces
        peers = self.peer_groups()
        model = old.model if old is not None and old.peers == peers else None
        st.signals.traces = TraceWatch(peers=peers, window_s=p.trace_window_s, train_s=p.trace_train_s,
                                       model=model)

    def peer_groups(self) -> list[list[int]]:
        """Ranks that run the same sequence of collectives: those of one pipeline stage."""
        stages: dict[int, list[int]] = {}
        for r, stage in enumerate(self.ctx.stages):
            stages.setdefault(stage, []).append(r)
        return list(stages.values())

    def observe(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        tw = st.signals.traces
        if not isinstance(ev, protocol.Activity) or tw is None or ev.run != st.run_seq \
                or st.phase != JobPhase.RUNNING:
            return []
        world = self.ctx.world
        tw.computed(r for r in ev.ranks if 0 <= r < world)
        if not ev.traces:
            return []
        if not tw.window_end:
            tw.start(now, warmup_s=2 * tw.window_s)
        for rank, ops in ev.traces.items():
            if 0 <= rank < world:
                for op in ops:
                    tw.add(rank, op_key(op.kind, op.desc), op.group, op.dur_ms, op.gap_ms, op.seq)
        return []

    def tick(self, st: JobState, now: float) -> Actions:
        tw = st.signals.traces
        if tw is None or not tw.window_end or now < tw.window_end:
            return []
        stalled = tw.stalls()
        feats = tw.close(now)
        acts = self._stalls(st, tw, stalled, now)
        if tw.model is None:
            return acts + self._train(st, tw, feats, now)
        return acts + self._judge(st, tw, feats, now)

    def _stalls(self, st: JobState, tw: TraceWatch, stalled: dict[int, int], now: float) -> Actions:
        """Name the ranks stuck in a stall TRACE_STREAK windows in a row (an alert only)."""
        for r in [r for r in tw.stall_streak if r not in stalled]:
            del tw.stall_streak[r]
        for r in stalled:
            tw.stall_streak[r] = tw.stall_streak.get(r, 0) + 1
        ranks = sorted(r for r in stalled if tw.stall_streak[r] >= TRACE_STREAK)
        if not ranks:
            return []
        topo = self.ctx.topo
        machines = [st.slots[i] for i in topo.machines_of(ranks)]
        if not [m for m in machines if now - tw.last_alert.get(m, -1e18) >= TRACE_REALERT_S]:
            return []
        for m in machines:
            tw.last_alert[m] = now
        waited = sorted({tw.last_key[r] for g in self.peer_groups() if set(g) & set(ranks)
                         for r in g if r not in stalled and r in tw.last_key})
        collectives = [f"{k} never entered (its peers wait in it)" for k in waited]
        reason = (f"rank(s) {ranks} on {', '.join(machines)} stopped before the collective their peers wait in "
                  f"({', '.join(waited) or 'unknown'}) and used no CPU for {min(tw.stall_streak[r] for r in ranks)} "
                  f"windows of {tw.window_s:g} s")
        return [record("trace_suspect", now, run=st.run_seq, machines=machines, ranks=ranks,
                       group=self._group(st, ranks), score=float(max(stalled[r] for r in ranks)),
                       collectives=collectives, reason=reason, stall=True)]

    def _group(self, st: JobState, ranks: list[int]) -> str:
        """The parallel group the ranks share, in words."""
        topo = self.ctx.topo
        shared = topo.shared_group(ranks)
        return (f"{shared[0]} group of {', '.join(st.slots[i] for i in shared[1])}" if shared else
                implicit.describe_group(ranks, topo))

    def _train(self, st: JobState, tw: TraceWatch, feats: dict[int, dict[str, float]], now: float) -> Actions:
        if now <= tw.train_until - tw.train_s:
            return []                                     # the run's start-up: no healthy pace yet
        if feats:
            tw.learn(feats)
        if now < tw.train_until or tw.learned < MIN_TRAIN_WINDOWS:
            return []
        model = tw.fit()
        return [record("trace_model_fitted", now, run=st.run_seq, windows=model.windows,
                       features=len(model.center), threshold=round(model.threshold, 2))]

    def _judge(self, st: JobState, tw: TraceWatch, feats: dict[int, dict[str, float]], now: float) -> Actions:
        model = tw.model
        assert model is not None
        abnormal: dict[int, tuple[float, list[str]]] = {}
        for rank, row in feats.items():
            score, worst = model.score(row)
            if worst:
                tw.streak[rank] = tw.streak.get(rank, 0) + 1
                if tw.streak[rank] >= TRACE_STREAK:
                    abnormal[rank] = (score, worst)
            else:
                tw.streak.pop(rank, None)
        if not abnormal:
            return []
        topo = self.ctx.topo
        ranks = sorted(abnormal)
        machines = [st.slots[i] for i in topo.machines_of(ranks)]
        steady = min(tw.streak[r] for r in ranks) >= TRACE_EVICT_STREAK
        may_evict = self.gate(st, tw.last_alert, machines, steady, now)
        if may_evict is None:
            return []
        group = self._group(st, ranks)
        collectives = sorted({w for _, worst in abnormal.values() for w in describe(worst[:3])})
        score = max(s for s, _ in abnormal.values())
        reason = (f"collective traces of rank(s) {ranks} on {', '.join(machines)} left the distribution "
                  f"learned while healthy (score {score:.1f} > {model.threshold:.1f}): "
                  f"{'; '.join(collectives)}")
        acts: Actions = [record("trace_suspect", now, run=st.run_seq, machines=machines, ranks=ranks,
                                group=group, score=round(score, 2), collectives=collectives, reason=reason)]
        if not may_evict:
            return acts
        return acts + self.evict(st, machines, reason, now,
                                 trace={"ranks": ranks, "group": group, "collectives": collectives})


def job_slowdown(st: JobState, now: float) -> float:
    """How many times slower than its healthy pace the job runs: the median of its last RECENT_N
    steps, or the step under way when it has already taken longer (its time so far is a lower
    bound on its length). A link that makes steps 90x slower finishes the three slow steps a
    median needs only some 270 healthy steps' time after the fault; the step under way says so
    within a window."""
    sig = st.signals
    best = healthy_step_s(sig.step_durs, RECENT_N, sig.failslow_ref_s)
    if not best:
        return 1.0          # (as `slowdown`: nothing to compare with)
    under_way = now - sig.committed_at if sig.committed_at else 0.0
    return max(median(sig.step_durs[-RECENT_N:]), under_way) / best


def why_not_evict(ctx: Ctx, st: JobState, machines: list[str], now: float) -> str | None:
    """Why an alert naming `machines` must not evict (None: it may): never on a score alone."""
    p = ctx.policy
    if not p.trace_evict:
        return "policy.trace_evict is off"
    if len(machines) > max(1, len(st.slots) // 2):
        return "the alert names most of the job"
    if len(machines) > len(ctx.ready_standbys(st)):
        return "no standby for them"
    if job_slowdown(st, now) < 1 / (1 - p.failslow_drop):
        return "the job is not slowed"
    return None
