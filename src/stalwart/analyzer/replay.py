"""Dual-phase replay planner (ByteRobust Algorithm 1, papers.md §1.5.3).

A fault that no stop-time check reproduces (silent data corruption, a NaN that
appears on some machine) is located by replaying the job on groups of machines,
twice, over two partitions of the same machines:

- ``m = k * pp`` machines per group, ``n = dp // k`` groups per phase;
- horizontal groups: machine at index ``i`` goes to group ``i // m``;
- vertical groups: machine at index ``i`` goes to group ``i % n``.

Each group replays with TP and PP unchanged and ``dp = k`` (fewer layers so it
fits).  Two machines of one horizontal group differ in index by less than
``m <= n``, so they never share a vertical group: one failing horizontal group and
one failing vertical group intersect in exactly one machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence


@dataclass(frozen=True)
class ReplayPlan:
    """A dual-phase replay plan: ``phases[0]`` horizontal groups, ``phases[1]`` vertical."""

    machines: tuple[Any, ...]
    pp: int
    dp: int
    k: int
    m: int
    n: int
    # (horizontal_groups, vertical_groups); each a tuple of tuples of machines
    phases: tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]

    @property
    def horizontal(self) -> tuple:
        """Horizontal groups (index // m)."""
        return self.phases[0]

    @property
    def vertical(self) -> tuple:
        """Vertical groups (index % n)."""
        return self.phases[1]

    @property
    def replay_dp(self) -> int:
        """Data-parallel size every replay group runs with (TP and PP unchanged)."""
        return self.k

    def jobs(self) -> list[dict]:
        """Every replay run to launch: phase, group index, machines and layout.

        Runs of one phase are independent and can go concurrently; TP is the job's
        own (one machine holds a TP group), PP unchanged, DP = k.
        """
        return [{"phase": name, "group": g, "machines": list(group), "pp": self.pp, "dp": self.k}
                for name, phase in (("horizontal", self.horizontal), ("vertical", self.vertical))
                for g, group in enumerate(phase)]


def _check(machines_count: int, pp: int, dp: int, k: int) -> tuple[int, int]:
    for name, value in (("pp", pp), ("dp", dp), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"dual-phase replay needs a positive integer {name} (got {value!r})")
    if dp % k:
        raise ValueError(f"dual-phase replay needs dp divisible by k (dp={dp}, k={k})")
    m, n = k * pp, dp // k
    if m > n:
        raise ValueError(f"dual-phase replay needs m <= n (m=k*pp={m}, n=dp/k={n})")
    if machines_count != m * n:
        raise ValueError(
            f"dual-phase replay needs m*n machines (m={m}, n={n}: {m * n}), got {machines_count}")
    return m, n


def plan(machines: Sequence[Hashable], pp: int, dp: int, k: int) -> ReplayPlan:
    """Partition ``machines`` into horizontal and vertical replay groups.

    Raises ValueError when ``dp % k != 0``, ``len(machines) != m*n`` or ``m > n``.
    """
    machines = tuple(machines)
    if len(set(machines)) != len(machines):
        raise ValueError("dual-phase replay needs distinct machines (duplicates given)")
    m, n = _check(len(machines), pp, dp, k)
    horizontal = tuple(machines[g * m:(g + 1) * m] for g in range(n))     # i // m == g
    vertical = tuple(machines[g::n] for g in range(n))                      # i % n == g
    return ReplayPlan(machines=machines, pp=pp, dp=dp, k=k, m=m, n=n,
                      phases=(horizontal, vertical))


def locate(plan: ReplayPlan, failed_h: set[int], failed_v: set[int]) -> list:
    """Machines in both a failed horizontal and a failed vertical group.

    ``failed_h`` / ``failed_v`` are group indexes into ``plan.horizontal`` /
    ``plan.vertical``.  The result keeps the plan's machine order; with one
    failing group per phase it holds exactly one machine.
    """
    for name, failed, groups in (("horizontal", failed_h, plan.horizontal),
                                 ("vertical", failed_v, plan.vertical)):
        bad = sorted(g for g in failed if not (isinstance(g, int) and 0 <= g < len(groups)))
        if bad:
            raise ValueError(f"no {name} group(s) {bad}: the plan has {len(groups)} (0..{len(groups) - 1})")
    in_h = {x for g in failed_h for x in plan.horizontal[g]}
    in_v = {x for g in failed_v for x in plan.vertical[g]}
    return [x for x in plan.machines if x in in_h and x in in_v]


def choose_k(pp: int, dp: int, machines: int) -> int:
    """Smallest k with dp % k == 0, m=k*pp <= n=dp/k and m*n == machines.

    Raises ValueError that says why no k works.
    """
    for name, value in (("pp", pp), ("dp", dp), ("machines", machines)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"choose_k needs a positive integer {name} (got {value!r})")
    if pp * dp != machines:
        raise ValueError(
            f"dual-phase replay needs one machine per pipeline stage and replica: "
            f"pp*dp={pp * dp} but {machines} machines")
    for k in range(1, dp + 1):
        if dp % k == 0 and k * pp <= dp // k:
            return k
    raise ValueError(
        f"no k makes dual-phase replay work for pp={pp}, dp={dp}: even k=1 gives "
        f"m=pp={pp} > n=dp={dp}; it needs dp >= pp")
