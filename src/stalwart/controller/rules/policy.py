"""Pure decision rules: what to do about an event, and how to resolve an incident.

Everything here is a function of plain data (a snapshot of the job, the evidence, `now`); nothing
here does I/O. The job core (`controller/job/`) executes the actions, and the cluster simulator drives that
same core, so both take the rules unchanged.

The ladder implemented so far (DESIGN.md "Fault handling"):
- a machine that stopped heart-beating is lost: evict it, hand its ranks to a standby;
- a machine-certain health fault (GPU lost / fatal Xid / DBE ECC, disk fault): evict at once;
- a network alert: evict after `network_alert_count` occurrences within `network_alert_window_s`
  (an occurrence is one underlying event, however many alerts report it: `network_occurrences`),
  or when the condition still stands (a NIC still down) while the job fails for it;
- a Python exception in the job's own code: the incident is `user_code`; fail the run clearly;
- a crash with no certain culprit: reattempt on the same machines;
- no progress across `max_restarts_without_progress` restarts: stop and ask for a human.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from stalwart.protocol import Severity


class Mechanism(enum.StrEnum):
    """How an incident was resolved (a str: stored, reported and exported as its value)."""
    REATTEMPT = "reattempt"            # the same machines again, from the newest checkpoint
    EVICT_RESTART = "evict_restart"    # the culprits evicted, standbys take their ranks
    ROLLBACK = "rollback"              # back to the code version before the last update
    REPLAY = "replay"                  # dual-phase replay found (or cleared) the culprits
    HOT_UPDATE = "hot_update"          # a planned stop for new code, not a fault
    FAIL = "fail"                      # the job stops: a human must look


@dataclass(frozen=True)
class Exit:
    """One worker's unexpected exit, with its classified symptom."""
    machine: str
    rank: int | None
    code: int | None
    signal: int | None
    symptom: str
    category: str = "explicit"
    secondary: bool = False          # a consequence of another failure (e.g. gloo peer reset)
    machine_certain: bool = False
    user_code: bool = False
    detail: str = ""
    t: float = 0.0
    location: str | None = None      # file:line of the innermost frame, for exceptions


@dataclass(frozen=True)
class Alert:
    """A health event from a probe."""
    machine: str
    kind: str
    severity: Severity
    machine_certain: bool
    network: bool = False
    detail: str = ""
    t: float = 0.0
    occurrences: tuple[str, ...] = ()    # ids of the underlying occurrences it reports (probes name them)
    standing: bool = False               # the condition still held when the probe looked

    def occurrence_ids(self) -> tuple[str, ...]:
        """What this alert counts as: the probe's occurrence ids, else the alert itself."""
        return self.occurrences or (f"{self.kind}@{self.t!r}",)


@dataclass(frozen=True)
class Snapshot:
    """What the rules need to know about the job at `now`."""
    active: tuple[str, ...]                    # machines holding ranks, by slot
    standby_ready: tuple[str, ...]             # standbys that can take ranks now
    restarts_without_progress: int = 0
    max_restarts_without_progress: int = 3
    network_alert_count: int = 2
    network_alert_window_s: float = 300.0
    recent_alerts: tuple[Alert, ...] = ()      # alerts of the last window (for network counting)


@dataclass(frozen=True)
class Evidence:
    """Everything collected about one incident by the time its run is stopped."""
    exits: tuple[Exit, ...] = ()
    lost: tuple[str, ...] = ()
    alerts: tuple[Alert, ...] = ()
    implicit_symptom: str | None = None      # hang, nan, ... (found by the analyzer, not a probe)
    implicit_evict: tuple[str, ...] = ()     # machines the analyzer singled out (over-eviction)
    implicit_reason: str = ""
    # machines whose network condition (a NIC down, an interface gone) was still reported while
    # the incident was open: the job failed with it, and waiting for a recurrence is pointless
    standing: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resolution:
    """How an incident is resolved. Frozen: a later rung (checks, replay, rollback) makes a new one
    with `dataclasses.replace`, so a decision is never changed behind its maker's back."""
    symptom: str
    category: str
    cause: str
    suspects: list[str]
    evict: list[str] = field(default_factory=list)
    mechanism: Mechanism = Mechanism.REATTEMPT
    fail_reason: str | None = None
    # every eviction rests on certain evidence (a lost machine, a dead GPU): False when one is a
    # guess (a network alert, the stacks' over-eviction), which a check confirms before the job is
    # failed for want of standbys
    certain: bool = True


def network_occurrences(alerts: Iterable[Alert], machine: str, now: float, window_s: float) -> list[str]:
    """The distinct occurrences behind `machine`'s network alerts within the window, oldest first.

    One flap is one occurrence although the probe reports its down and its carrier change, and a
    NIC that stays down is one although every check reports it again (the probe names each
    occurrence; an alert without names counts as its own)."""
    seen: dict[str, float] = {}
    for a in alerts:
        if a.network and a.machine == machine and now - a.t <= window_s:
            for key in a.occurrence_ids():
                seen[key] = min(seen.get(key, a.t), a.t)
    return sorted(seen, key=lambda k: (seen[k], k))


