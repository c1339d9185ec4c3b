"""The typed live state of one job: everything its flows decide from, saved at each transition.

`JobState` round-trips through JSON exactly (`dumps` / `loads`), so a restarted controller loads
the state its predecessor saved and carries on. The job's phase and each incident's phase are
Enums; the allowed transitions are written down once, here, and `JobState.move` / `Incident.move`
refuse any other (a bug, not a user error).

Phases of a job (`JobPhase`):

    waiting ──► running ──► succeeded
                 │  ▲ ▲
                 │  │ └────────────────────────────────┐
                 ▼  │                                  │
              tracing ─► recovering ─► diagnosing ─► replaying
                 (stacks)   (stopping)   (checks)      (groups)
    any non-terminal phase ──► failed | cancelled

Phases of an incident (`IncidentPhase`): detected → (tracing) → stopping → localizing →
restarting (its new run has not completed a step yet) → resolved; or → failed (the job failed on it).
"""
from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from stalwart import protocol
from stalwart.analyzer.failslow import FailSlowRounds
from stalwart.analyzer.replay import ReplayPlan
from stalwart.analyzer.links import LinkWatch
from stalwart.analyzer.traces import TraceWatch
from stalwart.controller.rules.hangwatch import HangWatch
from stalwart.controller.rules.peerwatch import PeerWatch
from stalwart.controller.rules.policy import Alert, Exit, Mechanism, Resolution
from stalwart.controller.rules.restore import Availability
from stalwart.controller.rules.scriptsteps import ScriptRun
from stalwart.errors import StalwartError


class JobPhase(str, enum.Enum):
    WAITING = "waiting"            # for enough free machines
    RUNNING = "running"            # a run trains
    TRACING = "tracing"            # a hang: capturing every machine's stacks before the stop
    RECOVERING = "recovering"      # the run is being stopped; then localize and restart
    DIAGNOSING = "diagnosing"      # stop-time checks on every machine
    REPLAYING = "replaying"        # dual-phase replay groups run
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED)


_END = {JobPhase.FAILED, JobPhase.CANCELLED}
_ENDED = frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED})
JOB_TRANSITIONS: dict[JobPhase, set[JobPhase]] = {
    JobPhase.WAITING: {JobPhase.RUNNING} | _END,
    JobPhase.RUNNING: {JobPhase.TRACING, JobPhase.RECOVERING, JobPhase.SUCCEEDED} | _END,
    JobPhase.TRACING: {JobPhase.RECOVERING} | _END,
    JobPhase.RECOVERING: {JobPhase.RUNNING, JobPhase.DIAGNOSING} | _END,
    JobPhase.DIAGNOSING: {JobPhase.RUNNING, JobPhase.REPLAYING} | _END,
    JobPhase.REPLAYING: {JobPhase.RUNNING} | _END,
    JobPhase.SUCCEEDED: set(),
    JobPhase.FAILED: set(),
    JobPhase.CANCELLED: set(),
}


class IncidentPhase(str, enum.Enum):
    DETECTED = "detected"
    TRACING = "tracing"
    STOPPING = "stopping"
    LOCALIZING = "localizing"      # stop-time checks or replay
    RESTARTING = "restarting"      # localized; the new run has not completed a step yet
    RESOLVED = "resolved"
    FAILED = "failed"


INCIDENT_TRANSITIONS: dict[IncidentPhase, set[IncidentPhase]] = {
    IncidentPhase.DETECTED: {IncidentPhase.TRACING, IncidentPhase.STOPPING, IncidentPhase.FAILED},
    IncidentPhase.TRACING: {IncidentPhase.STOPPING, IncidentPhase.FAILED},
    IncidentPhase.STOPPING: {IncidentPhase.LOCALIZING, IncidentPhase.RESTARTING, IncidentPhase.FAILED},
    IncidentPhase.LOCALIZING: {IncidentPhase.RESTARTING, IncidentPhase.FAILED},
    IncidentPhase.RESTARTING: {IncidentPhase.RESOLVED, IncidentPhase.FAILED},
    IncidentPhase.RESOLVED: set(),
    IncidentPhase.FAILED: set(),
}


