"""The controller's machine registry: every machine it knows, its role, and whether its agent is heard.

One `Machine` per machine, held by a `Registry` under one lock (the API's threads, the heartbeat
monitor and the job threads all reach it). The registry is memory only: its callers write the
store (`machines` table), whose rows it is loaded from when a controller starts.

A machine's role (`Role`, in `roles.py`: the `state` column of the store and of `/api/machines`):

    provisioning --register--> idle --a job takes it--> active | standby --fault--> evicted
    active | standby --the job ends--> idle

A re-registration keeps active, standby and evicted (the job's state decides what happens to
the machine, not its agent's return); anything else registers as idle.
"""
from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from stalwart import protocol
from stalwart.controller.cluster.beats import BeatLateness
from stalwart.controller.cluster.roles import Role

KEPT_ON_REGISTER = frozenset((Role.ACTIVE, Role.STANDBY, Role.EVICTED))
HELD = frozenset((Role.ACTIVE, Role.STANDBY))       # roles a job's end gives back


class AgentReply(Enum):
    """The registry's answer to an agent's beat or batch of events."""
    OK = "ok"
    REREGISTER = "reregister"      # the machine is known but not alive here: register again
    UNKNOWN = "unknown"            # a machine this controller does not know (it restarted): the batch
                                   # is not taken; register, then send it again

    @property
    def reregister(self) -> bool:
        return self is not AgentReply.OK

    @property
    def taken(self) -> bool:
        return self is not AgentReply.UNKNOWN


@dataclass(slots=True)
class Machine:
    id: str
    role: Role = Role.IDLE
    job_id: int | None = None          # the job it has a role for (None when idle)
    reason: str | None = None          # why it has its role (an eviction's cause)
    address: str | None = None
    info: dict[str, Any] | None = None     # its agent's registration (`protocol.Registration`) as JSON
    registered_at: float | None = None
    last_beat: float | None = None     # when its agent last sent anything (None: not since this start)
    alive: bool = False                # heard within the heartbeat limit since it registered
    isolated: bool | None = None       # its workers have a network namespace of their own (None: not said)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Machine":
        """A machine from its store row; not alive until its agent registers with this controller."""
        return cls(id=row["id"], role=Role(row["state"]), job_id=row.get("job_id"), reason=row.get("reason"),
                   address=row.get("address"), info=row.get("info") or None,
                   registered_at=row.get("registered_at"))

    def row(self) -> dict[str, Any]:
        """As `/api/machines` shows it."""
        return {"id": self.id, "state": self.role.value, "address": self.address,
                "registered_at": self.registered_at, "last_beat": self.last_beat, "alive": self.alive,
                "isolated": self.isolated, "job_id": self.job_id, "reason": self.reason}

    def labels(self) -> dict[str, str]:
        return dict((self.info or {}).get("labels") or {})

    def peer(self) -> tuple[str, int] | None:
        addr = (self.info or {}).get("peer")
        return (str(addr[0]), int(addr[1])) if addr else None


