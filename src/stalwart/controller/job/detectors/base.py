"""The interface every implicit detector has, and what a detector may ask of the job core.

A detector is pure: it reads the job's state and `now`, keeps what it learns in that state (so a
restarted controller carries on), and returns actions. It never opens an incident itself: it asks
the `Incidents` it was given (the failure flow, typed in `flows/base.py`), which opens one, stops
the run, or first captures every machine's stacks.
"""
from __future__ import annotations

from typing import Protocol

from stalwart import protocol
from stalwart.controller.job.actions import Action
from stalwart.controller.job.flows.base import Ctx, Incidents
from stalwart.controller.job.state import JobState, PendingStep

Actions = list[Action]


class Detector(Protocol):
    """One implicit detector. Every method may be a no-op; `ImplicitFlow` calls them all."""

    name: str

    def new_run(self, st: JobState, now: float) -> None:
        """A run starts: forget what was judged of the previous one."""
        ...

    def observe(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        """An agent's event (metrics, stacks, activity, ...) reached the job."""
        ...

    def on_committed(self, st: JobState, acc: PendingStep, now: float) -> Actions:
        """Every rank reported a step, and it was not a training anomaly."""
        ...

    def tick(self, st: JobState, now: float) -> Actions:
        """The job's timer while it runs."""
        ...


class BaseDetector:
    """No-op defaults, so that each detector writes only the hooks it uses."""

    name = "detector"

    def __init__(self, ctx: Ctx, incidents: Incidents):
        self.ctx, self.incidents = ctx, incidents

    def new_run(self, st: JobState, now: float) -> None:
        return None

    def observe(self, st: JobState, machine: str, ev: protocol.Event, now: float) -> Actions:
        return []

    def on_committed(self, st: JobState, acc: PendingStep, now: float) -> Actions:
        return []

    def tick(self, st: JobState, now: float) -> Actions:
        return []