class TransitionError(StalwartError, RuntimeError):
    """A flow asked for a transition the tables above do not allow: a bug in the flow."""


@dataclass
class PendingStep:
    """A step some ranks have reported and others not yet."""
    ranks: set[int] = field(default_factory=set)
    t: float = 0.0
    dur: float = 0.0
    loss: float | None = None
    grad_norm: float | None = None
    tokens: int | None = None
    local: dict[int, float | None] = field(default_factory=dict)       # local grad norms
    times: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)  # (step, compute)
    timed: bool = False         # some rank reported its compute time (else `times` has none to read)


@dataclass
class RunState:
    """One uninterrupted stretch of training (or of a replay group)."""
    seq: int
    started_at: float
    start_step: int
    restore_step: int
    machines: list[str]
    committed: int = 0                           # steps this run completed
    last_committed: int = -1                     # the highest of them (a report of one is a duplicate)
    pending: dict[int, PendingStep] = field(default_factory=dict)
    done_ranks: set[int] = field(default_factory=set)
    restore_tiers: dict[int, str] = field(default_factory=dict)
    restore_skipped: dict[int, list[str]] = field(default_factory=dict)
    hang: HangWatch | None = None
    # the workers' start-up as their SDK tells it (hello): ranks heard, latest import/ready times
    hello_ranks: set[int] = field(default_factory=set)
    imported_at: float = 0.0
    ready_at: float = 0.0
    # a plain script's steps as its ranks' step hooks report them (controller/rules/scriptsteps.py)
    script: ScriptRun = field(default_factory=ScriptRun)

    def finished(self, rank: int) -> None:
        """Rank `rank`'s worker finished (exit 0, or the SDK's done): counted, and never stalled."""
        self.done_ranks.add(rank)
        if self.hang is not None:
            self.hang.on_done(rank)


@dataclass
class Incident:
    """The open incident: its evidence, what was decided, where it stands."""
    seq: int
    symptom: str
    detected_at: float
    phase: IncidentPhase = IncidentPhase.DETECTED
    implicit: bool = False
    planned: bool = False                        # a hot update: a stop the controller chose
    run: int | None = None
    stop_sent: float | None = None
    exits: list[Exit] = field(default_factory=list)
    lost: set[str] = field(default_factory=set)
    alerts: list[Alert] = field(default_factory=list)
    awaiting: set[str] = field(default_factory=set)      # machines asked to stop, not stopped yet
    trace_wait: set[str] = field(default_factory=set)
    trace_sent: float | None = None
    stacks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    implicit_evict: list[str] = field(default_factory=list)
    reason: str = ""
    confirm: bool = False                        # evictions wait for a stop-time check
    data: dict[str, Any] = field(default_factory=dict)   # the incident row's data (analysis, checks)
    resolution: Resolution | None = None

    def move(self, to: IncidentPhase) -> None:
        if to == self.phase:
            return
        if to not in INCIDENT_TRANSITIONS[self.phase]:
            raise TransitionError(f"incident {self.seq}: {self.phase.value} -> {to.value} is not allowed")
        self.phase = to


@dataclass
class PastIncident:
    """What the ladder and the rollback rule read of earlier incidents."""
    id: int
    detected_at: float
    symptom: str
    category: str
    mechanism: Mechanism | None
    evicted: list[str]
    cause: str | None


@dataclass
class Diagnosis:
    """Stop-time checks in progress: `ring` the machines of the pair test in ring order (none
    without it), `answers` each machine's result rows as its agent sent them."""
    name: str
    checks: list[str]
    wait: set[str]
    started: float
    deadline: float
    ring: list[str] = field(default_factory=list)
    answers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass
