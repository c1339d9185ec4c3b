"""Which step to restore and where each rank fetches it from (pure).

Every rank's checkpoint can live in three tiers: `own` (the shared memory of the machine that ran
the rank), `backup` (the memory of its backup peer, a machine sharing none of its parallel groups)
and `durable` (a directory or fsspec URL). After a stop, the newest step for which every rank has a
copy on a machine still in service (or on durable storage) wins; each rank gets its candidates in
order own -> backup -> durable, so the agent falls back tier by tier when a copy turns out corrupt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import AbstractSet, Iterable, Sequence

TIERS = ("own", "backup", "durable")


@dataclass
class Availability:
    """What the agents reported: rank -> tier -> step -> holder (machine id, or a durable URL)."""
    keep: int = 8
    copies: dict[int, dict[str, dict[int, str]]] = field(default_factory=dict)
    # memory tiers physically hold only this many complete steps: own, the rank's slots less the
    # one being written (policy.mem_slots - 1); backup, what the agent keeps beyond reports in flight
    memory: dict[str, int] = field(default_factory=lambda: {"own": 2, "backup": 2})

    @cached_property
    def _holders(self) -> dict[str, set[tuple[int, str]]]:
        """holder -> the (rank, tier) whose copies it may hold: every copy's (rank, tier) is under
        its holder (entries may be stale, never missing), so a machine's copies are found without
        looking at every rank. Not saved: rebuilt from `copies` after a load."""
        out: dict[str, set[tuple[int, str]]] = {}
        for rank, tiers in self.copies.items():
            for tier, steps in tiers.items():
                for holder in steps.values():
                    out.setdefault(holder, set()).add((rank, tier))
        return out

    def add(self, rank: int, tier: str, step: int, holder: str) -> None:
        self._put(rank, tier, (step,), holder)

    def _put(self, rank: int, tier: str, new: Iterable[int], holder: str) -> None:
        """`holder` has `new` steps of the rank's tier; the tier keeps its newest ones (trimming once
        after several steps leaves what trimming after each would)."""
        tiers = self.copies.get(rank)
        if tiers is None:
            tiers = self.copies[rank] = {}
        steps = tiers.get(tier)
        if steps is None:
            steps = tiers[tier] = {}
        for step in new:
            steps[step] = holder
        held = self._holders.get(holder)
        if held is None:
            held = self._holders[holder] = set()
        held.add((rank, tier))
        keep = min(self.keep, self.memory.get(tier, self.keep))
        if len(steps) > keep:
            for old in sorted(steps)[:-keep]:
                del steps[old]

    def _forget(self, machine: str, tiers: tuple[str, ...]) -> None:
        """Delete every copy of `tiers` that `machine` holds (each in its own rank's and tier's
        table: the order they are deleted in changes nothing)."""
        held = self._holders.get(machine)
        if not held:
            return
        for key in [x for x in held if x[1] in tiers]:
            steps = self.copies.get(key[0], {}).get(key[1])
            if steps:
                for s in [s for s, h in steps.items() if h == machine]:
                    del steps[s]
            held.discard(key)

    def replace_held(self, machine: str, tier: str, steps_by_rank: dict[int, list[int]]) -> None:
        """What `machine` really holds in a memory tier (its inventory when its workers stopped):
        reports still in flight can make the running record stale."""
        self._forget(machine, (tier,))
        for rank, steps in steps_by_rank.items():
            if steps:
                self._put(int(rank), tier, [int(s) for s in steps], machine)

    def replace_ranks(self, machine: str, tier: str, ranks: Iterable[int], steps: Sequence[int]) -> None:
        """`replace_held` where every rank holds the same steps (a whole-job stop report's column)."""
        self._forget(machine, (tier,))
        if steps:
            for rank in ranks:
                self._put(rank, tier, steps, machine)

    def replace_columns(self, tier: str, machines: Sequence[str], ranks: Sequence[Iterable[int]],
                        steps: Sequence[int]) -> None:
        """`replace_ranks(machines[i], tier, ranks[i], steps)` for every i in order (a whole-job
        stop report's column of one tier), in one pass: the same copies, without a call per
        machine and rank."""
        copies, index = self.copies, self._holders
        keep = min(self.keep, self.memory.get(tier, self.keep))
        steps = tuple(steps)
        for machine, rs in zip(machines, ranks):
            held = index.get(machine)
            if held:                    # `_forget(machine, (tier,))`
                for key in [x for x in held if x[1] == tier]:
                    tiers = copies.get(key[0])
                    by_step = tiers.get(tier) if tiers is not None else None
                    if by_step:
                        for s in [s for s, h in by_step.items() if h == machine]:
                            del by_step[s]
                    held.discard(key)
            if not steps:
                continue
            for rank in rs:             # `_put(rank, tier, steps, machine)`
                tiers = copies.get(rank)
                if tiers is None:
                    tiers = copies[rank] = {}
                by_step = tiers.get(tier)
                if by_step is None:
                    by_step = tiers[tier] = {}
                for s in steps:
                    by_step[s] = machine
                if held is None:
                    held = index[machine] = set()
                held.add((rank, tier))
                if len(by_step) > keep:
                    for old in sorted(by_step)[:-keep]:
                        del by_step[old]

    def held_steps(self) -> set[int]:
        """Every step some rank has a copy of, in any tier."""
        steps: set[int] = set()
        for tiers in self.copies.values():
            for by_step in tiers.values():
                steps.update(by_step)
        return steps

    def forget_after(self, step: int) -> None:
        """A run starts after `step`: the memory copies of later steps are the stopped run's (its
        agents drop their own slots of them). Kept, they would outrank the new run's copies of
        the same steps (the memory tiers keep only the newest few), and every restore until the
        new run passed them would fall back to durable storage."""
        for tiers in self.copies.values():
            for tier in ("own", "backup"):
                held = tiers.get(tier, {})
                for s in [s for s in held if s > step]:
                    del held[s]

    def drop_machine(self, machine: str) -> None:
        """A machine's memory is gone (lost, evicted, or its workers' slots reused)."""
        self._forget(machine, ("own", "backup"))


def candidates(av: Availability, rank: int, step: int, next_machine: str, alive: set[str]) -> list[dict]:
    """The valid copies of (rank, step), best first."""
    tiers = av.copies.get(rank, {})
    out = []
    holder = tiers.get("own", {}).get(step)
    if holder is not None and holder == next_machine and holder in alive:
        out.append({"tier": "own", "step": step, "holder": holder})
    holder = tiers.get("backup", {}).get(step)
    if holder is not None and holder in alive:
        out.append({"tier": "backup", "step": step, "holder": holder})
    loc = tiers.get("durable", {}).get(step)
    if loc is not None:
        out.append({"tier": "durable", "step": step, "location": loc})
    return out


def plan(av: Availability, world: int, next_machine: dict[int, str], alive: set[str],
         bad_steps: AbstractSet[int] = frozenset()) -> tuple[int, dict[int, list[dict]]]:
    """(step, rank -> candidates) for the newest step every rank can restore; (-1, {}) if none.
    (Each rank's candidates are `candidates`', found here without a call per rank.)"""
    copies = av.copies
    none: dict = {}
    for step in sorted(av.held_steps() - set(bad_steps), reverse=True):
        cands: dict[int, list[dict]] = {}
        for r in range(world):
            tiers = copies.get(r, none)
            got = []
            holder = tiers.get("own", none).get(step)
            if holder is not None and holder == next_machine[r] and holder in alive:
                got.append({"tier": "own", "step": step, "holder": holder})
            holder = tiers.get("backup", none).get(step)
            if holder is not None and holder in alive:
                got.append({"tier": "backup", "step": step, "holder": holder})
            loc = tiers.get("durable", none).get(step)
            if loc is not None:
                got.append({"tier": "durable", "step": step, "location": loc})
            if not got:
                break               # a rank without a copy of this step: an older step, then
            cands[r] = got
        else:
            return step, cands
    return -1, {}
