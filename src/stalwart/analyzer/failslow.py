"""Fail-slow (MFU decline) localization (ByteRobust §5, papers.md §1.6).

A slow machine does not stop the job, it drags it: stacks differ only now and
then.  So stack aggregation is repeated (every 10 s in the paper); each round
flags the parallel group holding the most outliers; after 5 rounds the group with
the most cumulative flags is the degrader and is over-evicted.

Groups are compared as fault domains: a group is the set of machines its ranks
live on, and "outliers in a group" counts the outlier ranks located on those
machines.  Two groups of one kind on the same machines (the tp=0 and tp=1 copies
of a pipeline) are one domain.  Ties: fewest machines, then kind order tp, cp,
ep, pp, dp (narrowest fault domain first), then lowest machines.

Also two pure signals that start the rounds: :func:`throughput_drop` on the step
times, and :func:`slow_ranks` from per-rank compute/wait split.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Iterable, Mapping, Sequence

KIND_ORDER = ("tp", "cp", "ep", "pp", "dp")

Domain = tuple[str, tuple[int, ...]]  # (kind, machines)


def domains(topo: Any) -> list[Domain]:
    """Every distinct (kind, machines) fault domain of a topology (groups of size > 1)."""
    seen: dict[Domain, None] = {}
    for kind in KIND_ORDER:
        if topo.size(kind) == 1:
            continue
        for g in topo.groups(kind):
            seen.setdefault((kind, tuple(topo.machines_of(g))), None)
    return list(seen)


def _order(d: Domain) -> tuple:
    return (len(d[1]), KIND_ORDER.index(d[0]), d[1])


def flag_round(outliers: Iterable[int], topo: Any) -> Domain | None:
    """The domain holding the most outlier ranks (ties: fewest machines, kind order)."""
    per_machine = Counter(topo.machine_of(r) for r in outliers)
    if not per_machine:
        return None
    best, best_key = None, None
    for d in domains(topo):
        count = sum(per_machine[m] for m in d[1])
        if count == 0:
            continue
        key = (-count,) + _order(d)
        if best_key is None or key < best_key:
            best, best_key = d, key
    return best


@dataclass
class FailSlowRounds:
    """Cumulative flags over aggregation rounds; a verdict after ``rounds`` rounds.

    Only the last ``rounds`` rounds count (a sliding window), so a job that keeps
    sampling gets a fresh verdict each round once the window is full.
    """

    rounds: int = 5
    history: list[tuple[float, Domain | None]] = field(default_factory=list)
    # the layout the rounds were taken on (Topology's key), kept as plain data so the rounds can
    # be saved with the job's state
    topo_key: tuple[int, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds!r}")

    def add_round(self, agg_outliers: Sequence[int], topo: Any, now: float) -> Domain | None:
        """Record one aggregation round's outliers at time ``now``; return the flagged domain."""
        key = topo.key()
        if self.topo_key is not None and tuple(self.topo_key) != key:
            raise ValueError("fail-slow rounds must all use the same topology")
        if self.history and now < self.history[-1][0]:
            raise ValueError(f"rounds must move forward in time ({now} < {self.history[-1][0]})")
        self.topo_key = key
        flagged = flag_round(agg_outliers, topo)
        self.history.append((now, flagged))
        return flagged

    def flags(self) -> Counter:
        """Flag count per domain over the counted (last ``rounds``) rounds."""
        return Counter(d for _, d in self.history[-self.rounds:] if d is not None)

    @property
    def ready(self) -> bool:
        """True once ``rounds`` rounds have been recorded."""
        return len(self.history) >= self.rounds

    def verdict(self, min_flags: int = 1) -> tuple[str, list[int]] | None:
        """``(kind, machines)`` of the most-flagged domain, or None (not ready / nothing flagged,
        or the most-flagged domain flagged in fewer than ``min_flags`` of the counted rounds: on a
        busy host each round's stacks catch some rank mid-step, a different one each time)."""
        flags = self.flags()
        if not self.ready or not flags:
            return None
        kind, machines = min(flags, key=lambda d: (-flags[d],) + _order(d))
        if flags[(kind, machines)] < min_flags:
            return None
        return kind, list(machines)


def throughput_drop(step_times: Sequence[float], baseline_n: int = 20, recent_n: int = 5,
                    drop: float = 0.3, reference_s: float | None = None) -> bool:
    """True when the last ``recent_n`` steps run at < (1 - drop) of the baseline throughput.

    Baseline: median step time of the ``baseline_n`` steps just before the recent
    ones, or ``reference_s`` (a healthy pace seen earlier, see :func:`healthy_pace`)
    when that is faster; recent: median of the last ``recent_n``.  Medians ignore a
    lone slow step (a checkpoint, a GC pause).  False until enough steps exist.
    """
    if baseline_n < 1 or recent_n < 1:
        raise ValueError(f"baseline_n and recent_n must be >= 1 (got {baseline_n}, {recent_n})")
    if not 0 < drop < 1:
        raise ValueError(f"drop must be a fraction in (0, 1), got {drop}")
    if any(t <= 0 for t in step_times):
        raise ValueError("step times must be positive")
    if len(step_times) < baseline_n + recent_n:
        return False
    recent = median(step_times[-recent_n:])
    return 1.0 / recent < (1.0 - drop) / baseline_pace(step_times, baseline_n, recent_n, reference_s)


