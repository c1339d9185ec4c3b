"""What the job core decides, as values: the executor (`executor.py`) is the only part that acts.

Store actions go into one transaction with the state saved after them; agent actions become
typed commands (`stalwart.protocol`); machine actions change the controller's registry (and tell
the backend about an eviction).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

# -- the store (the event log, incidents, runs, versions, checkpoints, the job row) --------------


@dataclass(frozen=True)
class Record:
    """One event of the job's log (what the ETTR ledger is rebuilt from)."""
    kind: str
    data: dict[str, Any]
    t: float


@dataclass(frozen=True)
class OpenIncident:
    seq: int
    run: int | None
    symptom: str
    category: str
    detected_at: float


@dataclass(frozen=True)
class UpdateIncident:
    seq: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class CreateRun:
    seq: int
    start_step: int
    started_at: float
    machines: list[str]
    restore_step: int


@dataclass(frozen=True)
class UpdateRun:
    seq: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class SaveVersion:
    row: dict[str, Any]


@dataclass(frozen=True)
class AddCheckpoint:
    step: int
    rank: int
    tier: str
    location: str
    checksum: str
    t: float


@dataclass(frozen=True)
class FinishJob:
    """The job ended: its row, its machines back to the free pool, its rendezvous closed."""
    state: str
    reason: str | None
    machines: list[str]
    t: float


# -- machines ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AssignMachine:
    """A machine's role for this job: active, standby, evicted (with the reason) or idle."""
    machine: str
    state: str
    reason: str | None = None
    incident: int | None = None


@dataclass(frozen=True)
class RequestMachines:
    """The standby pool is short and no machine is free: ask the cluster's backend for more."""
    count: int


# -- agents ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestoreCopy:
    tier: str
    step: int
    holder: str | None = None
    location: str | None = None


@dataclass(frozen=True)
class StartRun:
    """Start run `run` on `slots` (machine i holds ranks i*G..): warm machines hand the ranks to
    their waiting spares. `restore` lists each rank's copies of `restore_step`, best first."""
    run: int
    slots: list[str]
    restore_step: int
    restore: dict[int, list[RestoreCopy]]
    warm: list[str]
    code_path: str | None
    version: int | None
    spares: bool = True          # the agents keep spare workers (never for a plain script: none can wait)


@dataclass(frozen=True)
class StopWorkers:
    """Stop the workers of `run` on `machines` (run None: everything of the job there)."""
    machines: list[str]
    run: int | None
    grace_s: float = 0.0


@dataclass(frozen=True)
class Prewarm:
    """Keep warm workers for the job's next run on a standby machine."""
    machine: str
    code_path: str | None
    version: int | None


@dataclass(frozen=True)
class PrepareSpares:
    """Warm spares for a coming code version on the run's machines, training going on."""
    machines: list[str]
    code_path: str
    version: int


@dataclass(frozen=True)
class TraceStacks:
    machines: list[str]
    run: int | None


@dataclass(frozen=True)
class InterPair:
    round: int
    peer: str
    rank: int
    prefix: str


@dataclass(frozen=True)
class RunChecks:
    """Stop-time checks: `inter` holds each machine's pair tests (its side of each pair)."""
    name: str
    checks: list[str]
    machines: list[str]
    inter: dict[str, list[InterPair]] = field(default_factory=dict)
    timeout_s: float = 10.0


@dataclass(frozen=True)
class StartReplayGroup:
    """One group of a dual-phase replay: the job's command on `machines`, DP = `dp`."""
    name: str
    run: int
    machines: list[str]
    dp: int
    steps: int
    code_path: str | None
    version: int | None


@dataclass(frozen=True)
class CloseScratch:
    """A diagnostics or replay rendezvous store is no longer needed."""
    name: str


@dataclass(frozen=True)
class SendChaos:
    machine: str
    kind: str
    rank: int | None
    step: int
    params: dict[str, Any] = field(default_factory=dict)
    at_step: int | None = None      # armed on the agent until its ranks completed this many steps


Action = Union[Record, OpenIncident, UpdateIncident, CreateRun, UpdateRun, SaveVersion, AddCheckpoint,
               FinishJob, AssignMachine, RequestMachines, StartRun, StopWorkers, Prewarm, PrepareSpares, TraceStacks,
               RunChecks, StartReplayGroup, CloseScratch, SendChaos]
STORE_ACTIONS = (Record, OpenIncident, UpdateIncident, CreateRun, UpdateRun, SaveVersion, AddCheckpoint)
