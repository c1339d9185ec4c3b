"""Rank <-> machine <-> parallel-group arithmetic for one job's layout.

Ranks follow Megatron's default order ``tp-cp-ep-dp-pp``: tp varies fastest, pp
slowest, so ``rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp)))``.  Machine ``m``
holds ranks ``m*G .. m*G+G-1``.  Two ranks are in the same group of kind ``k``
exactly when their coordinates agree on every kind except ``k``.

Everything here is pure arithmetic over the layout; the one cached table (the
backup plan) is derived from the layout alone and lives on the instance.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Any

KINDS = ("tp", "cp", "ep", "dp", "pp")

# Tie-break order of shared_group: the narrower fault domain kinds first.
_SHARED_ORDER = ("tp", "cp", "ep", "pp", "dp")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")
    return value


class Topology:
    """The parallel layout of a job: ``machines`` x ``gpus_per_machine`` ranks split as
    tp x cp x ep x dp x pp, with rank order tp-cp-ep-dp-pp (tp fastest)."""

    def __init__(self, machines: int, gpus_per_machine: int, tp: int = 1, pp: int = 1,
                 dp: int = 1, cp: int = 1, ep: int = 1):
        self.machines = _positive_int("machines", machines)
        self.gpus_per_machine = _positive_int("gpus-per-machine", gpus_per_machine)
        self.tp = _positive_int("tp", tp)
        self.pp = _positive_int("pp", pp)
        self.dp = _positive_int("dp", dp)
        self.cp = _positive_int("cp", cp)
        self.ep = _positive_int("ep", ep)
        self.world_size = machines * gpus_per_machine
        shown = ["tp", "pp", "dp"] + [k for k in ("cp", "ep") if getattr(self, k) != 1]
        product = 1
        for k in shown:
            product *= getattr(self, k)
        if product != self.world_size:
            names = "*".join(shown)
            values = "*".join(str(getattr(self, k)) for k in shown)
            raise ValueError(
                f"{names} must equal machines*gpus-per-machine "
                f"({values}={product}, {machines}*{gpus_per_machine}={self.world_size})")
        self._sizes = {k: getattr(self, k) for k in KINDS}
        stride = 1
        self._strides: dict[str, int] = {}
        for k in KINDS:
            self._strides[k] = stride
            stride *= self._sizes[k]

    # ----------------------------------------------------------------- basics
    def __repr__(self) -> str:
        extra = "".join(f", {k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) != 1)
        return (f"Topology(machines={self.machines}, gpus_per_machine={self.gpus_per_machine}, "
                f"tp={self.tp}, pp={self.pp}, dp={self.dp}{extra})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def key(self) -> tuple[int, ...]:
        """The layout as plain numbers (machines, gpus per machine, then every kind's size)."""
        return (self.machines, self.gpus_per_machine) + tuple(self._sizes[k] for k in KINDS)

    _key = key

    def describe(self) -> str:
        """One-line human summary, e.g. ``"tp=2 pp=2 dp=2 (4 machines x 2)"``."""
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) != 1]
        noun = "machine" if self.machines == 1 else "machines"
        return f"{' '.join(parts)} ({self.machines} {noun} x {self.gpus_per_machine})"

    def size(self, kind: str) -> int:
        """Size of a group of ``kind`` (one of KINDS)."""
        self._check_kind(kind)
        return self._sizes[kind]

    def _check_kind(self, kind: str) -> None:
        if kind not in self._sizes:
            raise ValueError(f"unknown parallel kind {kind!r} (expected one of {', '.join(KINDS)})")

    def _check_rank(self, rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an integer in 0..{self.world_size - 1} (got {rank!r})")
        return rank

    def _check_machine(self, machine: Any) -> int:
        if (isinstance(machine, bool) or not isinstance(machine, int)
                or not 0 <= machine < self.machines):
            raise ValueError(
                f"machine must be an integer in 0..{self.machines - 1} (got {machine!r})")
        return machine

    # ------------------------------------------------------- rank <-> coords
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``: ``{"tp":.., "cp":.., "ep":.., "dp":.., "pp":..}``."""
        rest = self._check_rank(rank)
        out: dict[str, int] = {}
        for k in KINDS:
            rest, out[k] = divmod(rest, self._sizes[k])
        return out

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates; missing coordinates are 0."""
        rank = 0
        for k, v in coords.items():
            self._check_kind(k)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self._sizes[k]:
                raise ValueError(f"{k} coordinate must be in 0..{self._sizes[k] - 1} (got {v!r})")
            rank += v * self._strides[k]
        return rank

    def machine_of(self, rank: int) -> int:
        """Machine that holds ``rank``."""
        return self._check_rank(rank) // self.gpus_per_machine

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` among its machine's GPUs."""
        return self._check_rank(rank) % self.gpus_per_machine

    def ranks_of_machine(self, machine: int) -> list[int]:
        """Global ranks held by ``machine``, ascending."""
        first = self._check_machine(machine) * self.gpus_per_machine
        return list(range(first, first + self.gpus_per_machine))

    def machines_of(self, ranks: Iterable[int]) -> list[int]:
        """Sorted unique machines holding ``ranks``."""
        return sorted({self.machine_of(r) for r in ranks})

    # ------------------------------------------------------------- groups
    def group(self, kind: str, rank: int) -> tuple[int, ...]:
        """Sorted global ranks of ``rank``'s group of ``kind`` (``rank`` included)."""
        self._check_kind(kind)
        self._check_rank(rank)
        stride, n = self._strides[kind], self._sizes[kind]
        base = rank - ((rank // stride) % n) * stride
        return tuple(base + i * stride for i in range(n))

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """All groups of ``kind``, ordered by their lowest rank (so ``groups(k)[group_id(k, r)]``
        is ``group(k, r)``)."""
        self._check_kind(kind)
        stride, n = self._strides[kind], self._sizes[kind]
        out = []
        for high in range(self.world_size // (stride * n)):
            for low in range(stride):
                base = low + stride * n * high
                out.append(tuple(base + i * stride for i in range(n)))
        return out

    def group_id(self, kind: str, rank: int) -> int:
        """Index of ``rank``'s group in ``groups(kind)``."""
        self._check_kind(kind)
        self._check_rank(rank)
        stride, n = self._strides[kind], self._sizes[kind]
        low = rank % stride
        high = rank // (stride * n)
        return low + stride * high

    def shares_group(self, a: int, b: int) -> bool:
        """True when ranks ``a`` and ``b`` are in one group of some kind (or are equal)."""
        ca, cb = self.coords(a), self.coords(b)
        return sum(ca[k] != cb[k] for k in KINDS) <= 1

    def shared_group(self, ranks: Iterable[int]) -> tuple[str, list[int]] | None:
        """The fault domain shared by a set of (outlier) ranks.

        Among all groups of every kind whose size is > 1, keep those whose machines cover
        every machine of ``ranks``; return ``(kind, machines)`` of the one with the fewest
        machines, ties broken by kind order tp, cp, ep, pp, dp (then lowest group id).
        None when no group covers them.  Kinds of size 1 are not groups and never returned.
        """
        target = self.machines_of(ranks)
        if not target:
            raise ValueError("shared_group needs at least one rank")
        wanted = set(target)
        best: tuple[int, int, int] | None = None
        best_answer: tuple[str, list[int]] | None = None
        # A covering group has a rank on target[0]; only those groups are candidates.
        for order, kind in enumerate(_SHARED_ORDER):
            if self._sizes[kind] == 1:
                continue
            for r in self.ranks_of_machine(target[0]):
                ms = self._group_machines(kind, r)
                if not wanted <= ms:
                    continue
                key = (len(ms), order, self.group_id(kind, r))
                if best is None or key < best:
                    best, best_answer = key, (kind, sorted(ms))
        return best_answer

    def _group_machines(self, kind: str, rank: int) -> frozenset[int]:
        gid = self.group_id(kind, rank)
        cache = self._machines_cache
        key = (kind, gid)
        if key not in cache:
            g = self.gpus_per_machine
            cache[key] = frozenset(r // g for r in self.group(kind, rank))
        return cache[key]

    @cached_property
    def _machines_cache(self) -> dict[tuple[str, int], frozenset[int]]:
        return {}

    # ------------------------------------------------------------- backups
    def backup_peer(self, rank: int) -> int:
        """A rank on another machine that shares none of ``rank``'s groups, deterministic.

        Preference order (each machine is planned as a whole):
        1. a peer machine none of whose ranks shares a group with any rank of this machine
           (so over-evicting any group of this machine's ranks never takes the peer machine),
           same local rank, paired symmetrically where possible (the first candidates come from
           involutions that move every coordinate, by half its size where it is even; this
           reproduces the paper's Fig. 9 pairs);
        2. one peer machine for the whole machine with a rotated local rank such that each
           rank's peer shares none of its groups (again symmetric where possible);
        3. per rank, the first rank on another machine that shares none of its groups;
        4. when no such rank exists (pure DP, ...), the same local rank on machine (m+1) % machines.
        """
        self._check_rank(rank)
        if self.machines < 2:
            raise ValueError("backup needs at least 2 machines")
        return self._backup_plan[rank]

    def backup_machine(self, machine: int) -> int:
        """Machine that holds ``machine``'s backups (the machine of its local rank 0's backup
        peer; every rank of the machine backs up there unless the layout forbids it, see
        ``backup_machines``)."""
        self._check_machine(machine)
        return self.machine_of(self.backup_peer(machine * self.gpus_per_machine))

    def backup_machines(self, machine: int) -> list[int]:
        """Sorted machines holding backups of ``machine``'s ranks (one machine in all but rare
        layouts)."""
        return self.machines_of(self.backup_peer(r) for r in self.ranks_of_machine(machine))

    def _paired(self, rank: int, pivot: str) -> int:
        """Image of ``rank`` under an involution that changes every non-trivial coordinate:
        the even-sized ``pivot`` moves by half its size; every other coordinate moves by half
        its size (even) or by +1/-1 (odd), the sign set by which half the pivot is in."""
        c = self.coords(rank)
        n_p = self._sizes[pivot]
        half = n_p // 2
        sign = 1 if c[pivot] < half else -1
        out = {}
        for k in KINDS:
            n = self._sizes[k]
            if k == pivot:
                out[k] = (c[k] + half) % n
            else:
                out[k] = (c[k] + (n // 2 if n % 2 == 0 else sign)) % n
        return self.rank_of(**out)

    def _involution_images(self, rank: int) -> Iterator[int]:
        """Images of ``rank`` under each pivot (outermost even-sized kind first); with no
        even-sized kind, every coordinate moves by +1."""
        pivots = [k for k in reversed(KINDS) if self._sizes[k] % 2 == 0]
        for k in pivots:
            yield self._paired(rank, k)
        if not pivots:
            c = self.coords(rank)
            yield self.rank_of(**{k: (c[k] + 1) % self._sizes[k] for k in KINDS})

    def _machine_candidates(self, m: int) -> Iterator[int]:
        g = self.gpus_per_machine
        seen = {m}
        for image in self._involution_images(m * g):
            if image // g not in seen:
                seen.add(image // g)
                yield image // g
        for j in range(1, self.machines):
            b = (m + j) % self.machines
            if b not in seen:
                yield b

    def _strict_ok(self, m: int, b: int) -> bool:
        """No rank of ``b`` shares a group with any rank of ``m`` (symmetric in m, b)."""
        return b != m and all(b not in ms for ms in self._machine_group_machines[m])

    @cached_property
    def _machine_group_machines(self) -> list[list[frozenset[int]]]:
        out = []
        for m in range(self.machines):
            seen: dict[tuple[str, int], frozenset[int]] = {}
            for r in self.ranks_of_machine(m):
                for k in KINDS:
                    if self._sizes[k] > 1:
                        seen.setdefault((k, self.group_id(k, r)), self._group_machines(k, r))
            out.append(list(seen.values()))
        return out

    def _rotation_ok(self, m: int, b: int, t: int) -> bool:
        g = self.gpus_per_machine
        return b != m and all(
            not self.shares_group(m * g + j, b * g + (j + t) % g) for j in range(g))

    def _pair_greedily(self, todo: list[int], ok) -> dict[int, tuple[int, int]]:
        """Symmetric greedy matching of machines in ``todo`` (ascending), then a one-way
        choice for the rest; ``ok(m, b)`` returns a local rotation t or None."""
        chosen: dict[int, tuple[int, int]] = {}
        pending = set(todo)
        for m in todo:
            if m not in pending:
                continue
            for b in self._machine_candidates(m):
                if b in pending and b != m:
                    t = ok(m, b)
                    if t is not None:
                        chosen[m] = (b, t)
                        chosen[b] = (m, (-t) % self.gpus_per_machine)
                        pending -= {m, b}
                        break
        for m in todo:
            if m in chosen:
                continue
            for b in self._machine_candidates(m):
                t = ok(m, b)
                if t is not None:
                    chosen[m] = (b, t)
                    break
        return chosen

    def _weak_possible(self, rank: int) -> bool:
        """Some rank on another machine shares none of ``rank``'s groups (counted, not listed:
        the groups of a rank meet only in the rank itself)."""
        blocked = 1 + sum(n - 1 for n in self._sizes.values())
        blocked += sum(1 for s in self.ranks_of_machine(rank // self.gpus_per_machine)
                       if not self.shares_group(rank, s))
        return blocked < self.world_size

    @cached_property
    def _backup_plan(self) -> list[int]:
        g, n = self.gpus_per_machine, self.machines
        plan = [-1] * self.world_size
        # Tier 1: a strictly separate machine, same local rank.
        tier1 = [m for m in range(n)
                 if not any(len(ms) == n for ms in self._machine_group_machines[m])]
        strict = self._pair_greedily(tier1, lambda m, b: 0 if self._strict_ok(m, b) else None)
        # Tier 2: one machine with a rotated local rank.
        rest = [m for m in range(n) if m not in strict
                and all(self._weak_possible(r) for r in self.ranks_of_machine(m))]

        def rotation(m: int, b: int) -> int | None:
            return next((t for t in range(g) if self._rotation_ok(m, b, t)), None)

        rotated = self._pair_greedily(rest, rotation)
        for m, (b, t) in {**strict, **rotated}.items():
            for j in range(g):
                plan[m * g + j] = b * g + (j + t) % g
        # Tiers 3 and 4: per rank.
        for r in range(self.world_size):
            if plan[r] < 0:
                plan[r] = self._single_peer(r)
        return plan

    def _single_peer(self, rank: int) -> int:
        g, n = self.gpus_per_machine, self.machines
        m, local = divmod(rank, g)
        if self._weak_possible(rank):
            for image in self._involution_images(rank):
                if image // g != m and not self.shares_group(rank, image):
                    return image
            for j in range(1, n):
                b = (m + j) % n
                for t in range(g):
                    cand = b * g + (local + t) % g
                    if not self.shares_group(rank, cand):
                        return cand
        return ((m + 1) % n) * g + local


def from_spec(spec: Any) -> Topology:
    """Topology of a job spec (any object with machines, gpus_per_machine, tp, pp, dp, cp, ep)."""
    return Topology(spec.machines, spec.gpus_per_machine, tp=spec.tp, pp=spec.pp, dp=spec.dp,
                    cp=getattr(spec, "cp", 1), ep=getattr(spec, "ep", 1))
