"""Implicit failures: hangs (stacks from every machine), NaN and loss jumps, fail-slow rounds and
peers that stay unlike each other. The pure parts are `hangwatch`, `implicit` (stacks to an
eviction), `analyzer.failslow` and `peerwatch`; this flow feeds them and acts on their verdicts."""
from __future__ import annotations

import math
from statistics import median
from typing import TYPE_CHECKING

from stalwart import protocol
from stalwart.analyzer.failslow import (FailSlowRounds, baseline_pace, compute_outliers, healthy_pace,
                                        slow_ranks, slowdown, slowdown_exceeds, steady_outliers,
                                        throughput_drop, trimmed_mean)
from stalwart.analyzer.stacks import aggregate
from stalwart.controller import implicit
from stalwart.controller.hangwatch import anomaly, culprit_machines
from stalwart.controller.job.actions import TraceStacks
from stalwart.controller.job.flows.base import Actions, Ctx, record, save_data
from stalwart.controller.job.state import (OPEN_END, BadSteps, FailSlow, JobPhase, JobState, PendingStep,
                                           Signals)
from stalwart.controller.peerwatch import PeerWatch

if TYPE_CHECKING:
    from stalwart.controller.job.core import JobCore

ABNORMAL_STATES = ("stopped", "disk-sleep", "tracing-stop")  # a worker stuck by the machine itself
TRACE_TIMEOUT_S = 10.0          # how long to wait for every machine's stacks
SLOW_COMPUTE_RATIO = 1.5        # a rank computing this many times its data-parallel peers is slow
SLOW_STAGE_RATIO = 3.0          # without data-parallel peers: this many times the job's median
BASELINE_N, RECENT_N = 20, 5    # fail-slow: steps of the throughput baseline, and the recent ones
RANK_TIMES_N = 20               # fail-slow: recent steps whose per-rank times a round compares
HISTORY_N = 50                  # loss and grad-norm history kept for the jump rule
JUMPS_KEPT = 20                 # jumps remembered, to tell one a restart reproduces
FAILSLOW_QUIET_S = 30.0         # at most one set of fail-slow rounds per 30 s
# A job this many times slower than its healthy pace whose time went to communication (no rank's
# compute grew alike) is stopped for the stop-time checks: a slow link slows every rank alike and
# only the pair test sees it; a milder drop with nobody to blame becomes the job's pace.
FAILSLOW_CHECK_FACTOR = 5.0
STEADY_SHARE = 0.8              # a fail-slow verdict: flagged in this share of the rounds
# A slow-compute verdict must explain the slowdown: the flagged ranks compute at least this share of
# the step time added since the healthy pace more than their peers (a slow pipeline stage adds its
# extra once per micro-batch, plus the pipeline's fill and drain: a share, not all of it). A rank a
# little slower than its peers while the steps take many times longer (a slow link, a loaded host)
# is not what slowed the job.
EXPLAIN_SHARE = 0.25
COMM_ROUNDS = 2                 # ... in this many rounds in a row (a busy host's stall passes)


# Comparing every machine with its peers is quadratic in the group (pairwise distances): beyond
# this many machines the check runs less often than every heartbeat, never less often than every
# PEER_CHECK_MAX_S (a candidate's run of windows survives gaps of Continuity.grace_s = 10 s). A
# suspect must stay unlike its peers for minutes (similarity_continuity_s), so seconds do not matter.
PEER_CHECK_MACHINES = 256
PEER_CHECK_MAX_S = 5.0


def step_compute(rank_times: list[dict[int, tuple[float | None, float | None]]]) -> float | None:
    """The median over steps of the slowest rank's compute time (SDK timings; None without)."""
    per_step = [max(c for _, c in t.values() if c is not None) for t in rank_times
                if any(c is not None for _, c in t.values())]
    return median(per_step) if per_step else None


def peer_check_period(heartbeat_s: float, machines: int) -> float:
    return max(heartbeat_s, min(heartbeat_s * machines / PEER_CHECK_MACHINES, PEER_CHECK_MAX_S))


