"""What the job core decides, as values: the executor (`executor.py`) is the only part that acts.

Store actions go into one transaction with the state saved after them: they are the store's own
operation types (`controller/store/ops.py`, imported here: the job core depends on the store, never
the reverse), handed to `Store.commit` unchanged. Agent actions become typed commands
(`stalwart.protocol`); machine actions change the controller's registry (and tell the backend
about an eviction); `AssignMachine` and `FinishJob` are both a row and an act.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Mapping, Sequence, Union

import numpy as np

from stalwart.controller.store.ops import (ROWS_ONLY, AddCheckpoint, AssignMachine, CreateRun, FinishJob,
                                           OpenIncident, Record, SaveVersion, UpdateIncident, UpdateRun)
from stalwart.diag.pairs import pairs_of

# -- the store (the event log, incidents, runs, versions, checkpoints, the job row, machine roles):
# Record, OpenIncident, UpdateIncident, CreateRun, UpdateRun, SaveVersion, AddCheckpoint,
# AssignMachine and FinishJob, from `controller/store/ops.py`

# -- machines ------------------------------------------------------------------------------------


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


class RestoreCopies(Mapping[int, list[RestoreCopy]]):
    """Every rank's copies of `step`, best first (own, backup, durable): rank -> its copies, the
    ranks without any copy absent. Held as the restore plan's columns
    (`Availability.plan_columns`: per tier, whether each rank has a copy there and its holder or
    location) and made into a rank's list when read: a 100,000-rank restart lists 100,000 ranks,
    which the executor reads machine by machine and the simulator not at all. Equal copies (a
    durable step's) are one object."""

    def __init__(self, step: int = -1, cols: Sequence[tuple[str, Sequence[bool], Sequence[str]]] = ()):
        self.step = step
        self.cols = list(cols)
        self._world = len(self.cols[0][1]) if self.cols else 0
        self._made: dict[tuple[str, str], RestoreCopy] = {}

    def _copy(self, tier: str, holder: str) -> RestoreCopy:
        made = self._made.get((tier, holder))
        if made is None:
            made = self._made[(tier, holder)] = (RestoreCopy(tier, self.step, None, holder) if tier == "durable"
                                                 else RestoreCopy(tier, self.step, holder))
        return made

    def __getitem__(self, rank: int) -> list[RestoreCopy]:
        if not isinstance(rank, int) or not 0 <= rank < self._world:
            raise KeyError(rank)
        got = [self._copy(tier, who[rank]) for tier, has, who in self.cols if has[rank]]
        if not got:
            raise KeyError(rank)
        return got

    def __iter__(self) -> Iterator[int]:
        cols = [has for _, has, _ in self.cols]
        return (r for r in range(self._world) if any(has[r] for has in cols))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"RestoreCopies(step={self.step}, ranks={self._world}, tiers={[c[0] for c in self.cols]})"

    def best_tiers(self) -> set[str]:
        """The tiers some rank's best copy is in."""
        out, taken = set(), np.zeros(self._world, dtype=bool)
        for tier, has, _ in self.cols:
            mask = np.asarray(has, dtype=bool)
            if (mask & ~taken).any():
                out.add(tier)
            taken |= mask
        return out


@dataclass(frozen=True)
class StartRun:
    """Start run `run` on `slots` (machine i holds ranks i*G..): warm machines hand the ranks to
    their waiting spares. `restore` lists each rank's copies of `restore_step`, best first."""
    run: int
    slots: list[str]
    restore_step: int
    restore: RestoreCopies
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
    """Stop-time checks. The pair test (`inter`) pairs the machines of `ring` along the ring
    (`stalwart.diag.pairs`); `pairs_of` and `inter_of` give one machine's side of its pairs.
    (The ring, not every machine's pairs: a 12,500-machine job's pairs are 37,500 objects that
    the executor and the simulated agents read one machine at a time.)"""
    name: str
    checks: list[str]
    machines: list[str]
    ring: list[str] = field(default_factory=list)
    timeout_s: float = 10.0

    @cached_property
    def _position(self) -> dict[str, int]:
        return {m: i for i, m in enumerate(self.ring)}

    def pairs_of(self, machine: str) -> list[tuple[int, str, int]]:
        """`machine`'s pair tests in round order: (round, partner, end: 0 or 1)."""
        i = self._position.get(machine)
        if i is None:
            return []
        ring = self.ring
        return [(r, ring[j], end) for r, j, end in pairs_of(len(ring), i)]

    def inter_of(self, machine: str) -> list[InterPair]:
        """`machine`'s side of its pair tests, each with its rendezvous prefix."""
        out = []
        for r, peer, end in self.pairs_of(machine):
            a, b = (machine, peer) if end == 0 else (peer, machine)
            out.append(InterPair(r, peer, end, f"{self.name}/r{r}/{a}-{b}/"))
        return out


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
STORE_ACTIONS = ROWS_ONLY       # the actions that are store rows and nothing else

__all__ = ["Action", "STORE_ACTIONS", "Record", "OpenIncident", "UpdateIncident", "CreateRun", "UpdateRun",
           "SaveVersion", "AddCheckpoint", "FinishJob", "AssignMachine", "RequestMachines", "RestoreCopy",
           "StartRun", "StopWorkers", "Prewarm", "PrepareSpares", "TraceStacks", "InterPair", "RunChecks",
           "StartReplayGroup", "CloseScratch", "SendChaos"]
