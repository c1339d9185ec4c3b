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

import logging
import os
import threading
import time
from typing import Callable, Mapping

from stalwart import protocol as p
from stalwart.agent.keeper import MACHINE_DOWN_CODE
from stalwart.agent.workers import kill_trees_now

log = logging.getLogger("stalwart.agent")


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


class ChaosCommands:
    """The agent's `chaos` commands: applied at once, or armed until this machine's ranks reach
    their step (`last_step`: rank -> the last step its SDK reported)."""

    def __init__(self, apply: Callable[[dict], float], emit: Callable[[p.Event], None],
                 last_step: Callable[[], Mapping[int, int]], machine_pids: Callable[[], list[int]]):
        self.apply, self.emit, self.last_step, self.machine_pids = apply, emit, last_step, machine_pids
        self.armed = ArmedChaos()

    def command(self, chaos: p.Chaos) -> None:
        if chaos.at_step is None:
            self._now(chaos)
            return
        self.armed.arm(chaos)
        self.on_step()

    def on_step(self) -> None:
        """A rank reported a step: set off the faults armed for it (each on its own thread, so
        the worker's socket reader never waits for a fault)."""
        if not len(self.armed):
            return
        for chaos in self.armed.due(dict(self.last_step())):
            threading.Thread(target=self._armed, args=(chaos,), name="chaos", daemon=True).start()

    def _armed(self, chaos: p.Chaos) -> None:
        try:
            self._now(chaos)
        except Exception as e:              # reported like a failed command
            log.exception("chaos %s failed", chaos.kind)
            self.emit(p.CommandFailed(command="chaos", kind=chaos.kind, error=str(e)))

    def _now(self, chaos: p.Chaos) -> None:
        cmd = {"type": "chaos", "kind": chaos.kind, "rank": chaos.rank, "step": chaos.step,
               "from_step": chaos.step, **chaos.params}
        if cmd["kind"] == "machine-down":
            self.emit(p.ChaosApplied(kind="machine-down", injected_at=time.time()))
            time.sleep(0.05)  # let the sender thread carry the injection time out
            kill_trees_now(list(self.machine_pids()))
            os._exit(MACHINE_DOWN_CODE)     # (its keeper, if any, ends with it)
        t = self.apply(cmd)
        self.emit(p.ChaosApplied(kind=cmd["kind"], rank=cmd.get("rank"), injected_at=t))
