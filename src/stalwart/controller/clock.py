"""The controller's clock: wall-clock readings that never step.

Deadlines (heartbeats, hang timers, command timeouts) must not move when NTP or an operator steps
the host's clock: a forward step of a few seconds would call every machine lost, a backward one
would stop every timer. `Clock.now()` is the wall time read once at start plus the monotonic time
elapsed since: it reads like `time.time()` (records stay comparable with other hosts' logs, a job's
saved times stay meaningful to the next controller), but it only ever advances with real time.
A controller that runs for months drifts from the wall clock by the steps the host took meanwhile;
a restart takes a fresh reading.

Nothing compares two hosts' clocks: what an agent reports is judged by when the controller
received it, on this clock.
"""
from __future__ import annotations

import time
from typing import Callable


class Clock:
    def __init__(self, wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic):
        self._mono = mono
        self._wall0, self._mono0 = wall(), mono()

    def now(self) -> float:
        return self._wall0 + (self._mono() - self._mono0)


CLOCK = Clock()


def now() -> float:
    """This process's steady wall-clock reading (see `Clock`)."""
    return CLOCK.now()