class ReplayGroup:
    group: int
    machines: list[str]
    world: int
    done: set[int] = field(default_factory=set)
    failed: str | None = None


@dataclass
class Replay:
    """A dual-phase replay in progress (run seq -> group of the current phase)."""
    name: str
    plan: ReplayPlan
    started: float
    deadline: float
    phase: int = 0
    failed: list[list[int]] = field(default_factory=lambda: [[], []])
    groups: dict[int, ReplayGroup] = field(default_factory=dict)
    running: int = -1           # groups of the phase still running (-1: not counted yet)

    def still_running(self) -> int:
        """How many groups of the phase neither finished nor failed (counted once, then kept
        by `group_ended`: a phase of thousands of groups ends one group at a time)."""
        if self.running < 0:
            self.running = sum(1 for g in self.groups.values() if g.failed is None and len(g.done) < g.world)
        return self.running

    def group_ended(self) -> None:
        """A running group of the phase finished or failed (already marked so)."""
        if self.running < 0:
            self.still_running()        # (counts the others: this one is no longer running)
        else:
            self.running -= 1


@dataclass
class FailSlow:
    """Fail-slow rounds in progress."""
    rounds: FailSlowRounds
    started: float
    baseline_s: float
    next: float
    done: int = 0
    flagged: list[set[str]] = field(default_factory=list)
    by_compute: list[set[str]] = field(default_factory=list)
    wait: set[str] = field(default_factory=set)
    sent: float = 0.0
    stacks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    compute_s: float | None = None       # the slowest rank's compute per step before the drop (SDK)
    comm_rounds: int = 0                 # rounds in a row that found the time gone to communication
    new_steps: int = 0                   # steps the rounds have not judged yet


@dataclass
class Signals:
    """Rolling training signals of the current run (NaN/jump, throughput, peers, traces)."""
    loss_hist: list[float] = field(default_factory=list)
    grad_hist: list[float] = field(default_factory=list)
    step_durs: list[float] = field(default_factory=list)
    rank_times: list[dict[int, tuple[float | None, float | None]]] = field(default_factory=list)
    failslow: FailSlow | None = None
    failslow_quiet_until: float = 0.0
    failslow_ref_s: float | None = None
    failslow_compute: dict[int, float] = field(default_factory=dict)
    cpu_wait: dict[str, float] = field(default_factory=dict)   # machine -> its latest `cpu_wait` metric
    cpu_wait_ref: float | None = None     # the lowest median `cpu_wait` over the machines seen this run
    peerwatch: PeerWatch | None = None
    peer_next_check: float = 0.0
    peer_steps: int = 0
    traces: TraceWatch | None = None          # the trace detector's windows and model
    links: LinkWatch | None = None            # the link detector's pairs and model
    step_times: list[tuple[float, int]] = field(default_factory=list)   # (t, step) for steps/s
    committed_at: float = 0.0     # when this controller committed the run's last step (its clock)


OPEN_END = 2 ** 62      # the end of a bad range no run has closed yet


@dataclass
class BadSteps:
    """Checkpoint copies of steps [lo, hi) that must not be restored: the state after a NaN or a
    jump (hi open until the restart), or a step whose copy failed its checksum. The step numbers
    are reused: the run restored from before `lo` writes good copies of the same steps. So the
    restart closes the range at the newest copy then held, and it lapses once a later run
    committed step `until` (its own copies replaced the bad ones in every tier)."""
    lo: int
    hi: int
    until: int | None = None       # None: open (no run has started since)


@dataclass
class HotUpdatePrep:
    """Spare workers warming up on a coming code version."""
    version: int
    path: str
    sent: float
    run: int
    ready: set[str] = field(default_factory=set)


@dataclass
class Pool:
    """The job's warm standby machines."""
    standby: list[str] = field(default_factory=list)
    warm: set[str] = field(default_factory=set)       # standbys whose workers are pre-spawned
    ready: dict[str, list[int]] = field(default_factory=dict)   # their workers waiting at the barrier
    next_refill: float = 0.0
    next_request: float = 0.0     # when the pool may next ask the cluster for machines