def standing_since(alerts: Iterable[Alert]) -> dict[str, tuple[float, Alert]]:
    """Per machine, a network occurrence whose latest report says it still stands: when it was
    first reported, and that latest report (the earliest such occurrence per machine)."""
    first: dict[str, float] = {}
    latest: dict[str, Alert] = {}
    for a in sorted((a for a in alerts if a.network), key=lambda a: a.t):
        for key in a.occurrence_ids():
            first.setdefault(key, a.t)
            latest[key] = a
    out: dict[str, tuple[float, Alert]] = {}
    for key, a in latest.items():
        if a.standing and (a.machine not in out or first[key] < out[a.machine][0]):
            out[a.machine] = (first[key], a)
    return out


def should_open_incident(alert: Alert, snap: Snapshot, now: float) -> bool:
    """Does this health alert stop the job right away?"""
    if alert.severity != Severity.FATAL and not alert.network:
        return False
    if alert.machine not in snap.active:
        return False
    if alert.machine_certain and alert.severity == Severity.FATAL:
        return True
    if alert.network:
        found = network_occurrences(snap.recent_alerts + (alert,), alert.machine, now,
                                    snap.network_alert_window_s)
        return len(found) >= snap.network_alert_count
    return False


SILENT_BEATS = 2
# ... plus twice the lateness the host's beats have shown recently, up to this: with short heartbeats
# on a loaded host one agent's beat can come a second late (a slow request, a busy process), and
# that is no reason to evict its machine; on a quiet host two intervals are enough
SILENT_CAP_S = 2.0


def silence_limit(heartbeat_s: float, late_s: float = 0.0, beats: int = SILENT_BEATS) -> float:
    """How long a machine asked to stop may stay silent before it is called lost: `beats`
    heartbeat intervals, longer where beats have come late on this host (one interval plus twice
    the largest recent lateness), but never more than `SILENT_CAP_S` or the `beats` intervals,
    whichever is longer."""
    floor = beats * heartbeat_s
    return min(max(floor, heartbeat_s + 2 * max(late_s, 0.0)), max(floor, SILENT_CAP_S))


def silent_during_stop(awaiting: Iterable[str], last_heard: Mapping[str, float | None], now: float,
                       heartbeat_s: float, late_s: float = 0.0, beats: int = SILENT_BEATS) -> list[str]:
    """Machines asked to stop that have sent nothing for `silence_limit`: lost.

    Outside an incident a machine is lost after `missed_beats` silent intervals; while one is
    open the evidence already points at a failure and every live agent answers the stop at once
    (its heartbeats go on meanwhile), so a shorter silence is enough to act on.
    """
    limit = silence_limit(heartbeat_s, late_s, beats)

    def silent(m: str) -> bool:
        heard = last_heard.get(m)
        return heard is None or now - heard >= limit
    return sorted(m for m in awaiting if silent(m))


def cause_in_hand(planned: bool, exits: tuple[Exit, ...], alerts: tuple[Alert, ...],
                  lost: tuple[str, ...]) -> bool:
    """Can a stopped incident be resolved without waiting for more evidence?

    Yes after a stop the controller chose (a hot update), a lost machine, a worker's own failure
    (not a consequence of a peer's: its agent swept the probes before reporting it) or a fatal
    machine-certain alert (a GPU gone, a full disk). Otherwise only consequences are known so far
    (peers of a dead worker failing in their collectives) and the runner gives the probes a moment.
    """
    return (planned or bool(lost) or any(not e.secondary for e in exits)
            or any(a.severity == Severity.FATAL and a.machine_certain for a in alerts))


def _primary_exits(exits: tuple[Exit, ...]) -> list[Exit]:
    """The exits that are causes, not consequences (earliest first)."""
    primary = [e for e in exits if not e.secondary]
    return sorted(primary or list(exits), key=lambda e: e.t)


