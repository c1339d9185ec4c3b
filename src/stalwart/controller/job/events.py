"""What reaches a job's core: agent events, a lost machine, an injection, a cancel, a new code
version, an agent back after a controller restart, the restart itself, and the clock's tick; plus
`ClusterView`, the read-only view of the machines the flows decide from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Iterable, Protocol, Union

from stalwart import protocol


@dataclass(frozen=True)
class AgentEvent:
    machine: str
    event: protocol.Event


@dataclass(frozen=True)
class AgentEvents:
    """Several agents' events that arrived together (every machine's answer to one command, every
    rank's report of one step), handled in their order as one `AgentEvent` each would be: the
    same actions, without a dispatch per machine. Once the job ends the rest are not handled."""
    items: tuple[tuple[str, protocol.Event], ...]


@dataclass(frozen=True)
class StepReport:
    """One step as every listed rank reported it, at one instant, as whole-job columns: rank
    `ranks[i]` on machine `machines[i]` finished step `step` at `t` in `dur` seconds, its compute
    taking `compute_s[i]` (None: not measured); loss, gradient norms and tokens are the same for
    all. The core handles it exactly as one `AgentEvent` carrying a `protocol.Step` per rank, in
    the listed order, would be handled (`as_agent_events` gives those), without an object and a
    dispatch per rank: what a job of tens of thousands of ranks needs while every step is
    reported."""
    run: int | None
    step: int
    t: float
    dur: float | None
    machines: tuple[str, ...]
    ranks: tuple[int, ...] | range
    compute_s: tuple[float | None, ...] | None = None
    loss: float | None = None
    grad_norm: float | None = None
    tokens: int | None = None
    local_grad_norm: float | None = None

    def as_agent_events(self) -> AgentEvents:
        comp = self.compute_s or (None,) * len(self.ranks)
        return AgentEvents(items=tuple(
            (m, protocol.Step(run=self.run, rank=r, step=self.step, t=self.t, dur=self.dur, loss=self.loss,
                              grad_norm=self.grad_norm, tokens=self.tokens, local_grad_norm=self.local_grad_norm,
                              compute_s=c))
            for m, r, c in zip(self.machines, self.ranks, comp)))


@dataclass(frozen=True)
class StopReport:
    """Every listed machine's answer to one stop (`protocol.Stopped`), at one instant, with the
    memory inventories as whole-job columns: machine `machines[i]` holds steps `own` of the ranks
    `own_ranks[i]` and steps `backup` of the ranks `backup_ranks[i]`; `own_ranks[i]` None: an
    empty inventory (memory holds nothing). The core handles it exactly as one `AgentEvent`
    carrying a `protocol.Stopped` per machine, in the listed order, would be handled
    (`as_agent_events` gives those), without a message and a dispatch per machine. The simulator
    sends it; real agents send one `Stopped` each (their inventories differ machine by machine)."""
    run: int | None
    t: float
    machines: tuple[str, ...]
    own_ranks: tuple[tuple[int, ...] | None, ...]
    backup_ranks: tuple[tuple[int, ...], ...]
    own: tuple[int, ...] = ()
    backup: tuple[int, ...] = ()

    def inventory(self, i: int) -> dict[str, dict[int, list[int]]]:
        """Machine `machines[i]`'s inventory as its `protocol.Stopped` carries it."""
        ranks = self.own_ranks[i]
        if ranks is None:
            return {}
        return {"own": {r: list(self.own) for r in ranks},
                "backup": {r: list(self.backup) for r in self.backup_ranks[i]}}

    def as_agent_events(self) -> AgentEvents:
        return AgentEvents(items=tuple(
            (m, protocol.Stopped(run=self.run, inventory=self.inventory(i), t=self.t))
            for i, m in enumerate(self.machines)))

    def only(self, keep: Iterable[str]) -> "StopReport":
        """The same report from the machines in `keep` alone, in the same order."""
        ks = set(keep)
        idx = [i for i, m in enumerate(self.machines) if m in ks]
        return StopReport(run=self.run, t=self.t, machines=tuple(self.machines[i] for i in idx),
                          own_ranks=tuple(self.own_ranks[i] for i in idx),
                          backup_ranks=tuple(self.backup_ranks[i] for i in idx), own=self.own, backup=self.backup)


@dataclass(frozen=True)
class MachineLost:
    machine: str


@dataclass(frozen=True)
class Inject:
    kind: str
    machine: int
    rank: int | None = None
    params: dict[str, Any] | None = None


@dataclass(frozen=True)
class Cancel:
    reason: str


@dataclass(frozen=True)
class VersionRegistered:
    row: dict[str, Any]


@dataclass(frozen=True)
class AgentBack:
    """An agent (re-)registered while this job holds its machine: what it runs now."""
    machine: str
    reg: protocol.Registration


@dataclass(frozen=True)
class Resumed:
    """This controller took the job over from one that died: its last sign of life and now."""
    down_at: float
    up_at: float


@dataclass(frozen=True)
class Tick:
    pass


JobEvent = Union[AgentEvent, AgentEvents, StepReport, StopReport, MachineLost, Inject, Cancel, VersionRegistered,
                 AgentBack, Resumed, Tick]


class ClusterView(Protocol):
    """What the flows may ask about machines (the controller's registry, or a simulation)."""

    def alive(self, machine: str) -> bool:
        """Whether the machine's agent is heard from."""

    def last_heard(self, machine: str) -> float | None:
        """When its agent last sent anything."""

    def freshest(self, machines: Iterable[str]) -> float | None:
        """The latest `last_heard` of `machines` (None: none was ever heard). A whole job's in one
        call: the stop's silence check asks at every tick, and a view that knows most machines were
        heard just now answers without looking at each."""

    def unheard_since(self, machines: AbstractSet[str], t: float) -> dict[str, float | None]:
        """The machines of `machines` not heard after `t` (last heard at or before it, or never:
        None), with when they were last heard."""

    def beat_late_s(self) -> float:
        """The largest heartbeat lateness seen recently on this host (0: beats come on time)."""

    def free(self) -> list[str]:
        """Idle machines no job holds, in a stable order."""

    def labels(self, machine: str) -> dict[str, str]:
        """The machine's topology labels (switch, pod, ...); {} when it has none."""