@dataclass
class ChaosPlan:
    """A fault injection waiting for its step."""
    kind: str
    machine: int
    rank: int | None
    step: int | None
    params: dict[str, Any]


@dataclass
class ControlPlaneGap:
    """A controller's absence: from its last sign of life to the end of the reconciliation, and
    what the agents reported when they came back."""
    down_at: float
    up_at: float
    reconciled_at: float | None = None
    reports: dict[str, protocol.Registration] = field(default_factory=dict)


@dataclass
class JobState:
    """Everything a job's flows read and write. No sockets, no store: plain data."""
    job_id: int
    created_at: float
    phase: JobPhase = JobPhase.WAITING
    reason: str | None = None
    slots: list[str] = field(default_factory=list)          # slot i (ranks i*G..) -> machine
    pool: Pool = field(default_factory=Pool)
    run_seq: int = 0
    run: RunState | None = None
    steps_done: int = 0                  # steps completed and not lost (the next step to run)
    best_steps: int = 0
    progress_at_run_start: int = 0
    restarts_without_progress: int = 0
    last_loss: float | None = None
    signals: Signals = field(default_factory=Signals)
    incident_seq: int = 0
    incident: Incident | None = None
    awaiting_resume: list[int] = field(default_factory=list)
    history: list[PastIncident] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)       # recent alerts (network counting)
    chaos: list[ChaosPlan] = field(default_factory=list)
    chaos_applied: list[float] = field(default_factory=list)  # injection times
    avail: Availability = field(default_factory=Availability)
    bad_steps: list[BadSteps] = field(default_factory=list)   # copies never to be restored
    jumps: list[tuple[int, float]] = field(default_factory=list)   # (step, value) of recent jumps
    diag_seq: int = 0
    diag: Diagnosis | None = None
    replay: Replay | None = None
    versions: list[dict[str, Any]] = field(default_factory=list)     # code_versions rows
    version_id: int | None = None        # the version the workers run
    code_path: str | None = None         # where the workers' code lives
    script_marks: dict[str, int] = field(default_factory=dict)   # a plain script's snapshots: path -> steps
    script: bool = False                 # its steps come from the step hook (a plain script), not the SDK
    # the steps of the run before that some rank's report is missing for (its last records died with
    # it): done if the next run resumes from a snapshot past them (RunFlow.on_script)
    script_unsettled: dict[int, PendingStep] = field(default_factory=dict)
    script_unsettled_run: int = 0
    versioning_off: str | None = None
    spares: HotUpdatePrep | None = None
    gaps: list[ControlPlaneGap] = field(default_factory=list)

    # -- phases ----------------------------------------------------------------------------
    def move(self, to: JobPhase) -> None:
        if to == self.phase:
            return
        if to not in JOB_TRANSITIONS[self.phase]:
            raise TransitionError(f"job {self.job_id}: {self.phase.value} -> {to.value} is not allowed")
        self.phase = to

    @property
    def terminal(self) -> bool:
        return self.phase in _ENDED

    @property
    def reconciling(self) -> bool:
        """After a controller restart, until every machine reported back (or the grace passed): the
        flows leave decisions to the reconciliation meanwhile."""
        return bool(self.gaps) and self.gaps[-1].reconciled_at is None

    # -- small derived views ----------------------------------------------------------------
    def version(self) -> dict[str, Any] | None:
        """The row of the version the workers run."""
        return next((v for v in self.versions if v["id"] == self.version_id), None)

    def is_bad(self, step: int) -> bool:
        return any(b.lo <= step < b.hi for b in self.bad_steps)

    def bad_step_set(self, steps: set[int]) -> set[int]:
        """Which of `steps` must never be restored."""
        return {s for s in steps if self.is_bad(s)}

    def open_alerts(self, now: float, window_s: float) -> list[Alert]:
        return [a for a in self.alerts if now - a.t <= window_s]


