"""Which step to restore and where each rank fetches it from (pure).

Every rank's checkpoint can live in three tiers: `own` (the shared memory of the machine that ran
the rank), `backup` (the memory of its backup peer, a machine sharing none of its parallel groups)
and `durable` (a directory or fsspec URL). After a stop, the newest step for which every rank has a
copy on a machine still in service (or on durable storage) wins; each rank gets its candidates in
order own -> backup -> durable, so the agent falls back tier by tier when a copy turns out corrupt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import AbstractSet, Any, Iterable, Sequence

import numpy as np

TIERS = ("own", "backup", "durable")
EMPTY = np.iinfo(np.int64).min      # a free slot's step (below every real step: sorted first)
COMPACT_NAMES = 1024                # holder names kept before unused ones are first dropped


@dataclass
class Availability:
    """What the agents reported: rank -> tier -> step -> holder (machine id, or a durable URL).

    Held per tier as two arrays of one row per rank and one column per copy the tier keeps (a
    copy's step, and its holder as an index into the names seen): a whole-job stop report's
    column is one write, the restore plan one comparison per candidate step. `copies` is the
    saved form, built from the arrays when read (and read into them when given)."""
    keep: int = 8
    copies: dict[int, dict[str, dict[int, str]]] = field(default_factory=dict)
    # memory tiers physically hold only this many complete steps: own, the rank's slots less the
    # one being written (policy.mem_slots - 1); backup, what the agent keeps beyond reports in flight
    memory: dict[str, int] = field(default_factory=lambda: {"own": 2, "backup": 2})

    def __post_init__(self) -> None:
        given = self.__dict__.pop("copies")
        self._names: list[str] = []              # holder index -> machine id or durable location
        self._index: dict[str, int] = {}
        self._compact_at = COMPACT_NAMES        # names seen before those no copy refers to go
        self._rows = 0
        self._steps: dict[str, np.ndarray] = {}
        self._holder: dict[str, np.ndarray] = {}
        for tier in TIERS:
            k = self._keep(tier)
            self._steps[tier] = np.full((0, k), EMPTY, dtype=np.int64)
            self._holder[tier] = np.full((0, k), -1, dtype=np.int64)
        for rank, tiers in given.items():
            for tier, steps in tiers.items():
                for step, holder in sorted(steps.items()):
                    self._put([int(rank)], tier, [int(step)], [holder])

    def __getattr__(self, name: str) -> Any:
        """`copies`, built from the arrays: a field for the saved form (and the constructor), not
        kept as an attribute, so every read (a save included) sees what the arrays hold."""
        if name != "copies":
            raise AttributeError(name)
        out: dict[int, dict[str, dict[int, str]]] = {}
        names = self._names
        for tier, steps in self._steps.items():
            rows, cols = np.nonzero(steps != EMPTY)        # (row by row: a rank's copies in a run)
            last, table = -1, {}
            for r, s, h in zip(rows.tolist(), steps[rows, cols].tolist(), self._holder[tier][rows, cols].tolist()):
                if r != last:
                    last, table = r, out.setdefault(r, {}).setdefault(tier, {})
                table[s] = names[h]
        return out

    def _keep(self, tier: str) -> int:
        return min(self.keep, self.memory.get(tier, self.keep))

    def _tier(self, tier: str) -> tuple[np.ndarray, np.ndarray]:
        if tier not in self._steps:
            k = self._keep(tier)
            self._steps[tier] = np.full((self._rows, k), EMPTY, dtype=np.int64)
            self._holder[tier] = np.full((self._rows, k), -1, dtype=np.int64)
        return self._steps[tier], self._holder[tier]

    def _grow(self, rows: int) -> None:
        """Rows for the ranks below `rows` (a rank's row is its number)."""
        if rows <= self._rows:
            return
        add = max(rows, 2 * self._rows) - self._rows
        for tier in self._steps:
            k = self._steps[tier].shape[1]
            self._steps[tier] = np.concatenate([self._steps[tier], np.full((add, k), EMPTY, dtype=np.int64)])
            self._holder[tier] = np.concatenate([self._holder[tier], np.full((add, k), -1, dtype=np.int64)])
        self._rows += add

    def _ids(self, holders: Iterable[str]) -> np.ndarray:
        if len(self._names) >= self._compact_at:
            self._compact()
        index, names = self._index, self._names
        out = []
        for h in holders:
            i = index.get(h)
            if i is None:
                i = index[h] = len(names)
                names.append(h)
            out.append(i)
        return np.asarray(out, dtype=np.int64)

    def _compact(self) -> None:
        """Forget the names no copy refers to any more. Every durable copy has a location of its
        own, so a long job's names would grow without end; dropped each time their count doubles
        since the last time, the cost is one pass over the arrays per doubling."""
        live = np.unique(np.concatenate([h[h >= 0] for h in self._holder.values()] + [np.zeros(0, np.int64)]))
        remap = np.full(len(self._names) + 1, -1, dtype=np.int64)       # (+1: a free slot's -1 stays -1)
        remap[live] = np.arange(len(live), dtype=np.int64)
        for tier in self._holder:
            self._holder[tier] = remap[self._holder[tier]]
        self._names = [self._names[i] for i in live]
        self._index = {name: i for i, name in enumerate(self._names)}
        self._compact_at = max(COMPACT_NAMES, 2 * len(self._names))

    def _put(self, ranks: Sequence[int], tier: str, new: Iterable[int], holders: Sequence[str]) -> None:
        """Rank ranks[i]'s tier gets the `new` steps held by holders[i] (the ranks distinct); each
        keeps its newest copies: a step it had takes the new holder, then the oldest go past the
        tier's keep (trimming once after several steps leaves what trimming after each would)."""
        if len(ranks):
            self._put_ids(np.asarray(ranks, dtype=np.int64), tier, new, self._ids(holders))

    def _put_ids(self, rows: np.ndarray, tier: str, new: Iterable[int], holder_ids: np.ndarray) -> None:
        """`_put` with the holders as indices into the names (`_ids`)."""
        new_steps = np.asarray(sorted({int(s) for s in new}), dtype=np.int64)
        if not len(rows) or not len(new_steps):
            return
        self._grow(int(rows.max()) + 1)
        steps, holder = self._tier(tier)
        old_s, old_h = steps[rows], holder[rows]
        taken = np.isin(old_s, new_steps)                                  # the new holder's now
        old_s, old_h = np.where(taken, EMPTY, old_s), np.where(taken, -1, old_h)
        n = len(new_steps)
        all_s = np.concatenate([old_s, np.broadcast_to(new_steps, (len(rows), n))], axis=1)
        all_h = np.concatenate([old_h, np.broadcast_to(holder_ids[:, None], (len(rows), n))], axis=1)
        k = steps.shape[1]
        order = np.argsort(all_s, axis=1, kind="stable")[:, -k:]           # the newest k (free slots first)
        steps[rows] = np.take_along_axis(all_s, order, axis=1)
        holder[rows] = np.take_along_axis(all_h, order, axis=1)

    def _forget(self, machines: Iterable[str], tiers: tuple[str, ...]) -> None:
        """Delete every copy of `tiers` that one of `machines` holds."""
        ids = [self._index[m] for m in machines if m in self._index]
        if not ids:
            return
        for tier in tiers:
            if tier in self._steps:
                gone = np.isin(self._holder[tier], ids)
                self._steps[tier][gone] = EMPTY
                self._holder[tier][gone] = -1

    def add(self, rank: int, tier: str, step: int, holder: str) -> None:
        self._put([rank], tier, (step,), [holder])

    def add_column(self, tier: str, ranks: Sequence[int], step: int, holders: Sequence[str]) -> None:
        """`add(ranks[i], tier, step, holders[i])` for every i in order (every rank's report of
        one checkpoint), in one write where the ranks are distinct."""
        if len(set(ranks)) == len(ranks):
            self._put(ranks, tier, (step,), holders)
        else:
            for rank, holder in zip(ranks, holders):
                self.add(rank, tier, step, holder)

    def replace_held(self, machine: str, tier: str, steps_by_rank: dict[int, list[int]]) -> None:
        """What `machine` really holds in a memory tier (its inventory when its workers stopped):
        reports still in flight can make the running record stale."""
        self._forget((machine,), (tier,))
        for rank, steps in steps_by_rank.items():
            if steps:
                self._put([int(rank)], tier, [int(s) for s in steps], [machine])

    def replace_ranks(self, machine: str, tier: str, ranks: Iterable[int], steps: Sequence[int]) -> None:
        """`replace_held` where every rank holds the same steps (a whole-job stop report's column)."""
        self.replace_columns(tier, [machine], [ranks], steps)

    def replace_columns(self, tier: str, machines: Sequence[str], ranks: Sequence[Iterable[int]],
                        steps: Sequence[int]) -> None:
        """`replace_ranks(machines[i], tier, ranks[i], steps)` for every i in order (a whole-job
        stop report's column of one tier). One write where the machines are distinct, no rank is
        listed twice, and no listed rank holds a copy of a machine listed after its own: then
        forgetting every machine's copies first and writing every rank's after leaves what the
        machine-by-machine order does (otherwise it is that order, one machine at a time)."""
        cols = [rs if isinstance(rs, (list, tuple)) else list(rs) for rs in ranks]
        lengths = np.fromiter(map(len, cols), dtype=np.int64, count=len(cols))
        rows = np.fromiter(chain.from_iterable(cols), dtype=np.int64, count=int(lengths.sum()))
        # (whole columns: a 100,000-rank stop report's ranks are one array, not a list of them)
        distinct = not len(rows) or (int(rows.min()) >= 0 and int(np.bincount(rows).max()) <= 1)
        if len(set(machines)) == len(machines) and distinct and not self._later_holders(tier, machines, rows, lengths):
            self._forget(machines, (tier,))
            self._put_ids(rows, tier, steps, np.repeat(self._ids(machines), lengths))
            return
        for machine, rs in zip(machines, cols):
            self._forget((machine,), (tier,))
            self._put(rs, tier, steps, [machine] * len(rs))

    def _later_holders(self, tier: str, machines: Sequence[str], rows: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether some rank of machines[i] (`rows`, `lengths[i]` of them in order) holds a copy
        (in `tier`) of machines[j], j > i."""
        if tier not in self._steps or not self._rows:
            return False
        pos = np.full(len(self._names) + 1, -1, dtype=np.int64)        # holder index -> position (+1: none)
        for i, m in enumerate(machines):
            if m in self._index:
                pos[self._index[m]] = i
        mine = np.repeat(np.arange(len(machines), dtype=np.int64), lengths)
        inside = rows < self._rows
        rows, mine = rows[inside], mine[inside]
        if not len(rows):
            return False
        return bool((pos[self._holder[tier][rows]] > mine[:, None]).any())

    def held_steps(self) -> set[int]:
        """Every step some rank has a copy of, in any tier."""
        out: set[int] = set()
        for steps in self._steps.values():
            out.update(int(s) for s in np.unique(steps) if s != EMPTY)
        return out

    def forget_after(self, step: int) -> None:
        """A run starts after `step`: the memory copies of later steps are the stopped run's (its
        agents drop their own slots of them). Kept, they would outrank the new run's copies of
        the same steps (the memory tiers keep only the newest few), and every restore until the
        new run passed them would fall back to durable storage."""
        for tier in ("own", "backup"):
            if tier in self._steps:
                gone = self._steps[tier] > step
                self._steps[tier][gone] = EMPTY
                self._holder[tier][gone] = -1

    def drop_machine(self, machine: str) -> None:
        """A machine's memory is gone (lost, evicted, or its workers' slots reused)."""
        self._forget((machine,), ("own", "backup"))

    def copies_of(self, rank: int, step: int, next_machine: str, alive: AbstractSet[str]) -> list[dict]:
        """The valid copies of (rank, step), best first (see `candidates`)."""
        if rank >= self._rows:
            return []
        return self._plan_at(rank + 1, [next_machine] * (rank + 1), alive, step, only=rank) or []

    def plan(self, world: int, next_machine: Sequence[str], alive: AbstractSet[str],
             bad_steps: AbstractSet[int]) -> tuple[int, dict[int, list[dict]]]:
        """`plan` (see there), each candidate step one comparison per tier."""
        step, cols = self.plan_columns(world, next_machine, alive, bad_steps)
        if step < 0 or world == 0:
            return step, {}
        out: dict[int, list[dict]] = {r: [] for r in range(world)}
        for tier, has, who in cols:      # (in tier order: own, backup, durable)
            for r in range(world):
                if has[r]:
                    out[r].append(_copy_dict(tier, step, who[r]))
        return step, out

    def plan_columns(self, world: int, next_machine: Sequence[str], alive: AbstractSet[str],
                     bad_steps: AbstractSet[int]) -> tuple[int, list[tuple[str, list[bool], list[str]]]]:
        """`plan` as columns: (step, [(tier, has, holder)] in tier order), rank r having a copy in
        `tier` where has[r], held by (or, durable, at) holder[r]; (-1, []) when no step will do.
        What a restart of every rank reads without a list of copies per rank in between."""
        for step in sorted(self.held_steps() - set(bad_steps), reverse=True):
            if world == 0:
                return step, []
            if world > self._rows:
                break
            got = self._plan_at(world, next_machine, alive, step)
            if got is not None:
                return step, got
        return -1, []

    def _plan_at(self, world: int, next_machine: Sequence[str], alive: AbstractSet[str], step: int,
                 only: int | None = None) -> Any:
        """Every rank's valid copies of `step` as columns (see `plan_columns`), or None when some
        rank below `world` has none; with `only`, that rank's list alone, whatever the others hold."""
        alive_ids = np.zeros(len(self._names) + 1, dtype=bool)      # (+1: a free slot's -1)
        for m in alive:
            i = self._index.get(m)
            if i is not None:
                alive_ids[i] = True
        nxt = np.asarray([self._index.get(m, -2) for m in next_machine], dtype=np.int64)
        found, names = {}, self._names
        ok = np.zeros(world, dtype=bool)
        for tier in TIERS:
            if tier not in self._steps:
                continue
            steps, holder = self._steps[tier][:world], self._holder[tier][:world]
            hit = steps == step
            if tier == "backup":
                hit &= alive_ids[holder]
            elif tier == "own":
                hit &= alive_ids[holder] & (holder == nxt[:, None])
            has = hit.any(axis=1)
            ok |= has
            who = np.take_along_axis(holder, hit.argmax(axis=1)[:, None], axis=1)[:, 0]
            found[tier] = (has, who)
        if only is not None:
            return [_copy_dict(tier, step, names[int(who[only])]) for tier, (has, who) in found.items()
                    if has[only]]
        if not ok.all():
            return None
        table = np.asarray(names + [""], dtype=object)      # (a free slot's -1: the last, never read)
        return [(tier, has.tolist(), table[who].tolist()) for tier, (has, who) in found.items()]


def _copy_dict(tier: str, step: int, holder: str) -> dict:
    if tier == "durable":
        return {"tier": tier, "step": step, "location": holder}
    return {"tier": tier, "step": step, "holder": holder}


def candidates(av: Availability, rank: int, step: int, next_machine: str, alive: set[str]) -> list[dict]:
    """The valid copies of (rank, step), best first: own (on the machine that will run the rank),
    backup (a machine in service), durable."""
    return av.copies_of(rank, step, next_machine, alive)


def plan(av: Availability, world: int, next_machine: dict[int, str], alive: set[str],
         bad_steps: AbstractSet[int] = frozenset()) -> tuple[int, dict[int, list[dict]]]:
    """(step, rank -> candidates) for the newest step every rank can restore; (-1, {}) if none."""
    return av.plan(world, [next_machine[r] for r in range(world)], alive, bad_steps)