class ImplicitFlow:
    def __init__(self, ctx: Ctx, core: "JobCore"):
        self.ctx, self.core = ctx, core

    def new_run(self, st: JobState, now: float) -> None:
        """A run starts: its throughput and peers are judged afresh."""
        p = self.ctx.policy
        stages: dict[int, list[str]] = {}
        for i, m in enumerate(st.slots):
            stages.setdefault(self.ctx.topo.coords(i * self.ctx.G)["pp"], []).append(m)
        old = st.signals
        st.signals = Signals(loss_hist=old.loss_hist, grad_hist=old.grad_hist, step_times=old.step_times,
                             failslow_quiet_until=old.failslow_quiet_until,
                             peerwatch=PeerWatch.create(list(stages.values()), p.heartbeat_s,
                                                        p.similarity_window_s, p.similarity_continuity_s,
                                                        not_before=None),
                             peer_next_check=now + p.heartbeat_s)

    # -- hangs --------------------------------------------------------------------------------
    def check_hang(self, st: JobState, now: float) -> Actions:
        run = st.run
        if run is None or run.hang is None:
            return []
        verdict = run.hang.check(now)
        if verdict is None:
            return []
        acts = self.core.failure.open(st, "hang", now, trace=True)
        if st.incident is not None:
            st.incident.reason = verdict.reason
            st.incident.data["hang"] = {"timeout_s": round(verdict.timeout_s, 3), "calibrated": verdict.calibrated,
                                        "stalled_since": verdict.stalled_since,
                                        "stalled_ranks": sorted(verdict.stalled)}
        return acts

    def on_stacks(self, st: JobState, machine: str, ev: protocol.Stacks, now: float) -> Actions:
        if ev.run != st.run_seq:
            return []
        fs = st.signals.failslow
        if st.phase == JobPhase.RUNNING and fs is not None and machine in fs.wait:
            fs.stacks[machine] = list(ev.records)
            fs.wait.discard(machine)
            return self.failslow_round(st, now) if not fs.wait else []
        inc = st.incident
        if st.phase != JobPhase.TRACING or inc is None:
            return []
        inc.stacks[machine] = list(ev.records)
        inc.trace_wait.discard(machine)
        return self.finish_trace(st, now) if not inc.trace_wait else []

    def trace_tick(self, st: JobState, now: float) -> Actions:
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
        return acts + self.core.failure.stop_run(st, now)

    # -- NaN and jumps ----------------------------------------------------------------------------
    def training_anomaly(self, st: JobState, s: int, acc: PendingStep, now: float) -> Actions | None:
        """NaN/inf or a jump >= loss_jump_factor in loss or grad norm: suspend and open an incident
        (None when the step is fine). The ranks whose LOCAL gradient norm (before the data-parallel
        reduction) is not finite name the machine that corrupted the update."""
        sig = st.signals
        loss, gn = acc.loss, acc.grad_norm
        if loss is None:
            return None
        reason = anomaly(sig.loss_hist + [loss], sig.grad_hist + ([gn] if gn is not None else []) or None,
                         self.ctx.policy.loss_jump_factor)
        if reason is None:
            sig.loss_hist = (sig.loss_hist + [loss])[-HISTORY_N:]
            if gn is not None:
                sig.grad_hist = (sig.grad_hist + [gn])[-HISTORY_N:]
            return None
        local = {r: v for r, v in acc.local.items() if v is not None}
        jumped = gn if gn is not None and "grad norm" in reason else loss
        if jumped is not None and math.isfinite(jumped) and self._reproduced(st, s, jumped):
            # the same jump at the same step after a restart from before it (other machines, or
            # the same ones again): the training's own (its data), not a machine's fault
            sig.loss_hist = (sig.loss_hist + [loss])[-HISTORY_N:]
            if gn is not None:
                sig.grad_hist = (sig.grad_hist + [gn])[-HISTORY_N:]
            return [record("jump_reproduced", now, run=st.run_seq, step=s, reason=reason)]
        culprits = [st.slots[i] for i in culprit_machines(local, self.ctx.topo)] if local else []
        st.bad_steps.append(BadSteps(lo=s, hi=OPEN_END))      # never restore the corrupted state
        # the corrupted steps were no progress: a restart that trains past the NaN again is
        # progress (else independent faults while the job catches up look like a crash loop)
        st.best_steps = min(st.best_steps, s)
        kind = "nan" if "nan" in reason.lower() or "inf" in reason.lower() else "loss_spike"
        acts = self.core.failure.open(st, kind, now)
        if st.incident is not None:
            st.incident.implicit_evict = culprits
            st.incident.reason = reason + (f"; non-finite local gradients on {', '.join(culprits)}"
                                           if culprits else "")
        return acts

    @staticmethod
    def _reproduced(st: JobState, step: int, value: float) -> bool:
        """Whether a jump of `value` at `step` was seen before (within 1%); remembers it if not."""
        if any(s == step and abs(v - value) <= 0.01 * abs(v) for s, v in st.jumps):
            return True
        st.jumps = (st.jumps + [(step, value)])[-JUMPS_KEPT:]
        return False

    # -- a committed step's timings ---------------------------------------------------------------
    def on_committed(self, st: JobState, acc: PendingStep, now: float) -> Actions:
        acts = self._watch_throughput(st, acc)
        self._peer_times(st, acc)
        return acts

    def _watch_throughput(self, st: JobState, acc: PendingStep) -> Actions:
        """Starts fail-slow rounds when throughput drops."""
        sig, dur = st.signals, acc.dur
        sig.rank_times = (sig.rank_times + [dict(acc.times)])[-RANK_TIMES_N:]
        if dur <= 0:
            return []
        sig.step_durs = (sig.step_durs + [dur])[-200:]
        if sig.failslow is not None:
            return []
        sig.failslow_ref_s = healthy_pace(sig.failslow_ref_s, sig.step_durs[:-RECENT_N], BASELINE_N)
        if acc.t < sig.failslow_quiet_until:
            return []
        p = self.ctx.policy
        # never below the drop the policy asks for (failslow_drop 0.99: only a 100x slowdown)
        severe = slowdown_exceeds(sig.step_durs, max(FAILSLOW_CHECK_FACTOR, 1 / (1 - p.failslow_drop)),
                                  RECENT_N, sig.failslow_ref_s)
        if not severe and not throughput_drop(sig.step_durs, baseline_n=BASELINE_N, recent_n=RECENT_N,
                                              drop=p.failslow_drop, reference_s=sig.failslow_ref_s):
            return []
        # a drop this large needs no full baseline: RECENT_N slow steps after RECENT_N fast ones
        base = (baseline_pace(sig.step_durs, BASELINE_N, RECENT_N, sig.failslow_ref_s)
                if len(sig.step_durs) >= BASELINE_N + RECENT_N else
                median(sig.step_durs[-RECENT_N:]) / slowdown(sig.step_durs, RECENT_N, sig.failslow_ref_s))
        sig.failslow = FailSlow(rounds=FailSlowRounds(rounds=p.failslow_rounds), started=acc.t,
                                baseline_s=base, next=acc.t, compute_s=step_compute(sig.rank_times[:-RECENT_N]))
        return [record("failslow_suspected", acc.t, run=st.run_seq, recent_step_s=dur,
                       baseline_s=round(base, 4))]

    def _peer_times(self, st: JobState, acc: PendingStep) -> None:
        """Per-machine mean step and compute time of a committed step (from the SDK reports); the
        watch takes rows once the run has committed its warm-up steps (at least 3)."""
        sig = st.signals
        sig.peer_steps += 1
        if sig.peerwatch is None or sig.peer_steps < max(3, self.ctx.policy.hang_warmup_steps):
            return
        sig.peerwatch.start(acc.t)
        by_m: dict[str, list[tuple[float, float]]] = {}
        for r, (dur, comp) in acc.times.items():
            if dur is not None and comp is not None:
                by_m.setdefault(st.slots[self.ctx.topo.machine_of(int(r))], []).append((dur, comp))
        for m, v in by_m.items():
            sig.peerwatch.add(m, acc.t, {"step_s": sum(x[0] for x in v) / len(v),
                                         "compute_s": sum(x[1] for x in v) / len(v)})

    # -- peer similarity --------------------------------------------------------------------------
    def on_metrics(self, st: JobState, machine: str, ev: protocol.Metrics) -> Actions:
        if st.phase == JobPhase.RUNNING and st.signals.peerwatch is not None:
            st.signals.peerwatch.add(machine, float(ev.t), ev.values or {})
        return []

    def similarity_tick(self, st: JobState, now: float) -> Actions:
        sig, p = st.signals, self.ctx.policy
        if sig.peerwatch is None or now < sig.peer_next_check:
            return []
        sig.peer_next_check = now + peer_check_period(p.heartbeat_s, len(st.slots))
        found, seen = sig.peerwatch.check(now)
        if found is None:
            return []
        suspect = str(found)
        reason = (f"{suspect} stayed unlike its peers {seen['group']} for "
                  f"{p.similarity_continuity_s:.0f}s (metrics {', '.join(seen.get('metrics', []))})")
        if not p.similarity_evict or not self.ctx.ready_standbys(st):
            self.new_run_watch(st, now)          # report once per continuity period, not every tick
            return [record("peer_suspect", now, run=st.run_seq, machine=suspect, reason=reason)]
        acts = self.core.failure.open(st, "peer_outlier", now)
        inc = st.incident
        assert inc is not None
        inc.implicit_evict, inc.reason = [suspect], reason
        inc.data.update(analysis=reason, similarity=seen)
        return acts + [save_data(inc)]

    def new_run_watch(self, st: JobState, now: float) -> None:
        p = self.ctx.policy
        groups = st.signals.peerwatch.groups if st.signals.peerwatch is not None else []
        st.signals.peerwatch = PeerWatch.create(groups, p.heartbeat_s, p.similarity_window_s,
                                                p.similarity_continuity_s, not_before=None)
        st.signals.peer_next_check, st.signals.peer_steps = now + p.heartbeat_s, 0

    # -- fail-slow rounds ---------------------------------------------------------------------------
    def failslow_tick(self, st: JobState, now: float) -> Actions:
        fs = st.signals.failslow
        if fs is None:
            return []
        if fs.wait:
            return self.failslow_round(st, now) if now - fs.sent > TRACE_TIMEOUT_S else []
        if now < fs.next:
            return []
        fs.wait, fs.stacks, fs.sent = set(st.slots), {}, now
        return [TraceStacks(machines=list(st.slots), run=st.run_seq)]

    def _slow_by_compute(self, st: JobState) -> list[int]:
        """Ranks computing slowly over the recent steps (the SDK reports each rank's step time and
        its compute part, before the collectives): against their data-parallel peers, which do the
        same work, or without any, against the job (pipeline stages differ: a wider margin)."""
        topo, world = self.ctx.topo, self.ctx.world
        step: dict[int, float] = {}
        compute: dict[int, float] = {}
        for r in range(world):
            pairs = [(s, c) for t in st.signals.rank_times if r in t
                     for s, c in [t[r]] if s and c is not None]
            if pairs:
                step[r] = trimmed_mean([s for s, _ in pairs])
                compute[r] = min(step[r], trimmed_mean([c for _, c in pairs]))
        st.signals.failslow_compute = {r: round(c, 4) for r, c in compute.items()}
        if len(step) < world:
            return []
        if topo.size("dp") > 1:
            slow = compute_outliers(compute, {r: topo.group("dp", r) for r in compute}, ratio=SLOW_COMPUTE_RATIO)
        else:
            slow = compute_outliers(compute, {r: list(compute) for r in compute}, ratio=SLOW_STAGE_RATIO)
        return sorted(set(slow) | set(slow_ranks(step, {r: step[r] - compute[r] for r in step})))

    def failslow_round(self, st: JobState, now: float) -> Actions:
        fs, p, topo = st.signals.failslow, self.ctx.policy, self.ctx.topo
        assert fs is not None
        # the round's stacks leave the state here (tens of KB of flight records, saved every
        # second until the next round): an incident this round opens keeps them in its data
        fs.wait, round_stacks, fs.stacks = set(), fs.stacks, {}
        stacks, _ = implicit.to_process_stacks(round_stacks, topo, list(st.slots))
        by_stack = set(aggregate(stacks).outliers if stacks else [])
        by_compute = self._slow_by_compute(st)
        outliers = sorted(by_stack | set(by_compute))
        acts: Actions = [record("failslow_round", now, run=st.run_seq, round=fs.done + 1,
                                stack_outliers=sorted(by_stack), slow_ranks=by_compute,
                                compute_s={str(r): c for r, c in st.signals.failslow_compute.items()})]
        # a round whose outliers lie on most of the job points at nobody (a busy host's stacks catch
        # ranks of most machines mid-step): it counts as a round that flags nothing; the machines a
        # round flags count for themselves only when they are a minority of the job
        flagged = {st.slots[i] for i in topo.machines_of(outliers)} if outliers else set()
        job = len(st.slots)
        fs.rounds.add_round(outliers if len(flagged) <= max(1, job // 2) else [], topo, now)
        fs.flagged.append(flagged if len(flagged) <= max(1, (job - 1) // 2) else set())
        fs.by_compute.append({st.slots[i] for i in topo.machines_of(by_compute)})
        fs.done += 1
        fs.next = now + p.failslow_period_s
        fs.comm_rounds = fs.comm_rounds + 1 if self._unexplained(st, fs) is not None else 0
        if fs.comm_rounds >= COMM_ROUNDS:
            # far slower, round after round, and the time went to communication: no rank's
            # compute explains it, and stacks of a job waiting on a slow link are noise (ranks
            # caught mid-step); more rounds will not help, the pair test will
            return acts + self._to_checks(st, fs, round_stacks, now)
        if fs.done < p.failslow_rounds:
            return acts
        machines, why = self._failslow_verdict(st, fs)
        if not machines and fs.done < 2 * p.failslow_rounds and (self._still_slow(st, fs) or fs.by_compute[-1]):
            # no verdict yet, but the job is still slow or a rank still computes slower than its
            # peers (a slowdown near the threshold): the window of rounds slides on
            return acts
        st.signals.failslow = None
        st.signals.failslow_quiet_until = now + FAILSLOW_QUIET_S
        if not machines:
            slow = self._still_slow(st, fs)
            if slow:                  # slower, with nobody to blame: this is the job's pace now
                st.signals.failslow_ref_s = None
            return acts + [record("failslow_cleared", now, run=st.run_seq, rounds=fs.done, still_slow=slow,
                                  why=why)]
        if len(machines) > len(self.ctx.ready_standbys(st)):
            # a slow job still trains: never trade it for a failed one
            return acts + [record("failslow_no_standby", now, run=st.run_seq, machines=machines, why=why)]
        acts += self.core.failure.open(st, "fail_slow", now)
        inc = st.incident
        assert inc is not None
        inc.implicit_evict = machines
        inc.reason = f"throughput dropped; {', '.join(machines)} {why}"
        inc.data.update(stacks=round_stacks, analysis=inc.reason)
        return acts + [save_data(inc)]

    def _unexplained(self, st: JobState, fs: FailSlow) -> float | None:
        """How many times slower than its healthy pace the job runs, when that is at least
        FAILSLOW_CHECK_FACTOR, the time went to communication, not computation, and the stop-time
        checks may run (None otherwise). A busy host slows every rank's computation with its
        collectives (the SDK's compute times grow alike): that is no fault to stop for."""
        factor = slowdown(st.signals.step_durs, RECENT_N, fs.baseline_s)
        if factor < FAILSLOW_CHECK_FACTOR or not self.ctx.policy.stop_time_checks:
            return None
        now = step_compute(st.signals.rank_times[-RECENT_N:])
        if fs.compute_s and now is not None and now / fs.compute_s > factor / 2:
            return None
        return factor

    def _to_checks(self, st: JobState, fs: FailSlow, round_stacks: dict, now: float) -> Actions:
        """Stop the run for the stop-time checks: a slowdown this large with nobody to blame is
        a fault the stacks cannot see (a slow link: every rank waits in the same collective)."""
        factor = self._unexplained(st, fs) or FAILSLOW_CHECK_FACTOR
        recent = median(st.signals.step_durs[-RECENT_N:])
        st.signals.failslow = None
        st.signals.failslow_quiet_until = now + FAILSLOW_QUIET_S
        acts = self.core.failure.open(st, "fail_slow", now)
        inc = st.incident
        if inc is None:
            return acts
        inc.implicit_evict = []
        inc.reason = (f"throughput dropped {factor:.1f}x ({recent:.2f}s a step) and the time went to "
                      f"communication, not to any rank's compute ({fs.comm_rounds} rounds in a row): "
                      f"stop-time checks")
        inc.data.update(stacks=round_stacks, analysis=inc.reason)
        return acts + [save_data(inc)]

    def _failslow_verdict(self, st: JobState, fs: FailSlow) -> tuple[list[str], str]:
        """The machines to evict after the last `failslow_rounds` rounds, and why ([] if none):
        the machines computing slower than their peers in at least 80% of those rounds (a direct
        measurement); else, from the stacks, the most-flagged parallel group when it is at most half
        the job and flagged in at least 80% of the rounds too (a busy host's stacks catch a random
        rank mid-step each round: the most flagged of those is noise), else the machines flagged in
        at least 80% of the rounds (rounds flagging most of the job flag nobody: `failslow_round`)."""
        n, half = self.ctx.policy.failslow_rounds, max(1, self.ctx.spec.machines // 2)
        machines, seen = steady_outliers(fs.by_compute, n, STEADY_SHARE)
        if machines and len(machines) <= half:
            extra, added = self._extra_compute(st, fs, machines)
            if extra < EXPLAIN_SHARE * added:
                return [], (f"{', '.join(machines)} computed slower than its data-parallel peers in {seen} of "
                            f"the last {n} rounds, {extra:.3f}s a step more: too little to explain the "
                            f"{added:.3f}s a step the job slowed by")
            return machines, f"computed slower than its data-parallel peers in {seen} of the last {n} rounds"
        verdict = (fs.rounds.verdict(min_flags=math.ceil(STEADY_SHARE * n - 1e-9))
                   if self.ctx.policy.over_evict else None)
        if verdict and len(verdict[1]) <= half:
            flagged = fs.rounds.flags()[(verdict[0], tuple(verdict[1]))]
            return ([st.slots[i] for i in verdict[1]],
                    f"{verdict[0]} group flagged most often: in {flagged} of the last {n} rounds")
        machines, seen = steady_outliers(fs.flagged, n, STEADY_SHARE)
        return machines, f"flagged in {seen} of the last {n} rounds"

    def _extra_compute(self, st: JobState, fs: FailSlow, machines: list[str]) -> tuple[float, float]:
        """(the most a rank of `machines` computes per step beyond the median of its peers, the
        step time added since the healthy pace), from the last round's per-rank compute."""
        topo, compute = self.ctx.topo, st.signals.failslow_compute
        recent = st.signals.step_durs[-RECENT_N:]
        added = max(0.0, median(recent) - fs.baseline_s) if recent else 0.0
        extra = 0.0
        for m in machines:
            for r in topo.ranks_of_machine(st.slots.index(m)) if m in st.slots else ():
                group = topo.group("dp", r) if topo.size("dp") > 1 else list(compute)
                peers = [compute[q] for q in group if q != r and q in compute]
                if r in compute and peers:
                    extra = max(extra, compute[r] - median(peers))
        return extra, added

    def _still_slow(self, st: JobState, fs: FailSlow) -> bool:
        """Whether the recent steps still run below the throughput seen before the rounds began."""
        recent = st.signals.step_durs[-RECENT_N:]
        return bool(recent) and median(recent) * (1 - self.ctx.policy.failslow_drop) > fs.baseline_s