# -- JSON ----------------------------------------------------------------------------------------

CHUNK = 64          # entries of a large dict or list encoded per call (see `dumps`)
ONE_CALL_BYTES = 128 << 10  # a state last this small is written in one call (~2 ms at most)


def dumps(state: JobState, pieces: bool = True) -> bytes:
    """The state as JSON, exactly: `dumps(loads(dumps(s))) == dumps(s)`. A NaN loss or an infinite
    gradient norm is evidence, so non-finite floats are kept (as Python's json writes them: NaN,
    Infinity), not turned into null.

    The text is exactly `json.dumps` of the whole, but written in pieces: a job of 2,048 machines
    has a state of megabytes (the ranks' hang timers and step records), and one call of
    the C encoder holds the GIL for all of it (~0.2 s), stalling the API's event loop, which
    answers every agent's beat, for as long. In pieces of at most CHUNK entries the GIL passes
    between them (every few ms), so a save delays a beat by little more than `to_builtins`.
    A small state is better written in one call (`pieces=False`: 0.3 ms for the 19 KB of a job of
    two machines, 1.7 ms in pieces, every second): the caller knows its last size
    (`ONE_CALL_BYTES`)."""
    obj = msgspec.to_builtins(state, order="deterministic")
    if not pieces:
        return _json(obj).encode()
    out: list[str] = []
    _encode(obj, out)
    return "".join(out).encode()


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=True)


def _encode(obj: Any, out: list[str]) -> None:
    """Append `_json(obj)` to `out` in pieces: a small dict or list is walked into, a large one
    is written CHUNK entries per call; anything else in one call."""
    if type(obj) is dict and obj:
        items = list(obj.items())
        out.append("{")
        if len(items) <= CHUNK:
            for i, (k, v) in enumerate(items):
                out.append(("," if i else "") + _json({k: None})[1:-5])       # '"key":'
                _encode(v, out)
        else:
            out.append(",".join(_json(dict(items[i:i + CHUNK]))[1:-1] for i in range(0, len(items), CHUNK)))
        out.append("}")
    elif type(obj) is list and obj:
        out.append("[")
        if len(obj) <= CHUNK:
            for i, v in enumerate(obj):
                if i:
                    out.append(",")
                _encode(v, out)
        else:
            out.append(",".join(_json(obj[i:i + CHUNK])[1:-1] for i in range(0, len(obj), CHUNK)))
        out.append("]")
    else:
        out.append(_json(obj))


def loads(data: bytes | str) -> JobState:
    """A state from `dumps`' JSON; msgspec.ValidationError names a bad field."""
    return msgspec.convert(json.loads(data), type=JobState, strict=False)


# The timers a decision sets: when it sent something, and the deadlines it computed from `now`.
TIMER_FIELDS = frozenset(("deadline", "next", "sent", "stop_sent", "trace_sent", "started", "started_at",
                          "next_refill", "next_request", "failslow_quiet_until", "peer_next_check"))


def shift_timers(obj: Any, since: float, by: float) -> int:
    """Move the timers set at or after `since` (a decision's `now`) `by` seconds later: the
    decision's commit waited that long for the store, and its timers count from when its
    commands left. Earlier times (history) are left alone. Returns how many moved."""
    moved = 0
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name in TIMER_FIELDS and isinstance(v, float) and v >= since:
                setattr(obj, f.name, v + by)
                moved += 1
            elif dataclasses.is_dataclass(v) or isinstance(v, (list, dict)):
                moved += shift_timers(v, since, by)
    elif isinstance(obj, list):
        for v in obj:
            if dataclasses.is_dataclass(v):
                moved += shift_timers(v, since, by)
    elif isinstance(obj, dict):
        for v in obj.values():
            if dataclasses.is_dataclass(v):
                moved += shift_timers(v, since, by)
    return moved