def resolve(snap: Snapshot, ev: Evidence, now: float) -> Resolution:
    """Decide suspects, evictions and the recovery mechanism for a stopped incident."""
    evict: list[str] = []
    reasons: list[str] = []
    symptom, category = "worker_crash", "explicit"
    for m in ev.lost:
        if m in snap.active and m not in evict:
            evict.append(m)
            reasons.append(f"machine {m} lost (no heartbeat)")
    if ev.lost:
        symptom = "machine_lost"
    certain = [a for a in ev.alerts if a.severity == Severity.FATAL and a.machine_certain]
    for a in certain:
        if a.machine in snap.active and a.machine not in evict:
            evict.append(a.machine)
            reasons.append(f"{a.kind} on {a.machine}" + (f": {a.detail}" if a.detail else ""))
    if certain and not ev.lost:
        symptom = certain[0].kind
    certain_evict = len(evict)
    for m, kind, why in _network_verdicts(snap, ev, now, explained=bool(evict)):
        if m not in evict:
            evict.append(m)
            reasons.append(why)
            if not ev.lost and not certain:
                symptom = kind
    if ev.implicit_symptom and not evict:
        symptom, category = ev.implicit_symptom, "implicit"
        for m in ev.implicit_evict:
            if m in snap.active and m not in evict:
                evict.append(m)
        reasons.append(ev.implicit_reason or ev.implicit_symptom)
    primary = _primary_exits(ev.exits)
    if not evict and primary and not ev.implicit_symptom:
        first = primary[0]
        symptom, category = first.symptom, first.category
        certain_exits = [e for e in primary if e.machine_certain]
        for e in certain_exits:
            if e.machine not in evict:
                evict.append(e.machine)
        if certain_exits:
            reasons.append(f"{first.symptom} on {certain_exits[0].machine}")
        certain_evict = len(evict)
    sure = len(evict) <= certain_evict
    suspects = list(evict) or sorted({e.machine for e in primary})
    cause = "; ".join(reasons) or _describe_exits(primary) or "unknown"

    if any(e.user_code for e in primary) and not evict:
        return Resolution(symptom="user_code_exception", category="user_code", cause=cause,
                          suspects=suspects, mechanism=Mechanism.FAIL,
                          fail_reason=f"user code raised an exception: {primary[0].detail or cause}"
                                      + (f" (at {primary[0].location})" if primary[0].location else ""))
    if snap.restarts_without_progress >= snap.max_restarts_without_progress:
        return Resolution(symptom=symptom, category=category, cause=cause, suspects=suspects,
                          evict=evict, mechanism=Mechanism.FAIL,
                          fail_reason=f"no progress across {snap.restarts_without_progress} restarts; "
                                      f"last failure: {cause}")
    if evict:
        short = standby_shortfall(evict, len(snap.standby_ready))
        if short is not None:
            return Resolution(symptom=symptom, category=category, cause=cause, suspects=suspects,
                              evict=evict, mechanism=Mechanism.FAIL, fail_reason=short, certain=sure)
        return Resolution(symptom=symptom, category=category, cause=cause, suspects=suspects,
                          evict=evict, mechanism=Mechanism.EVICT_RESTART, certain=sure)
    return Resolution(symptom=symptom, category=category, cause=cause, suspects=suspects,
                      mechanism=Mechanism.REATTEMPT)


def _network_verdicts(snap: Snapshot, ev: Evidence, now: float,
                      explained: bool) -> list[tuple[str, str, str]]:
    """(machine, alert kind, why) for each active machine its network alerts condemn: its alerts
    recurred (`network_alert_count` occurrences within the window), or, when nothing certain
    explains the failure, its condition still stood while the incident was open."""
    out = []
    for m in snap.active:
        mine = [a for a in ev.alerts if a.network and a.machine == m]
        if not mine:
            continue
        found = network_occurrences(mine, m, now, snap.network_alert_window_s)
        kinds = sorted({a.kind for a in mine})
        if len(found) >= snap.network_alert_count:
            out.append((m, mine[-1].kind, f"{'/'.join(kinds)} on {m}: {len(found)} occurrences within "
                                          f"{snap.network_alert_window_s:.0f}s"))
        elif m in ev.standing and not explained:
            kind = next(a.kind for a in reversed(mine) if a.standing)
            out.append((m, kind, f"{kind} on {m} still standing when the run stopped making progress"))
    return out


def describe_exit(rank: int | None, machine: str, code: int | None, signal: int | None,
                  detail: str = "") -> str:
    """One worker's exit in words: "rank 3 on m1 killed by SIGKILL (...)"."""
    how = "killed by SIGKILL" if signal == 9 else f"killed by signal {signal}" if signal else \
        "failed with an exception" if code is None else f"exit code {code}"
    who = f"rank {rank}" if rank is not None else "a worker"
    return f"{who} on {machine} {how}" + (f" ({detail})" if detail else "")


def _describe_exits(exits: list[Exit]) -> str:
    return "; ".join(describe_exit(e.rank, e.machine, e.code, e.signal, e.detail) for e in exits[:3])


def standby_shortfall(evict: list[str], standby_ready: int) -> str | None:
    """The one rule for evicting more machines than there are ready standbys: why it cannot be
    done now (None when it can). Callers confirm an uncertain guess with a stop-time check
    first, and fail only when machines that certainly are broken outnumber the standbys."""
    if len(evict) <= standby_ready:
        return None
    return (f"{len(evict)} machine(s) evicted ({', '.join(evict)}) but only {standby_ready} "
            f"standby machine(s) ready; add standbys with --standby N")
