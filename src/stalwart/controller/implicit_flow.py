"""Implicit failures in the job runner: hangs (stacks from every machine) and training anomalies.

A mixin of `JobRunner` (jobs.py): the pure parts are `hangwatch` (calibrated timeouts, anomaly
rules) and `implicit` (stack aggregation to an eviction); this is the part that talks to agents.
"""
from __future__ import annotations

import math
import time
from statistics import median

from stalwart.analyzer.failslow import (FailSlowRounds, baseline_pace, compute_outliers, healthy_pace,
                                        slow_ranks, steady_outliers, throughput_drop, trimmed_mean)
from stalwart.analyzer.stacks import aggregate
from stalwart.controller import implicit
from stalwart.controller.hangwatch import anomaly, culprit_machines
from stalwart.controller.peerwatch import PeerWatch

ABNORMAL_STATES = ("stopped", "disk-sleep", "tracing-stop")  # a worker stuck by the machine itself
TRACE_TIMEOUT_S = 10.0          # how long to wait for every machine's stacks
SLOW_COMPUTE_RATIO = 1.5        # a rank computing this many times its data-parallel peers is slow
SLOW_STAGE_RATIO = 3.0          # without data-parallel peers: this many times the job's median
BASELINE_N, RECENT_N = 20, 5    # fail-slow: steps of the throughput baseline, and the recent ones
RANK_TIMES_N = 20               # fail-slow: recent steps whose per-rank times a round compares


