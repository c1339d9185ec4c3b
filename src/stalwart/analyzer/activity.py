"""Whether a worker without step reports made progress between two samples of its activity.

The agent samples each worker's CPU time, log size and flight-recorder summary
(`agent/progress.py`); this rule judges two samples, and the controller's hang timer
(`controller/rules/hangwatch.py`) counts what it says as progress. Pure: no clock, no process.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActivitySample:
    """What the agent samples per worker without the SDK: cumulative CPU seconds of the
    worker and its children, the size of its log files in bytes, and from its flight recorder
    (None/False without one) how many collectives it has entered and whether it is inside one."""

    cpu_s: float
    log_bytes: int
    collectives: int | None = None
    in_collective: bool = False


def progressed(prev: ActivitySample | None, cur: ActivitySample, min_cpu_s: float = 0.05) -> bool:
    """Whether a worker made progress between two samples: it entered a new collective; or,
    outside a collective, its log grew or it used at least ``min_cpu_s`` more CPU.  Inside a
    collective CPU time and log lines prove nothing (NCCL's wait spins, a watchdog thread
    prints).  A log that shrank (rotated) counts as growth; the first sample (``prev`` None)
    is progress."""
    if not isinstance(cur, ActivitySample) or (prev is not None and not isinstance(prev, ActivitySample)):
        raise ValueError("progressed needs ActivitySample values")
    if not min_cpu_s >= 0:
        raise ValueError(f"min_cpu_s must be >= 0 (got {min_cpu_s!r})")
    if prev is None:
        return True
    if cur.collectives is not None and (prev.collectives is None or cur.collectives > prev.collectives):
        return True
    if cur.in_collective:
        return False
    return cur.log_bytes != prev.log_bytes or cur.cpu_s - prev.cpu_s >= min_cpu_s
