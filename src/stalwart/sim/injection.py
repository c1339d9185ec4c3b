"""Fault injection: the failure model's happenings played into the running simulation.

The trace (`failures.py`) says what goes wrong and when; this module makes it true in the
simulated world. `Injection` holds the truth the job core never sees directly: which machines are
faulty (`bad`), which faults show on which machines in the current run (`shown`), which code
versions carry a bug (`bugs`), when the storage service is out, and the fault to blame for the
incident the core opens next. It decides when a fault shows (at once on a running job, or when its
machine next runs), when a persistent fault comes back after a restart, when a code update lands,
and when a restart itself fails; it tells the agents to manifest a fault (`agents.Agents.manifest`)
and the job core only what a real controller would hear (a new code version, a cancellation).

It sees the simulation loop through `Loop` (the engine's `Sim` is one): the clock and queue, the
running training, the job state, and the few calls that deliver to the core. Every fault draws its
own luck (`draw`, seeded by the fault), so a fault behaves the same under every policy that asks.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Protocol

from stalwart.controller.job import state as S
from stalwart.controller.job.events import Cancel, JobEvent, VersionRegistered
from stalwart.sim.config import Segment
from stalwart.sim.failures import Fault, Model
from stalwart.sim.training import Training

IMMEDIATE = ("slow", "network")     # faults (besides dead hardware) that show again as soon as a run starts


class Loop(Protocol):
    """What fault injection reads of the simulation loop and the calls it makes there."""
    now: float
    t0: float                      # the core's clock at the simulation's start (faults' times are relative)
    training: Training | None
    last_slots: list[str] | None
    st: S.JobState | None
    seg: Segment | None

    def later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None: ...
    def deliver(self, ev: JobEvent) -> None: ...
    def flush(self) -> None: ...
    def changed(self) -> None: ...
    def version_row(self, n: int, status: str, mode: str) -> dict: ...
    def prewindow(self, t: float, hang_only: bool = False) -> None: ...


class Agents(Protocol):
    def manifest(self, f: Fault, machines: list[str]) -> None: ...
    def bug(self, kind: str, version: int) -> None: ...


class Injection:
    def __init__(self, loop: Loop, agents: Agents, model: Model, switch_of: Callable[[str], str | None],
                 hot_update: bool, storage_outage_s: Callable[[], float], rng: random.Random):
        self.loop, self.agents, self.model = loop, agents, model
        self.switch_of = switch_of                 # a machine's true leaf switch
        self.hot_update = hot_update               # the policy registers code versions (else requeues)
        self.storage_outage_s = storage_outage_s   # the profile's draw of a storage outage's length
        self.rng = rng                             # the loop's own stream (restart failures draw from it)
        self.bad: dict[str, Fault] = {}
        self.shown: dict[int, list[str]] = {}      # id(fault) -> machines it shows on in this run
        self.bugs: dict[int, str | None] = {}      # code version -> the bug it carries
        self.rngs: dict[int, random.Random] = {}
        self.injected: dict[str, int] = {}         # category -> faults injected
        self.pending_updates: list[Fault] = []
        self.version = 1
        self.storage_until = loop.now              # the storage service is out until then
        self.blame: Fault | None = None            # the fault behind the incident the core opens next

    # -- each fault's own luck --------------------------------------------------------------------
    def draw(self, f: Fault) -> float:
        return self.rngs.setdefault(f.seed, random.Random(f.seed)).random()

    def draw_exp(self, f: Fault, mean: float) -> float:
        return -mean * math.log(1.0 - self.draw(f))

    def active_faults(self) -> list[tuple[Fault, list[str]]]:
        by_id = {id(f): f for f in self.bad.values()}
        return [(by_id[k], ms) for k, ms in self.shown.items() if k in by_id]

    # -- the trace's happenings -------------------------------------------------------------------
    def inject(self, f: Fault) -> None:
        loop = self.loop
        self.injected[f.category] = self.injected.get(f.category, 0) + 1
        if f.kind == "update":
            self.update(f)
            return
        if f.kind == "planned":
            if loop.st is not None and not loop.st.terminal:
                loop.deliver(Cancel(reason="planned maintenance"))
            return
        if f.kind == "storage":
            self.storage_until = max(self.storage_until, loop.now + float(self.storage_outage_s()))
        tr = loop.training
        if f.kind == "user":          # the running code version fails (a data-dependent bug)
            self.bugs[self.version] = "exception"
            if tr is not None:
                self._bug("exception", self.version, tr, "user_code")
            return
        slots = tr.slots if tr is not None else loop.last_slots
        if not slots:
            return
        if f.switch is not None:
            under = set(f.switch)
            machines = [m for m in slots if self.switch_of(m) in under]
            if not machines:
                return
        else:
            machines = [slots[f.slot]]
        if f.persistent:
            for m in machines:
                self.bad[m] = f
        if tr is None or not tr.stepping or tr.begins > loop.now or loop.st is None \
                or loop.st.phase != S.JobPhase.RUNNING:
            return                                  # shows when its machine next runs (if persistent)
        self.show(f, machines)

    def show(self, f: Fault, machines: list[str]) -> None:
        self.loop.flush()
        self.blame = f
        self.shown[id(f)] = machines
        self.agents.manifest(f, machines)
        self.loop.changed()

    def recur(self, f: Fault, machine: str, run: Training) -> None:
        loop = self.loop
        tr = loop.training
        if (f.persistent and self.bad.get(machine) is not f) or tr is not run or not tr.stepping \
                or machine not in tr.slots or loop.st is None or loop.st.phase != S.JobPhase.RUNNING:
            return
        self.show(f, [machine])

    def _bug(self, kind: str, version: int, run: Training, category: str = "update") -> None:
        loop = self.loop
        tr = loop.training
        if tr is None or tr is not run or not tr.stepping or self.bugs.get(version) != kind or loop.st is None \
                or loop.st.phase != S.JobPhase.RUNNING:
            return
        loop.flush()
        self.blame = Fault(loop.now - loop.t0, category, "update", 0, False, bug=kind)
        self.agents.bug(kind, version)
        loop.changed()

    def update(self, f: Fault) -> None:
        """A code/data adjustment: a new version for a hot update, or a requeue without it."""
        loop = self.loop
        if loop.seg is None or loop.st is None or loop.st.terminal:
            self.pending_updates.append(f)
            return
        self.register(f)

    def register(self, f: Fault) -> None:
        self.version += 1
        self.bugs[self.version] = f.bug
        if self.hot_update:
            mode = "urgent" if f.urgent else "lazy"
            self.loop.deliver(VersionRegistered(row=self.loop.version_row(
                self.version, "urgent" if f.urgent else "pending", mode)))
        else:
            self.loop.deliver(Cancel(reason=f"requeue for code version {self.version}"))

    def submitted(self) -> None:
        """A new submission runs: the updates that came while none ran are registered now."""
        for f in self.pending_updates:
            self.register(f)
        self.pending_updates = []

    # -- a run starts -----------------------------------------------------------------------------
    def run_started(self, tr: Training, fo: float, first: bool) -> None:
        """Run `tr` steps after `fo` seconds: the faults of its machines come back (dead hardware
        and immediate faults at once, intermittent ones after `recur_mean_s` on average), a faulty
        code version fails in its first step, and a restart fails now and then on its own."""
        loop = self.loop
        self.shown = {}
        for m in tr.slots:
            f = self.bad.get(m)
            if f is not None:
                delay = 1.0 if f.hard or f.kind in IMMEDIATE else self.draw_exp(f, self.model.recur_mean_s)
                loop.later(fo + delay, self.recur, f, m, tr)
                if f.freezes:
                    loop.prewindow(loop.now + fo + delay, f.kind != "slow")
        bug = self.bugs.get(tr.version) if tr.version is not None else None
        if bug:                  # a faulty version fails in its first step
            loop.later(fo + 0.5 * tr.pace, self._bug, bug, tr.version, tr)
        elif not first and self.model.restart_fail_share and self.rng.random() < self.model.restart_fail_share:
            # the restart itself fails (a rendezvous or NCCL set-up error on some machine)
            slot = self.rng.randrange(len(tr.slots))
            loop.later(fo + 0.5 * tr.pace, self.recur, Fault(loop.now - loop.t0, "restart_failure", "crash", slot,
                                                            False, seed=self.rng.getrandbits(32)), tr.slots[slot], tr)
