"""Common vocabulary of the agent's real-time probes.

A probe inspects one part of the machine (GPU, NIC, kernel log, disk, host) and returns
`HealthEvent`s. Probes hold only the little state they need to see *changes* (counters
since the last check, how many consecutive bad readings), so each one tolerates
self-healing glitches through its own interval and threshold (ByteRobust §4.1: every
inspection item has its own interval and triggering threshold).

The agent's monitor loop calls `Probe.due(now)` and `Probe.check(now)`; it never sleeps
inside a probe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.protocol import Severity

SEVERITIES = tuple(s.value for s in Severity)


@dataclass(frozen=True)
class HealthEvent:
    """One observation of a probe.

    probe: name of the probe that saw it ("gpu", "nic", "kmsg", "disk", "host").
    kind: what was seen ("gpu_lost", "gpu_xid", "ecc_dbe", "nic_down", "disk_full", ...).
    severity: "fatal" (the machine cannot train), "warn" (degraded / maybe transient) or
      "info".
    machine_certain: True when the fault is certainly this machine's (GPU lost, disk
      fault): the controller may evict at once without stop-time checks.
    detail: plain JSON-able data (device index, Xid code, counters, ...).
    t: the `now` of the check that produced it (seconds, same clock as the caller).
    """

    probe: str
    kind: str
    severity: Severity
    machine_certain: bool
    detail: dict[str, Any] = field(default_factory=dict)
    t: float = 0.0

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        object.__setattr__(self, "severity", Severity(self.severity))
        if not self.probe or not self.kind:
            raise ValueError("a HealthEvent needs a probe name and a kind")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, for sending to the controller as JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HealthEvent":
        """Inverse of `to_dict`."""
        return cls(
            probe=d["probe"],
            kind=d["kind"],
            severity=Severity(d["severity"]),
            machine_certain=bool(d["machine_certain"]),
            detail=dict(d.get("detail") or {}),
            t=float(d.get("t", 0.0)),
        )


class Probe:
    """Base class of a probe: a name, an interval, and `check(now)`.

    Subclasses implement `check(now) -> list[HealthEvent]`. `due(now)` tells the monitor
    loop whether `interval_s` has passed since the last check; `run(now)` checks and
    records the time. A probe whose source fails in an unexpected way should let the
    exception out: the monitor reports it as a probe failure instead of hiding it.
    """

    name: str = "probe"
    interval_s: float = 10.0

    def __init__(self) -> None:
        self._last_check: float | None = None

    def check(self, now: float) -> list[HealthEvent]:
        """Inspect the source once and return what was seen (may be empty)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement check()")

    def due(self, now: float) -> bool:
        """True when the probe has never run or `interval_s` has passed since it last ran."""
        return self._last_check is None or now - self._last_check >= self.interval_s

    def next_due(self) -> float:
        """When `due` turns true next (-inf: now, the probe never ran)."""
        return float("-inf") if self._last_check is None else self._last_check + self.interval_s

    def run(self, now: float) -> list[HealthEvent]:
        """Check now and remember when, so `due` spaces the next check by `interval_s`."""
        self._last_check = now
        return self.check(now)

    def event(
        self,
        kind: str,
        severity: Severity | str,
        machine_certain: bool,
        now: float,
        **detail: Any,
    ) -> HealthEvent:
        """Build a HealthEvent stamped with this probe's name."""
        return HealthEvent(self.name, kind, severity, machine_certain, dict(detail), now)


class Debounce:
    """Counts consecutive bad readings per key; fires once `threshold` is reached.

    A glitch that heals before `threshold` consecutive checks never fires; a condition
    that stays fires on every check from the threshold on (the controller deduplicates).
    """

    def __init__(self, threshold: int) -> None:
        if threshold < 1:
            raise ValueError(f"debounce threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self._counts: dict[Any, int] = {}

    def observe(self, key: Any, bad: bool) -> bool:
        """Record one reading for `key`; return True when it has been bad `threshold` times in a row."""
        if not bad:
            self._counts.pop(key, None)
            return False
        self._counts[key] = self._counts.get(key, 0) + 1
        return self._counts[key] >= self.threshold

    def observe_all(self, bad: set[Any]) -> set[Any]:
        """One check's readings at once: keys in `bad` were bad, every other key was good.

        Returns the keys that reached the threshold.
        """
        for key in list(self._counts):
            if key not in bad:
                del self._counts[key]
        return {key for key in bad if self.observe(key, True)}