def natural_key(s: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def overdue(machines: Iterable[Machine], now: float, limit_s: float) -> tuple[list[Machine], float]:
    """The alive machines whose agents have been silent for more than `limit_s` at `now`, and
    the earliest last beat among the alive others (inf: none): until `now - limit_s` passes it,
    no machine can be overdue, and the heartbeat monitor need not look at thousands of them ten
    times a second."""
    lost, earliest = [], math.inf
    for m in machines:
        if m.alive and m.last_beat is not None:
            if now - m.last_beat > limit_s:
                lost.append(m)
            elif m.last_beat < earliest:
                earliest = m.last_beat
    return lost, earliest


class Registry:
    """The machines, by id. Every method takes the lock; what it returns is a copy."""

    def __init__(self, rows: Iterable[dict[str, Any]], lateness: BeatLateness):
        self._lock = threading.Lock()
        self._by_id: dict[str, Machine] = {}
        for r in rows:
            self._by_id[r["id"]] = Machine.from_row(r)
        self._lateness = lateness          # how late beats come on this host (under the lock)
        self._earliest_beat = -math.inf    # no alive machine beat before this (see `overdue`)

    # -- what agents say ----------------------------------------------------------------------------
    def register(self, machine: str, reg: protocol.Registration, now: float) -> Machine:
        """The machine's agent registered: alive, heard now; its role kept where a job holds it."""
        with self._lock:
            old = self._by_id.get(machine)
            role = old.role if old is not None and old.role in KEPT_ON_REGISTER else Role.IDLE
            m = Machine(id=machine, role=role, job_id=old.job_id if old else None,
                        reason=old.reason if old else None, address=reg.address, info=protocol.encode(reg),
                        registered_at=now, last_beat=now, alive=True, isolated=reg.isolated)
            self._by_id[machine] = m
            self._earliest_beat = min(self._earliest_beat, now)
            return dataclasses.replace(m)

    def beat(self, machine: str, now: float) -> AgentReply:
        """A heartbeat: a machine not alive here is told to register again."""
        with self._lock:
            m = self._by_id.get(machine)
            if m is None or not m.alive:
                return AgentReply.REREGISTER
            self._heard(m, now)
            return AgentReply.OK

    def events(self, machine: str, now: float) -> tuple[AgentReply, int | None]:
        """A batch of events counts as a heartbeat; the answer and the job they are for."""
        with self._lock:
            m = self._by_id.get(machine)
            if m is None:
                return AgentReply.UNKNOWN, None
            if not m.alive:
                return AgentReply.REREGISTER, m.job_id
            self._heard(m, now)
            return AgentReply.OK, m.job_id

    def _heard(self, m: Machine, now: float) -> None:
        self._lateness.heard(m.last_beat, now)
        m.last_beat = now

    def late_s(self, now: float) -> float:
        """The largest heartbeat lateness seen recently on this host (`beats.BeatLateness`)."""
        with self._lock:
            return self._lateness.late_s(now)

    # -- the heartbeat monitor ----------------------------------------------------------------------
    @property
    def earliest_beat(self) -> float:
        return self._earliest_beat

    def stalled(self, lag: float) -> None:
        """The controller did not run for `lag` seconds: beats it could not read are not the
        machines' silence, so every alive machine's deadline moves by as much."""
        with self._lock:
            for m in self._by_id.values():
                if m.alive and m.last_beat is not None:
                    m.last_beat += lag
            self._earliest_beat = -math.inf

    def lose_overdue(self, now: float, limit_s: float) -> list[Machine]:
        """The machines silent for more than `limit_s`, now no longer alive (none is looked at
        before the earliest beat plus the limit has passed)."""
        with self._lock:
            if now - limit_s <= self._earliest_beat:
                return []
            lost, self._earliest_beat = overdue(self._by_id.values(), now, limit_s)
            for m in lost:
                m.alive = False
            return [dataclasses.replace(m) for m in lost]

    # -- roles --------------------------------------------------------------------------------------
    def assign(self, machine: str, role: Role, job_id: int, reason: str | None = None) -> None:
        """A job gave a machine a role (a machine not known yet is added, not alive)."""
        with self._lock:
            m = self._by_id.setdefault(machine, Machine(id=machine))
            m.role, m.reason, m.job_id = role, reason, None if role is Role.IDLE else job_id

    def release(self, job_id: int, machines: Iterable[str]) -> list[str]:
        """A job ended: those of `machines` it holds (active or standby) become idle; their ids."""
        with self._lock:
            mine = [m for m in (self._by_id.get(x) for x in machines)
                    if m is not None and m.role in HELD and m.job_id == job_id]
            for m in mine:
                m.role, m.job_id = Role.IDLE, None
            return [m.id for m in mine]

    def clear_roles(self) -> list[str]:
        """Every machine becomes idle and free (a fresh cluster); the ids of those that were not."""
        with self._lock:
            changed = [m for m in self._by_id.values()
                       if m.role is not Role.IDLE or m.job_id is not None]
            for m in changed:
                m.role, m.job_id, m.reason = Role.IDLE, None, None
            return [m.id for m in changed]

    # -- lookups ------------------------------------------------------------------------------------
    def get(self, machine: str) -> Machine | None:
        with self._lock:
            m = self._by_id.get(machine)
            return dataclasses.replace(m) if m is not None else None

    def __contains__(self, machine: object) -> bool:
        with self._lock:
            return machine in self._by_id

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._by_id)

    def alive(self, machine: str) -> bool:
        with self._lock:
            m = self._by_id.get(machine)
            return m is not None and m.alive

    def last_heard(self, machine: str) -> float | None:
        """When the machine's agent last sent anything (a heartbeat or events)."""
        with self._lock:
            m = self._by_id.get(machine)
            return m.last_beat if m is not None else None

    def labels(self, machine: str) -> dict[str, str]:
        """The topology labels its agent registered with (`stalwart agent --label`)."""
        with self._lock:
            m = self._by_id.get(machine)
            return m.labels() if m is not None else {}

    def peer_addr(self, machine: str) -> tuple[str, int] | None:
        """Where a machine's agent serves checkpoint shards to its peers."""
        with self._lock:
            m = self._by_id.get(machine)
            return m.peer() if m is not None else None

    def free(self) -> list[str]:
        """The alive idle machines, in natural order (m2 before m10)."""
        with self._lock:
            ids = [m.id for m in self._by_id.values() if m.alive and m.role is Role.IDLE]
        return sorted(ids, key=natural_key)

    def rows(self) -> list[dict[str, Any]]:
        """Every machine as `/api/machines` shows it, in natural order."""
        with self._lock:        # (copied under the lock, sorted outside: the API's loop beats take it)
            rows = [m.row() for m in self._by_id.values()]
        return sorted(rows, key=lambda r: natural_key(r["id"]))
