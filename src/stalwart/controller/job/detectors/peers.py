"""Peer similarity: a machine whose metrics (worker metrics, step and compute times) stay unlike
its peers' past the continuity window is a suspect (`peerwatch`, Minder's rule); reported, and
evicted when the policy allows and a standby is ready."""
from __future__ import annotations

from itertools import chain

import numpy as np

from stalwart import protocol
from stalwart.controller.job.detectors.base import Actions, BaseDetector
from stalwart.controller.job.flows.base import record, save_data
from stalwart.controller.job.state import JobPhase, JobState, PendingStep
from stalwart.controller.rules.peerwatch import PeerWatch

# Comparing every machine with its peers is quadratic in the group (pairwise distances): beyond
# this many machines the check runs less often than every heartbeat, never less often than every
# PEER_CHECK_MAX_S (a candidate's run of windows survives gaps of Continuity.grace_s = 10 s). A
# suspect must stay unlike its peers for minutes (similarity_continuity_s), so seconds do not matter.
PEER_CHECK_MACHINES = 256
PEER_CHECK_MAX_S = 5.0


def peer_check_period(heartbeat_s: float, machines: int) -> float:
    return max(heartbeat_s, min(heartbeat_s * machines / PEER_CHECK_MACHINES, PEER_CHECK_MAX_S))


class PeerDetector(BaseDetector):
    name = "peers"

    def new_run(self, st: JobState, now: float) -> None:
        """A run starts: its peers are judged afresh, machine by machine within a pipeline stage."""
        p = self.ctx.policy
        stages: dict[int, list[str]] = {}
        of, G = self.ctx.stages, self.ctx.G
        for i, m in enumerate(st.slots):
            stages.setdefault(of[i * G], []).append(m)
        st.signals.peerwatch = PeerWatch.create(list(stages.values()), p.heartbeat_s, p.similarity_window_s,
                                                p.similarity_continuity_s, not_before=None)
        st.signals.peer_next_check = now + p.heartbeat_s

    def observe(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        if isinstance(ev, protocol.Metrics) and st.phase == JobPhase.RUNNING and st.signals.peerwatch is not None:
            st.signals.peerwatch.add(machine, float(ev.t), ev.values or {})
        return []

    def on_committed(self, st: JobState, acc: PendingStep, now: float) -> Actions:
        """Per-machine mean step and compute time of a committed step (from the SDK reports); the
        watch takes rows once the run has committed its warm-up steps (at least 3)."""
        sig = st.signals
        sig.peer_steps += 1
        if sig.peerwatch is None or sig.peer_steps < max(3, self.ctx.policy.hang_warmup_steps):
            return []
        sig.peerwatch.start(acc.t)
        if not acc.timed:           # (no rank's compute time: no machine has a row to add)
            return []
        if not self._add_columns(st, acc):
            by_m: dict[str, list[tuple[float, float]]] = {}
            for r, (dur, comp) in acc.times.items():
                if dur is not None and comp is not None:
                    by_m.setdefault(st.slots[self.ctx.topo.machine_of(int(r))], []).append((dur, comp))
            for m, v in by_m.items():
                sig.peerwatch.add(m, acc.t, {"step_s": sum(x[0] for x in v) / len(v),
                                             "compute_s": sum(x[1] for x in v) / len(v)})
        return []

    def _add_columns(self, st: JobState, acc: PendingStep) -> bool:
        """The step's per-machine means as whole columns, when every rank reported both times
        and every rank is the job's (else False: the caller takes them rank by rank). The same
        sums in the same order as rank by rank; a 100,000-rank step's are 10 ms, where rank by
        rank they were 80 ms, and a watched slowdown reports every step."""
        times, G = acc.times, self.ctx.G
        n = len(times)
        try:
            both = np.fromiter(chain.from_iterable(times.values()), float, 2 * n)
        except TypeError:           # a time that is None
            return False
        ranks = np.fromiter(times, np.int64, n)
        if n == 0 or ranks.min() < 0 or ranks.max() >= self.ctx.world:
            return False
        machine = ranks // G
        machines = len(st.slots)
        count = np.bincount(machine, minlength=machines)
        has = np.flatnonzero(count)
        step_s = np.bincount(machine, weights=both[0::2], minlength=machines)[has] / count[has]
        compute_s = np.bincount(machine, weights=both[1::2], minlength=machines)[has] / count[has]
        watch = st.signals.peerwatch
        assert watch is not None
        watch.add_columns([st.slots[i] for i in has.tolist()], acc.t, {"step_s": step_s, "compute_s": compute_s})
        return True

    def tick(self, st: JobState, now: float) -> Actions:
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
            self.restart_watch(st, now)          # report once per continuity period, not every tick
            return [record("peer_suspect", now, run=st.run_seq, machine=suspect, reason=reason)]
        acts = self.incidents.open(st, "peer_outlier", now)
        inc = st.incident
        assert inc is not None
        inc.implicit_evict, inc.reason = [suspect], reason
        inc.data.update(analysis=reason, similarity=seen)
        return acts + [save_data(inc)]

    def restart_watch(self, st: JobState, now: float) -> None:
        """Start the watch over (same groups): a suspect is reported once per continuity period."""
        p = self.ctx.policy
        groups = st.signals.peerwatch.groups if st.signals.peerwatch is not None else []
        st.signals.peerwatch = PeerWatch.create(groups, p.heartbeat_s, p.similarity_window_s,
                                                p.similarity_continuity_s, not_before=None)
        st.signals.peer_next_check, st.signals.peer_steps = now + p.heartbeat_s, 0
