"""Which standby takes an evicted machine's ranks: the nearest one in the network (Arnold's idea,
papers.md §2.4). Pure: labels in, a plan out.

Machines carry topology labels (`stalwart agent --label switch=leaf3 --label pod=p1`; the local
backend makes synthetic ones, a Slurm or Kubernetes backend passes the cluster's). A standby under
the same switch as the evicted machine's parallel group keeps that group's traffic under one
switch; one in the same pod crosses a switch but not the spine; anything else crosses the spine,
where send/recv bandwidth drops most (Arnold: up to 70% across minipods). So each evicted machine,
in slot order, gets the ready standby at the smallest distance from its group:

    0  shares a `switch` label with a machine of the group
    1  shares a `pod` label with one
    2  neither (or no labels at all)

ties going to the standby sharing that label with the most machines of the group, then to the
pool's order. Without labels every distance is the same and the plan is the pool's order, as
before labels existed.
"""
from __future__ import annotations

from typing import Mapping, Sequence

LEVELS = ("switch", "pod")
Labels = Mapping[str, str]


def distance(labels: Labels, group: Sequence[Labels], levels: Sequence[str] = LEVELS) -> int:
    """How far a machine with `labels` is from a group of machines: the index of the first level
    (switch, then pod) whose label it shares with one of them; len(levels) when none."""
    for i, key in enumerate(levels):
        mine = labels.get(key)
        if mine is not None and any(g.get(key) == mine for g in group):
            return i
    return len(levels)


def _rank(labels: Labels, group: Sequence[Labels], levels: Sequence[str]) -> tuple[int, int]:
    d = distance(labels, group, levels)
    shared = sum(1 for g in group if g.get(levels[d]) == labels.get(levels[d])) if d < len(levels) else 0
    return d, -shared


def replacement_plan(active: Sequence[str], evict: Sequence[str], standby_ready: Sequence[str],
                     groups: Mapping[str, Sequence[Labels]] | None = None,
                     labels: Mapping[str, Labels] | None = None,
                     levels: Sequence[str] = LEVELS) -> dict[str, str]:
    """{evicted machine: standby} for every evicted machine of `active`, in slot order.

    `groups[m]`: the labels of the machines of evicted machine m's parallel group (m's own
    included: its place is where the group was); `labels[s]`: a standby's labels. Callers check
    first that there are enough ready standbys (`policy.standby_shortfall`)."""
    pool = list(standby_ready)
    plan: dict[str, str] = {}
    for m in active:
        if m not in evict:
            continue
        group = (groups or {}).get(m) or ()
        best = min(range(len(pool)), key=lambda i: (_rank((labels or {}).get(pool[i]) or {}, group, levels), i))
        plan[m] = pool.pop(best)
    return plan
