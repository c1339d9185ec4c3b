"""The agent's monitor: runs every probe on its own interval and reports health events.

Probes (agent/probes/*) each have an interval and a threshold; the monitor only schedules them
and turns their HealthEvents into agent events. A probe that raises is reported once as
`probe_failed` (a warning) instead of silently disappearing. `sweep()` runs every probe at once:
the agent calls it when a worker dies, so the controller hears about a dead GPU before it hears
about the crash it caused.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from stalwart.agent.probes.base import HealthEvent, Probe
from stalwart.protocol import Event, Health, Severity

log = logging.getLogger("stalwart.agent")

NETWORK_PROBES = {"nic"}
MAX_WAIT_S = 5.0


def to_event(h: HealthEvent, certain_kinds: frozenset = frozenset()) -> Health:
    return Health(probe=h.probe, kind=h.kind, severity=h.severity,
                  machine_certain=h.machine_certain or h.kind in certain_kinds,
                  network=h.probe in NETWORK_PROBES, detail=h.detail, t=h.t)


class Monitor:
    def __init__(self, probes: list[Probe], emit: Callable[[Event], None], tick_s: float = 0.2,
                 certain_kinds: frozenset = frozenset()):
        """`certain_kinds`: kinds this machine knows to be its own fault (e.g. disk_full on a
        machine-local disk, which the disk probe alone cannot know)."""
        self.probes = probes
        self.certain_kinds = certain_kinds
        self.emit = emit
        self.tick_s = tick_s
        self._lock = threading.Lock()
        self._failed: set[str] = set()
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="monitor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.wait_s(time.time())):
            self._run(force=False)

    def wait_s(self, now: float) -> float:
        """How long to sleep before the next probe is due: the thread wakes when one is, not
        every tick (a machine's probes run together: one `now` for all, so their times stay in
        step), at least `tick_s` and at most MAX_WAIT_S."""
        with self._lock:
            nxt = min((p.next_due() for p in self.probes), default=now + MAX_WAIT_S)
        return min(MAX_WAIT_S, max(self.tick_s, nxt - now))

    def sweep(self) -> None:
        self._run(force=True)

    def _run(self, force: bool) -> None:
        with self._lock:
            now = time.time()
            for p in self.probes:
                if not (force or p.due(now)):
                    continue
                try:
                    events = p.run(now)
                except Exception as e:  # report a broken probe once, keep the others running
                    if p.name not in self._failed:
                        self._failed.add(p.name)
                        log.warning("probe %s failed: %s", p.name, e)
                        self.emit(Health(probe=p.name, kind="probe_failed", severity=Severity.WARN,
                                         detail={"error": str(e)}, t=now))
                    continue
                self._failed.discard(p.name)
                for h in events:
                    self.emit(to_event(h, self.certain_kinds))
