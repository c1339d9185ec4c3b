"""Chaos armed to go off at a step.

`--chaos "crash@step=30,machine=1"` means: when the job has completed 30 steps. The controller
learns of a completed step only after every rank reported it and the agents delivered the
reports, by which time a fast job is several steps further on (on a loaded host a 40-step job
had finished before a crash meant for step 30 arrived). So the controller sends a scheduled
fault ahead of time, armed with its step, and the agent applies it the moment one of its own
ranks reports having completed that many steps (it hears its workers' step reports at once over
the local socket). A fault armed after its step has passed goes off at the next report.
"""
from __future__ import annotations

import threading
from typing import Mapping

from stalwart import protocol as p


class ArmedChaos:
    """The faults waiting for their step on this machine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[p.Chaos] = []

    def arm(self, chaos: p.Chaos) -> None:
        with self._lock:
            self._waiting.append(chaos)

    def due(self, last_step: Mapping[int, int]) -> list[p.Chaos]:
        """Take the faults whose step this machine's ranks reached: a rank reported step
        `at_step - 1`, i.e. it completed `at_step` steps."""
        done = max(last_step.values(), default=-1) + 1
        with self._lock:
            ready = [c for c in self._waiting if c.at_step is not None and done >= c.at_step]
            self._waiting = [c for c in self._waiting if c not in ready]
        return ready

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)
