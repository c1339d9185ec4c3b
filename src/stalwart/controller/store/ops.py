"""What one transaction of `Store.commit` writes, as typed values: the store's operations.

The job core's store actions are these very types (`controller/job/actions.py` imports them
from here and lists them in its `Action` union), so the executor hands a decision's actions to
the store unchanged. They are declared on the store's side because the job core depends on the
store (through `job/ports.py`) and never the other way: this module imports nothing of
`controller/job`, and the store's writer for each type (`db.py`) sits beside the tables it writes.

`AssignMachine` and `FinishJob` are more than rows: the executor also acts on them after the
transaction (the registry, the backend, the rendezvous). Their other fields (`incident`,
`machines`) are the executor's; the store writes the machine's and the job's row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from stalwart.controller.cluster.roles import Role


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
    """`fields`: columns of the `incidents` table (JSON ones as their values)."""
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
    """`fields`: columns of the `runs` table."""
    seq: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class SaveVersion:
    """A code version's row (`controller/code/versions.py`), `id` included."""
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
class AssignMachine:
    """A machine's role for this job: active, standby, evicted (with the reason) or idle (no job)."""
    machine: str
    state: Role
    reason: str | None = None
    incident: int | None = None


@dataclass(frozen=True)
class FinishJob:
    """The job ended: its row, its machines back to the free pool, its rendezvous closed."""
    state: str
    reason: str | None
    machines: list[str]
    t: float


@dataclass(frozen=True)
class StartJob:
    """The job's row says it runs (its first state is saved in the same transaction)."""


StoreOp = Union[Record, OpenIncident, UpdateIncident, CreateRun, UpdateRun, SaveVersion, AddCheckpoint,
                AssignMachine, FinishJob, StartJob]
OPS = (Record, OpenIncident, UpdateIncident, CreateRun, UpdateRun, SaveVersion, AddCheckpoint, AssignMachine,
       FinishJob, StartJob)
"""The members of `StoreOp`, for `isinstance` (a unit test keeps the two the same)."""
ROWS_ONLY = (Record, OpenIncident, UpdateIncident, CreateRun, UpdateRun, SaveVersion, AddCheckpoint)
"""The operations that are rows and nothing else (the executor sends nothing for them)."""
