"""Backup pacing: how often a rank's in-memory snapshot is pushed to its backup peer (pure).

Every step's snapshot lands in the rank's own shared memory; a push copies it to the backup peer
(sent, received, its checksum and MAC checked there), so that a lost machine's ranks restore from a
peer's memory. The push costs CPU on both machines every time. When a step is long (a GPU job:
hundreds of milliseconds) that cost is noise and every step is pushed; when steps are short and
the state large, pushing each one takes a visible share of the CPU that trains (measured on the
2-core test host: 4.7 CPU-ms a step for a DDP job of 17 ms steps, the two ends together).

`interval` turns the measured cost into a pace: a push every `k` steps, `k` the smallest power of
two for which a push's cost (the sender's CPU seconds, measured on its lane thread, times
`RECEIVER_FACTOR` for the receiving end) spread over `k` steps stays within `budget` of a step's
time. Powers of two nest, so the steps pushed by a rank with a slower pace are pushed by the ranks
of faster ones too: the newest step every rank backed up is recent. `k` never exceeds `cap`
(`policy.mem_slots - 2`, given by the agent): a machine loss restores every rank to the newest
step whose backups all survive, and the surviving ranks must still hold that step in their own
memory, which keeps `mem_slots - 1` complete steps (one slot is being written).

`due` decides one step: pushed when it falls on the pace's grid (`(step + 1) % k == 0`) or when
the rank has gone `k` steps without a push (an announcement that skipped the grid step: the
newest one goes). A step not pushed is deferred; `flush` names the newest deferred step, pushed
when the workers stop, so a stop never leaves the peer behind what the own memory holds.

What a machine loss costs: the steps after the newest step every rank backed up, at most `k - 1`
steps more than with a push every step (plus any push in flight when the machine went), booked
as lost progress by the ledger.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

BUDGET = 0.02            # share of a step's time a rank's backups may cost in CPU (both ends)
RECEIVER_FACTOR = 2.0    # a push costs its receiver about what it costs its sender (measured)
EWMA = 0.2               # weight of a new measurement in the running averages
AUTO = 0                 # `backup_every` of the adaptive pace


@dataclass(frozen=True)
class Lane:
    """One rank's pacing state; every field a measurement or a step number."""
    pushed: int = -1                   # the newest step whose push was started
    newest: int = -1                   # the newest step seen (its path is the caller's)
    seen_at: float | None = None       # when `newest` was seen (monotonic seconds)
    step_s: float | None = None        # running average of the time between steps
    cost_s: float | None = None        # running average of a push's CPU seconds (the sender's)


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


def observe_step(lane: Lane, step: int, now: float) -> Lane:
    """`step` was seen at `now`: the step time is measured between two steps seen in order."""
    if step <= lane.newest:
        return lane
    step_s = lane.step_s
    if lane.seen_at is not None and lane.newest >= 0 and now > lane.seen_at:
        step_s = _avg(step_s, (now - lane.seen_at) / (step - lane.newest))
    return replace(lane, newest=step, seen_at=now, step_s=step_s)


def observe_push(lane: Lane, cpu_s: float) -> Lane:
    """A push ended after costing its sender `cpu_s` CPU seconds."""
    if cpu_s < 0 or not math.isfinite(cpu_s):
        return lane
    return replace(lane, cost_s=_avg(lane.cost_s, cpu_s))


def interval(lane: Lane, every: int, cap: int, budget: float = BUDGET) -> int:
    """Steps between pushes: `every` when set (>= 1), else the adaptive pace; at most `cap`,
    at least 1. Until a push and two steps were measured, every step."""
    cap = max(1, cap)
    if every >= 1:
        return min(every, cap)
    if lane.cost_s is None or not lane.step_s or budget <= 0:
        return 1
    need = RECEIVER_FACTOR * lane.cost_s / (budget * lane.step_s)
    k = 1
    while k < need and k * 2 <= cap:
        k *= 2
    return k


def due(lane: Lane, step: int, k: int) -> bool:
    """Whether to push `step` (the rank's newest) now at a pace of one push every `k` steps."""
    if step <= lane.pushed:
        return False
    return k <= 1 or (step + 1) % k == 0 or step - lane.pushed >= k


def pushing(lane: Lane, step: int) -> Lane:
    """The push of `step` was started."""
    return replace(lane, pushed=max(lane.pushed, step))


def flush(lane: Lane) -> int | None:
    """The step to push when the workers stop: the newest seen, if it was not pushed."""
    return lane.newest if lane.newest > lane.pushed else None