def baseline_pace(step_times: Sequence[float], baseline_n: int = 20, recent_n: int = 5,
                  reference_s: float | None = None) -> float:
    """The step time :func:`throughput_drop` compares against: the median of the ``baseline_n``
    steps before the last ``recent_n``, or ``reference_s`` when that is faster."""
    if len(step_times) < baseline_n + recent_n:
        raise ValueError(f"need {baseline_n + recent_n} step times, got {len(step_times)}")
    base = median(step_times[-(baseline_n + recent_n):-recent_n])
    if reference_s is None:
        return base
    if reference_s <= 0:
        raise ValueError(f"reference_s must be positive, got {reference_s}")
    return min(base, reference_s)


def healthy_pace(reference_s: float | None, step_times: Sequence[float], baseline_n: int = 20) -> float | None:
    """The fastest ``baseline_n``-step median step time seen so far: ``reference_s`` updated with
    the latest window (None until a window is full).

    Kept across a quiet period, it lets a machine that slowed down while nobody looked be found
    later, when the steps just before the recent ones are already slow."""
    if len(step_times) < baseline_n:
        return reference_s
    window = median(step_times[-baseline_n:])
    return window if reference_s is None else min(reference_s, window)


def cpu_slowdown(healthy_wait: float | None, wait: float | None) -> float | None:
    """How many times slower the same CPU work runs when its processes wait for a CPU `wait` of
    their runnable time instead of `healthy_wait` (the agents' `cpu_wait`): a process that gets
    the CPU a share (1 - w) of the time it wants it takes 1 / (1 - w) as long. None without both."""
    if healthy_wait is None or wait is None:
        return None
    return (1.0 - min(healthy_wait, 0.99)) / (1.0 - min(wait, 0.99))


def healthy_step_s(step_times: Sequence[float], recent_n: int = 5, baseline_s: float | None = None) -> float | None:
    """The pace `slowdown` compares the last ``recent_n`` steps with: the median of the fastest
    ``recent_n``-step stretch before them, or ``baseline_s`` when that is faster (None: fewer
    than ``2 * recent_n`` steps)."""
    if len(step_times) < 2 * recent_n:
        return None
    before = step_times[:-recent_n]
    best = min(median(before[i:i + recent_n]) for i in range(len(before) - recent_n + 1))
    return best if baseline_s is None else min(best, baseline_s)


def slowdown(step_times: Sequence[float], recent_n: int = 5, baseline_s: float | None = None) -> float:
    """How many times slower the last ``recent_n`` steps run (their median) than the fastest
    ``recent_n``-step stretch before them, or ``baseline_s`` when that is faster (1.0 when
    there is nothing to compare)."""
    best = healthy_step_s(step_times, recent_n, baseline_s)
    if best is None:
        return 1.0
    return median(step_times[-recent_n:]) / best if best > 0 else 1.0


def slowdown_exceeds(step_times: Sequence[float], factor: float, recent_n: int = 5,
                     baseline_s: float | None = None) -> bool:
    """``slowdown(step_times, recent_n, baseline_s) >= factor``, without the median of every
    ``recent_n``-step stretch where none can be fast enough (the controller asks after every
    committed step, over up to 200 steps: 195 medians a step).

    The slowdown reaches ``factor`` when the baseline or some stretch's median is at most
    ``recent / factor``, and a stretch's median is only that low when more than half of its
    steps are (half of an even stretch): with fewer such steps in all, no stretch is."""
    if len(step_times) < 2 * recent_n or factor <= 0 or min(step_times) <= 0:
        return slowdown(step_times, recent_n, baseline_s) >= factor
    limit = median(step_times[-recent_n:]) / factor
    if baseline_s is not None and 0 < baseline_s <= limit:
        return True
    if sum(1 for t in step_times[:-recent_n] if t <= limit) < (recent_n + 1) // 2:
        return False
    return slowdown(step_times, recent_n, baseline_s) >= factor


def trimmed_mean(values: Sequence[float], cut: float = 0.1) -> float:
    """Mean without the highest and lowest ``cut`` share of the values (at least one each from 5
    values on). A rank held to a CPU quota is slow in some steps and not in others: a median
    flips between the two, a mean does not; the trim drops a lone pause (GC, a checkpoint)."""
    if not values:
        raise ValueError("no values")
    if not 0 <= cut < 0.5:
        raise ValueError(f"cut must be in [0, 0.5), got {cut}")
    xs = sorted(values)
    k = max(1, int(len(xs) * cut)) if len(xs) >= 5 else 0
    kept = xs[k:len(xs) - k]
    return sum(kept) / len(kept)


