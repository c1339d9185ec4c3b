"""What one job's runner and executor see of the controller: a few small interfaces, passed in.

The controller (`controller/service.py`) builds a `JobPorts` for each job from its parts: the
store, the agents' command queues, the machine registry, the workers' rendezvous, the cluster's
backend, a read-only view of the machines for the job's core, and the clock. The runner and the
executor know these interfaces alone, never the controller that runs them (as a Kubernetes
reconciler is handed a client, not its manager), so each can be driven by fakes in a test.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart import protocol
from stalwart.controller import clock
from stalwart.controller.cluster.roles import Role
from stalwart.controller.job.events import ClusterView
from stalwart.controller.store.ops import StoreOp


class JobStore(Protocol):
    """The store as a job writes it (`controller/store/db.py`)."""

    def commit(self, job_id: int, ops: Sequence[StoreOp], state: bytes | None) -> None:
        """Write `ops` and the job's saved state in one transaction (waits while the store is away)."""

    def patient(self) -> None:
        """Make the calling thread's writes wait a store outage out instead of failing."""

    def upsert_machine(self, machine_id: str, **values: Any) -> None:
        """Write a machine's row."""


class AgentGateway(Protocol):
    """Commands to agents (`controller/api/commands.py`)."""

    def send(self, machine: str, cmd: protocol.Command) -> None:
        """Queue `cmd` for the machine's agent (pushed on its channel, or taken by its poll)."""


class MachineRoles(Protocol):
    """The machine registry as a job changes it (`controller/cluster/machines.py`)."""

    def assign(self, machine: str, role: Role, job_id: int, reason: str | None = None) -> None:
        """The job gave the machine a role."""

    def release(self, job_id: int, machines: list[str]) -> list[str]:
        """The job ended: the machines it held become idle; returns their ids."""

    def peer_addr(self, machine: str) -> tuple[str, int] | None:
        """Where the machine's agent serves checkpoint shards to its peers."""


class WorkerRendezvous(Protocol):
    """The rendezvous stores the controller hosts for the workers (`controller/api/rendezvous.py`)."""

    def open(self, job_id: int, run: int) -> int:
        """The port of the run's store (opened once per run)."""

    def open_scratch(self, job_id: int, name: str) -> int:
        """The port of a store for a check or a replay group."""

    def close_scratch(self, job_id: int, name: str) -> None:
        """Close one scratch store."""

    def close_job(self, job_id: int) -> None:
        """Close every store of the job."""


class ClusterBackend(Protocol):
    """The cluster's backend as a job asks it (`controller/cluster/supply.py`)."""

    def evict(self, machine: str, reason: str | None, incident: int | None) -> None:
        """The job evicted the machine: drain or cordon it where the backend can."""

    def request(self, job_id: int, count: int) -> list[str]:
        """The job's standby pool is short and no machine is free: ask for `count` more."""


@dataclass(frozen=True)
class JobPorts:
    """Everything a job's runner and executor use outside the job core."""
    store: JobStore
    agents: AgentGateway
    machines: MachineRoles
    rendezvous: WorkerRendezvous
    backend: ClusterBackend
    cluster: ClusterView                 # what the job's core reads about the machines
    store_host: str                      # the address the workers reach the rendezvous stores at
    ckpt_dir: str                        # where the job's durable checkpoints go
    ckpt_key: str                        # the job's checkpoint key (hex), for its agents alone
    now: Callable[[], float] = clock.now
    on_phase: Callable[[int, str], None] | None = None     # after each transition the job carried out
