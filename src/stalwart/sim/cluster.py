"""The simulated cluster: machines with switch and pod labels, which are alive, which are free, and
new machines arriving for the standby pool. It is the job core's `ClusterView`.

Layout: 8-GPU machines, a leaf switch per 4 machines (one NIC per GPU fills a 32-port leaf), a pod
per 32 switches (128 machines under one spine). The job's machines are placed the way a
topology-aware scheduler (Arnold) places a pipeline-parallel job: each pipeline (PP group) on
adjacent machines, so a pipeline of 8 stages spans 2 switches of one pod. Free machines (standbys,
replacements) sit in the same racks, spread over the pods. A standby that replaces a machine far
from its pipeline slows every step (`slowdown`): crossing a switch a little, crossing the spine
more (Arnold measured up to 70% less send/recv bandwidth across minipods).
"""
from __future__ import annotations

import random
from typing import AbstractSet, Iterable

MACHINES_PER_SWITCH = 4
SWITCHES_PER_POD = 32
# step-time penalty of a slot whose machine is 0: under its pipeline's switch, 1: in its pod,
# 2: elsewhere (assumptions, after Arnold: intra-minipod placement barely matters, <= 0.3%)
PENALTY = (0.0, 0.003, 0.03)


def job_labels(slot: int, pp: int, dp: int) -> dict[str, str]:
    """Where the job's slot-th machine sits: slot = dp_index + DP * stage (Megatron's order with
    the TP group inside the machine); pipelines are laid out side by side."""
    loc = (slot % dp) * pp + slot // dp
    switch = loc // MACHINES_PER_SWITCH
    return {"switch": f"s{switch}", "pod": f"p{switch // SWITCHES_PER_POD}"}


class SimCluster:
    """Machines `m0 …`: the job's first, then free ones. Implements ClusterView."""

    def __init__(self, job_machines: int, pp: int, dp: int, free: int, seed: int, show_labels: bool = True):
        self.now = 0.0
        self.show_labels = show_labels
        self.rng = random.Random(seed ^ 0x5EED)
        self._labels: dict[str, dict[str, str]] = {}
        self.dead_at: dict[str, float] = {}
        self.busy: set[str] = set()
        self.out: set[str] = set()           # evicted: gone for repair
        self.order: list[str] = []
        self._free: list[str] | None = None      # cached free() (the pool asks every second)
        for i in range(job_machines):
            self._add(f"m{i}", job_labels(i, pp, dp))
        switches = (job_machines * 1.0 / MACHINES_PER_SWITCH)
        self.switches = max(1, int(switches + 0.999))
        self.pods = max(1, (self.switches + SWITCHES_PER_POD - 1) // SWITCHES_PER_POD)
        for _ in range(free):
            self.new_machine()

    def _add(self, name: str, labels: dict[str, str]) -> None:
        self._labels[name] = labels
        self.order.append(name)
        self._free = None

    def new_machine(self) -> str:
        """A machine joins the free pool, in a rack of a pod chosen in turn (spread over pods)."""
        k = len(self.order)
        pod = k % self.pods
        first = pod * SWITCHES_PER_POD
        switch = self.rng.randrange(first, min(first + SWITCHES_PER_POD, self.switches))
        name = f"m{k}"
        self._add(name, {"switch": f"s{switch}", "pod": f"p{pod}"})
        return name

    # -- ClusterView ----------------------------------------------------------------------------
    def alive(self, machine: str) -> bool:
        return machine in self._labels and machine not in self.dead_at and machine not in self.out

    def last_heard(self, machine: str) -> float | None:
        return self.dead_at.get(machine, self.now)

    def freshest(self, machines: Iterable[str]) -> float | None:
        """Any live machine was heard just now (simulated agents beat without fail): the scan stops
        at the first one."""
        latest = None
        for m in machines:
            dead = self.dead_at.get(m)
            if dead is None:
                return self.now
            latest = dead if latest is None else max(latest, dead)
        return latest

    def unheard_since(self, machines: AbstractSet[str], t: float) -> dict[str, float | None]:
        """Only a dead machine falls silent: the few dead ones are looked at, not every machine."""
        if t >= self.now:
            return {m: h for m in machines if (h := self.dead_at.get(m, self.now)) <= t}
        return {m: at for m, at in self.dead_at.items() if at <= t and m in machines}

    def beat_late_s(self) -> float:
        return 0.0          # simulated heartbeats are never late

    def free(self) -> list[str]:
        if self._free is None:
            self._free = [m for m in self.order if m not in self.busy and m not in self.dead_at and m not in self.out]
        return list(self._free)

    def labels(self, machine: str) -> dict[str, str]:
        return dict(self._labels.get(machine, {})) if self.show_labels else {}

    # -- the simulator's side -------------------------------------------------------------------
    def true_labels(self, machine: str) -> dict[str, str]:
        return self._labels.get(machine, {})

    def kill(self, machine: str) -> None:
        self.dead_at.setdefault(machine, self.now)
        self._free = None

    def assign(self, machine: str, state: str) -> None:
        self._free = None
        if state == "idle":
            self.busy.discard(machine)
        elif state == "evicted":
            self.busy.discard(machine)
            self.out.add(machine)
        else:
            self.busy.add(machine)