def compute_outliers(compute: Mapping[int, float], peers: Mapping[int, Sequence[int]],
                     ratio: float = 1.5, floor_s: float = 0.01) -> list[int]:
    """Ranks that compute slower than the ranks doing the same work.

    ``compute``: each rank's compute time per step (before its collectives);
    ``peers[r]``: the ranks doing r's work (its data-parallel peers).  A rank is
    slow when its compute is at least ``ratio`` x the median of its peers' and
    exceeds it by ``floor_s`` (timer noise).  A starved rank is slow in its
    collectives too, so the compute/wait split of :func:`slow_ranks` can miss it;
    against its own peers its compute stands out.

    Ranks given the same peers object (one group's tuple for all its members) share one sorted
    list of its members' times, each rank's median of the others read from it: a group of g ranks
    costs a sort, not g lists of g - 1 (a job's data-parallel groups of thousands of ranks).
    """
    if ratio <= 1:
        raise ValueError(f"ratio must be > 1, got {ratio}")
    slow = []
    shared: dict[int, tuple[Sequence[int], list[int]]] = {}
    for r in compute:
        group = peers.get(r, ())
        got = shared.get(id(group))
        if got is None:
            shared[id(group)] = (group, [r])
        else:
            got[1].append(r)
    for group, ranks in shared.values():
        times = sorted(compute[p] for p in group if p in compute)
        if len(set(group)) != len(group) or any(t != t for t in times):
            slow += _outliers_one_by_one(compute, {r: group for r in ranks}, ratio, floor_s)
            continue
        members = set(group)
        for r in ranks:
            c = compute[r]
            skip = bisect_left(times, c) if r in members else len(times)    # (r's own time: not a peer's)
            n = len(times) - (r in members)
            if not n:
                continue
            k = n // 2
            at = [k - 1, k] if n % 2 == 0 else [k]
            mid = [times[i] if i < skip else times[i + 1] for i in at]
            med = mid[0] if len(mid) == 1 else (mid[0] + mid[1]) / 2
            if c >= ratio * med and c - med > floor_s:
                slow.append(r)
    return sorted(slow)


def _outliers_one_by_one(compute: Mapping[int, float], peers: Mapping[int, Sequence[int]], ratio: float,
                         floor_s: float) -> list[int]:
    """`compute_outliers` for the ranks in `peers`, each against a list of its peers' times (a
    group listing a rank twice, or a time that is not a number, which no sorted list orders)."""
    slow = []
    for r, group in peers.items():
        c = compute[r]
        others = [compute[p] for p in group if p != r and p in compute]
        if not others:
            continue
        med = median(others)
        if c >= ratio * med and c - med > floor_s:
            slow.append(r)
    return slow


def slow_ranks(per_rank_step_time: Mapping[int, float], per_rank_wait_time: Mapping[int, float],
               compute_ratio: float = 1.25, wait_ratio: float = 0.5,
               min_peer_wait: float = 0.1) -> list[int]:
    """Ranks that compute slowly while their peers wait on them.

    compute = step - wait.  A rank is slow when its compute time is at least
    ``compute_ratio`` x the median compute AND its collective-wait time is at most
    ``wait_ratio`` x the median wait, and the peers really wait: the median wait
    is at least ``min_peer_wait`` of the median step time.  (A rank that is slow
    because it waits on someone else has high wait, not high compute.)
    """
    if set(per_rank_step_time) != set(per_rank_wait_time):
        raise ValueError("step and wait times must cover the same ranks")
    for r, s in per_rank_step_time.items():
        w = per_rank_wait_time[r]
        if s <= 0 or w < 0 or w > s:
            raise ValueError(f"rank {r}: need 0 <= wait <= step and step > 0 (step={s}, wait={w})")
    if len(per_rank_step_time) < 3:
        return []
    compute = {r: per_rank_step_time[r] - per_rank_wait_time[r] for r in per_rank_step_time}
    med_c = median(compute.values())
    med_w = median(per_rank_wait_time.values())
    if med_w < min_peer_wait * median(per_rank_step_time.values()):
        return []
    return sorted(r for r in compute
                  if compute[r] >= compute_ratio * med_c and per_rank_wait_time[r] <= wait_ratio * med_w)


def steady_outliers(history: Sequence[set[str]], n: int, share: float = 0.8) -> tuple[list[str], int]:
    """The machines flagged most often in the last ``n`` rounds of ``history`` (one set of flagged
    machines per round) when that is at least ``share`` of ``n`` rounds, and how often.
    ``([], count)`` when none is flagged that steadily."""
    if n < 1 or not 0 < share <= 1:
        raise ValueError(f"need n >= 1 and 0 < share <= 1 (got {n}, {share})")
    counts = Counter(m for flagged in history[-n:] for m in flagged)
    top = max(counts.values(), default=0)
    if top < math.ceil(share * n - 1e-9):
        return [], top
    return sorted(m for m, c in counts.items() if c == top), top
