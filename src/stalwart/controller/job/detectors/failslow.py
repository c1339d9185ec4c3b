"""Fail-slow: a throughput drop starts rounds (`failslow_period_s` apart) of every machine's
stacks and the SDK's per-rank compute times (`analyzer.failslow`); the machines computing slower
than their data-parallel peers round after round, or the parallel group the stacks flag most, are
evicted, and a large slowdown that went to communication goes to the stop-time checks."""
from __future__ import annotations

import math
from statistics import median

from stalwart import protocol
from stalwart.analyzer.failslow import (FailSlowRounds, baseline_pace, compute_outliers, cpu_slowdown,
                                        healthy_pace, slow_ranks, slowdown, slowdown_exceeds, steady_outliers,
                                        throughput_drop, trimmed_mean)
from stalwart.analyzer.stacks import aggregate
from stalwart.controller.rules import hangstacks as implicit
from stalwart.controller.job.actions import TraceStacks
from stalwart.controller.job.detectors.base import Actions, BaseDetector
from stalwart.controller.job.detectors.hang import TRACE_TIMEOUT_S
from stalwart.controller.job.flows.base import record, save_data
from stalwart.controller.job.state import FailSlow, JobPhase, JobState, PendingStep

SLOW_COMPUTE_RATIO = 1.5        # a rank computing this many times its data-parallel peers is slow
SLOW_STAGE_RATIO = 3.0          # without data-parallel peers: this many times the job's median
BASELINE_N, RECENT_N = 20, 5    # fail-slow: steps of the throughput baseline, and the recent ones
RANK_TIMES_N = 20               # fail-slow: recent steps whose per-rank times a round compares
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


def step_compute(rank_times: list[dict[int, tuple[float | None, float | None]]]) -> float | None:
    """The median over steps of the slowest rank's compute time (SDK timings; None without)."""
    per_step = [max(c for _, c in t.values() if c is not None) for t in rank_times
                if any(c is not None for _, c in t.values())]
    return median(per_step) if per_step else None