class ImplicitFlow:
    # -- peer similarity: a machine that stays unlike its peers ----------------------------------
    def _new_peerwatch(self, now: float) -> None:
        p = self.spec.policy
        stages: dict[int, list[str]] = {}
        for i, m in enumerate(self.slots):
            stages.setdefault(self.topo.coords(i * self.G)["pp"], []).append(m)
        self.peerwatch = PeerWatch(list(stages.values()), p.heartbeat_s, p.similarity_window_s,
                                   p.similarity_continuity_s, not_before=math.inf)
        self.peer_next_check = now + p.heartbeat_s
        self.peer_steps = 0

    def _agent_metrics(self, machine: str, ev: dict) -> None:
        if self.state == "running" and getattr(self, "peerwatch", None) is not None:
            self.peerwatch.add(machine, float(ev["t"]), ev.get("values") or {})

    def _peer_times(self, t: float, times: dict) -> None:
        """Per-machine mean step and compute time of a committed step (from the SDK reports).

        The watch starts taking rows once the run has committed its warm-up steps
        (`policy.hang_warmup_steps`, at least 3)."""
        self.peer_steps += 1
        if self.peer_steps < max(3, self.spec.policy.hang_warmup_steps):
            return
        self.peerwatch.start(t)
        by_m: dict[str, list] = {}
        for r, (dur, comp) in times.items():
            if dur is not None and comp is not None:
                by_m.setdefault(self.slots[self.topo.machine_of(int(r))], []).append((dur, comp))
        for m, v in by_m.items():
            self.peerwatch.add(m, t, {"step_s": sum(x[0] for x in v) / len(v),
                                      "compute_s": sum(x[1] for x in v) / len(v)})

    def _similarity_tick(self, now: float) -> None:
        if now < self.peer_next_check:
            return
        self.peer_next_check = now + self.spec.policy.heartbeat_s
        suspect, seen = self.peerwatch.check(now)
        if suspect is None:
            return
        reason = (f"{suspect} stayed unlike its peers {seen['group']} for "
                  f"{self.spec.policy.similarity_continuity_s:.0f}s (metrics {', '.join(seen.get('metrics', []))})")
        if not self.spec.policy.similarity_evict or not self._snapshot().standby_ready:
            self.event("peer_suspect", {"run": self.run_seq, "machine": suspect, "reason": reason})
            self._new_peerwatch(now)           # report once per continuity period, not every tick
            return
        self._open_incident("peer_outlier", now)
        self.incident.update(implicit_evict=[suspect], reason=reason)
        self.store.update_incident(self.incident["id"], data={"analysis": reason, "similarity": seen})

    # -- fail-slow: throughput decline -> repeated stack aggregation -> the most-flagged machines
    def _watch_throughput(self, dur: float, now: float, times: dict) -> None:
        """Called per committed step; starts fail-slow rounds when throughput drops."""
        self.rank_times = (self.rank_times + [times])[-RANK_TIMES_N:]
        if dur <= 0:
            return
        self.step_durs = (self.step_durs + [dur])[-200:]
        if self.failslow is not None:
            return
        self.failslow_ref_s = healthy_pace(self.failslow_ref_s, self.step_durs[:-RECENT_N], BASELINE_N)
        if now < self.failslow_quiet_until:
            return
        p = self.spec.policy
        if throughput_drop(self.step_durs, baseline_n=BASELINE_N, recent_n=RECENT_N, drop=p.failslow_drop,
                           reference_s=self.failslow_ref_s):
            self.failslow = {"rounds": FailSlowRounds(rounds=p.failslow_rounds), "flagged": [],
                             "by_compute": [], "done": 0, "next": now, "wait": set(), "stacks": {},
                             "started": now, "baseline_s": baseline_pace(self.step_durs, BASELINE_N,
                                                                         RECENT_N, self.failslow_ref_s)}
            self.event("failslow_suspected", {"run": self.run_seq, "recent_step_s": dur,
                                              "baseline_s": round(self.failslow["baseline_s"], 4)})

    def _failslow_tick(self, now: float) -> None:
        fs = self.failslow
        if fs["wait"]:
            if now - fs["sent"] > TRACE_TIMEOUT_S:
                self._failslow_round(now)
            return
        if now >= fs["next"]:
            fs.update(wait=set(self.slots), stacks={}, sent=now)
            for m in self.slots:
                self.ctl.send(m, {"type": "trace", "run": self.run_seq})

    def _slow_by_compute(self) -> list[int]:
        """Ranks computing slowly, over the recent steps (the SDK reports each rank's step time and
        its compute part, before the collectives): against their data-parallel peers, which do the
        same work, or without any, against the job (pipeline stages differ: a wider margin)."""
        step, compute = {}, {}
        for r in range(self.world):
            pairs = [t[r] for t in self.rank_times if r in t and t[r][0] and t[r][1] is not None]
            if pairs:
                step[r] = trimmed_mean([p[0] for p in pairs])
                compute[r] = min(step[r], trimmed_mean([p[1] for p in pairs]))
        self.failslow_compute = {r: round(c, 4) for r, c in compute.items()}
        if len(step) < self.world:
            return []
        if self.topo.size("dp") > 1:
            slow = compute_outliers(compute, {r: self.topo.group("dp", r) for r in compute},
                                    ratio=SLOW_COMPUTE_RATIO)
        else:
            slow = compute_outliers(compute, {r: list(compute) for r in compute}, ratio=SLOW_STAGE_RATIO)
        return sorted(set(slow) | set(slow_ranks(step, {r: step[r] - compute[r] for r in step})))

    def _failslow_round(self, now: float) -> None:
        fs = self.failslow
        fs["wait"] = set()
        stacks, _ = implicit.to_process_stacks(fs["stacks"], self.topo, list(self.slots))
        by_stack = set(aggregate(stacks).outliers if stacks else [])
        by_compute = self._slow_by_compute()
        outliers = sorted(by_stack | set(by_compute))
        self.event("failslow_round", {"run": self.run_seq, "round": fs["done"] + 1,
                                      "stack_outliers": sorted(by_stack), "slow_ranks": by_compute,
                                      "compute_s": getattr(self, "failslow_compute", {})})
        fs["rounds"].add_round(outliers, self.topo, now)
        fs["flagged"].append({self.slots[i] for i in self.topo.machines_of(outliers)} if outliers else set())
        fs["by_compute"].append({self.slots[i] for i in self.topo.machines_of(by_compute)})
        fs["done"] += 1
        fs["next"] = now + self.spec.policy.failslow_period_s
        p = self.spec.policy
        if fs["done"] < p.failslow_rounds:
            return
        machines, why = self._failslow_verdict(fs)
        if not machines and fs["done"] < 2 * p.failslow_rounds and \
                (self._still_slow(fs) or fs["by_compute"][-1]):
            # no verdict yet, but the job is still slow or a rank still computes slower than its
            # peers (a slowdown near the threshold): the window of rounds slides on
            return
        self.failslow = None
        self.failslow_quiet_until = now + 30.0     # at most one set of rounds per 30 s
        if not machines:
            slow = self._still_slow(fs)
            if slow:                  # slower, with nobody to blame: this is the job's pace now
                self.failslow_ref_s = None
            self.event("failslow_cleared", {"run": self.run_seq, "rounds": fs["done"], "still_slow": slow})
            return
        if len(machines) > len(self._snapshot().standby_ready):
            # a slow job still trains: never trade it for a failed one
            self.event("failslow_no_standby", {"run": self.run_seq, "machines": machines, "why": why})
            return
        self._open_incident("fail_slow", now)
        self.incident.update(implicit_evict=machines, reason=f"throughput dropped; {', '.join(machines)} "
                                                              f"{why}")
        self.store.update_incident(self.incident["id"], data={"stacks": fs["stacks"],
                                                              "analysis": self.incident["reason"]})

    def _failslow_verdict(self, fs: dict) -> tuple[list[str], str]:
        """The machines to evict after the last `failslow_rounds` rounds, and why ([] if none):
        the machines computing slower than their peers in at least 80% of those rounds (a direct
        measurement); else, from the stacks, the most-flagged parallel group when it is at most half
        the job, else the machines flagged in at least 80% of the rounds."""
        n, half = self.spec.policy.failslow_rounds, max(1, self.spec.machines // 2)
        machines, seen = steady_outliers(fs["by_compute"], n)
        if machines and len(machines) <= half:
            return machines, f"computed slower than its data-parallel peers in {seen} of the last {n} rounds"
        verdict = fs["rounds"].verdict()
        if verdict and len(verdict[1]) <= half:
            return [self.slots[i] for i in verdict[1]], f"{verdict[0]} group flagged most often over {n} rounds"
        machines, seen = steady_outliers(fs["flagged"], n)
        return machines, f"flagged in {seen} of the last {n} rounds"

    def _still_slow(self, fs: dict) -> bool:
        """Whether the recent steps still run below the throughput seen before the rounds began."""
        recent = self.step_durs[-RECENT_N:]
        return bool(recent) and median(recent) * (1 - self.spec.policy.failslow_drop) > fs["baseline_s"]

    def _training_anomaly(self, s: int, acc: dict) -> bool:
        """NaN/inf or a jump >= loss_jump_factor in loss or grad norm: suspend and open an incident.
        The ranks whose LOCAL gradient norm (before the data-parallel reduction) is not finite
        name the machine that corrupted the update."""
        loss, gn = acc.get("loss"), acc.get("grad_norm")
        if loss is None:
            return False
        reason = anomaly(self.loss_hist + [loss], self.grad_hist + ([gn] if gn is not None else []) or None,
                         self.spec.policy.loss_jump_factor)
        if reason is None:
            self.loss_hist = (self.loss_hist + [loss])[-50:]
            if gn is not None:
                self.grad_hist = (self.grad_hist + [gn])[-50:]
            return False
        local = {r: v for r, v in acc.get("local", {}).items() if v is not None}
        culprits = [self.slots[i] for i in culprit_machines(local, self.topo)] if local else []
        self.bad_steps.update(range(s, s + 10_000))        # never restore the corrupted state
        self._open_incident("nan" if "nan" in reason.lower() or "inf" in reason.lower()
                            else "loss_spike", acc["t"])
        self.incident.update(implicit_evict=culprits, reason=reason + (
            f"; non-finite local gradients on {', '.join(culprits)}" if culprits else ""))
        return True

    def _agent_stacks(self, machine: str, ev: dict) -> None:
        if ev.get("run") != self.run_seq:
            return
        fs = self.failslow
        if self.state == "running" and fs is not None and machine in fs["wait"]:
            fs["stacks"][machine] = ev.get("records", [])
            fs["wait"].discard(machine)
            if not fs["wait"]:
                self._failslow_round(time.time())
            return
        if self.state != "tracing":
            return
        self.incident["stacks"][machine] = ev.get("records", [])
        self.incident["trace_wait"].discard(machine)
        if not self.incident["trace_wait"]:
            self._finish_trace(time.time())

    def _finish_trace(self, now: float) -> None:
        """Stacks are in: single out the stuck machines (a stopped/frozen worker names its machine
        outright; otherwise group the stacks and over-evict the outliers' parallel group)."""
        inc = self.incident
        stacks = inc["stacks"]
        odd = sorted({rec["rank"] for recs in stacks.values() for rec in recs
                      if rec.get("role") == "worker" and rec.get("status") in ABNORMAL_STATES})
        if odd:
            machines = [self.slots[i] for i in self.topo.machines_of(odd)]
            reason = f"rank(s) {odd} stopped or frozen on {', '.join(machines)}"
        elif stacks:
            d = implicit.decide_hang(stacks, self.topo, list(self.slots))
            machines, reason = list(d.machines), d.reason
        else:
            machines, reason = [], "no machine answered the stack capture"
        inc.update(implicit_evict=machines, reason=f"{inc.get('reason', 'hang')}; {reason}")
        self.store.update_incident(inc["id"], data={"stacks": stacks, "analysis": inc["reason"]})
        self.event("incident_traced", {"incident": inc["id"], "machines": machines}, t=now)
        self._stop_run(now)