class FailSlowDetector(BaseDetector):
    name = "failslow"

    def on_committed(self, st: JobState, acc: PendingStep, now: float) -> Actions:
        return self._watch_throughput(st, acc)

    def observe(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        """A round's stacks from one machine; a machine's `cpu_wait` metric."""
        if isinstance(ev, protocol.Metrics):
            self._cpu_wait(st, machine, ev)
            return []
        fs = st.signals.failslow
        if not isinstance(ev, protocol.Stacks) or ev.run != st.run_seq or st.phase != JobPhase.RUNNING \
                or fs is None or machine not in fs.wait:
            return []
        fs.stacks[machine] = list(ev.records)
        fs.wait.discard(machine)
        return self.failslow_round(st, now) if not fs.wait else []

    def _watch_throughput(self, st: JobState, acc: PendingStep) -> Actions:
        """Starts fail-slow rounds when throughput drops."""
        sig, dur = st.signals, acc.dur
        # (the step's own times, not a copy: a committed step left the pending ones, nothing changes them)
        sig.rank_times = (sig.rank_times + [acc.times])[-RANK_TIMES_N:]
        if dur <= 0:
            return []
        sig.step_durs = (sig.step_durs + [dur])[-200:]
        if sig.failslow is not None:
            sig.failslow.new_steps += 1
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
                                baseline_s=base, next=acc.t, compute_s=step_compute(sig.rank_times[:-RECENT_N]),
                                new_steps=1)
        return [record("failslow_suspected", acc.t, run=st.run_seq, recent_step_s=dur,
                       baseline_s=round(base, 4))]

    def tick(self, st: JobState, now: float) -> Actions:
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
        # (each group's one tuple for all its ranks: `compute_outliers` sorts a group's times once)
        if topo.size("dp") > 1:
            slow = compute_outliers(compute, {r: g for g in topo.groups("dp") for r in g}, ratio=SLOW_COMPUTE_RATIO)
        else:
            everyone = list(compute)
            slow = compute_outliers(compute, dict.fromkeys(compute, everyone), ratio=SLOW_STAGE_RATIO)
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
        # a round without a step since the one before has nothing new to judge (a script saving or
        # evaluating after its last step; a job that stopped is the hang watch's)
        factor = self._unexplained(st, fs) if fs.new_steps else None
        if fs.new_steps:
            fs.comm_rounds = fs.comm_rounds + 1 if factor is not None else 0
        fs.new_steps = 0
        if fs.comm_rounds >= COMM_ROUNDS and factor is not None:
            # far slower, round after round, and the time went to communication: no rank's
            # compute explains it, and stacks of a job waiting on a slow link are noise (ranks
            # caught mid-step); more rounds will not help, the pair test will
            return acts + self._to_checks(st, fs, round_stacks, factor, now)
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
        acts += self.incidents.open(st, "fail_slow", now)
        inc = st.incident
        assert inc is not None
        inc.implicit_evict = machines
        inc.reason = f"throughput dropped; {', '.join(machines)} {why}"
        inc.data.update(stacks=round_stacks, analysis=inc.reason)
        return acts + [save_data(inc)]

    def _cpu_wait(self, st: JobState, machine: str, ev: protocol.Metrics) -> None:
        """Keep a machine's `cpu_wait` and the run's lowest median of them (its healthiest)."""
        wait = (ev.values or {}).get("cpu_wait")
        if machine not in st.slots or not isinstance(wait, (int, float)) or not 0.0 <= wait <= 1.0:
            return
        sig = st.signals
        sig.cpu_wait[machine] = float(wait)
        if len(sig.cpu_wait) == len(st.slots):
            med = median(sig.cpu_wait.values())
            sig.cpu_wait_ref = med if sig.cpu_wait_ref is None else min(sig.cpu_wait_ref, med)

    def _unexplained(self, st: JobState, fs: FailSlow) -> float | None:
        """How many times slower than its healthy pace the job runs, when that is at least
        FAILSLOW_CHECK_FACTOR, the time went to communication, not computation, and the stop-time
        checks may run (None otherwise). A busy host slows every rank's computation with its
        collectives: the SDK's compute times grow alike, and so does the time the ranks wait for a
        CPU (the agents' `cpu_wait`, which a plain script has too); that is no fault to stop for.

        The healthy pace is the one the rounds started from (a median of `BASELINE_N` steps), not
        the fastest `RECENT_N`-step stretch of the last 200 steps: on a busy host that stretch is
        the extreme of the noise, far faster than the steps' usual pace, and a passing stall looked
        five times slower against it. And the slow pace is the median of every step since the
        round before (at least `RECENT_N`): a slow link slows every step, where a host the job
        shares with others slows it in bursts (a 2-core host beside a test suite: steps of 0.05 s
        and of 1.5 s within seconds), and the last few steps before a round may be a burst's."""
        recent = st.signals.step_durs[-max(RECENT_N, fs.new_steps):]
        factor = median(recent) / fs.baseline_s if recent and fs.baseline_s > 0 else 1.0
        if factor < FAILSLOW_CHECK_FACTOR or not self.ctx.policy.stop_time_checks:
            return None
        now = step_compute(st.signals.rank_times[-RECENT_N:])
        if fs.compute_s and now is not None and now / fs.compute_s > factor / 2:
            return None
        sig = st.signals
        waits = [sig.cpu_wait[m] for m in st.slots if m in sig.cpu_wait]
        cpu = cpu_slowdown(sig.cpu_wait_ref, median(waits) if len(waits) == len(st.slots) else None)
        if cpu is not None and cpu > factor / 2:
            return None
        return factor

    def _to_checks(self, st: JobState, fs: FailSlow, round_stacks: dict, factor: float, now: float) -> Actions:
        """Stop the run for the stop-time checks: a slowdown this large (`factor`, from
        `_unexplained`) with nobody to blame is a fault the stacks cannot see (a slow link: every
        rank waits in the same collective)."""
        recent = factor * fs.baseline_s
        st.signals.failslow = None
        st.signals.failslow_quiet_until = now + FAILSLOW_QUIET_S
        acts = self.incidents.open(st, "fail_slow", now)
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

