"""What the dashboard and the Prometheus metrics read from the controller, behind one small interface.

:class:`StatusSource` is all they need; :class:`ControllerSource` implements it over today's
``Controller`` (``status()`` rebuilds the report from the store, so it is cached for ``ttl_s``:
a dashboard polling every second, several viewers and a Prometheus scrape share one rebuild). A
cheaper live summary can replace it without touching the views or the collector.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from stalwart.controller.service import Controller


class StatusSource(Protocol):
    def resolve(self, job: str | int) -> int:
        """A job id from "latest"/"current" or a number; NotFound (a LookupError) if there is none."""

    def latest(self) -> int | None:
        """The id of the newest job, None before the first."""

    def status(self, job_id: int) -> dict:
        """The job's report (``report.build_report``) with ``live`` when the job is running."""

    def machines(self) -> list[dict]:
        """Every machine the controller knows: id, state, alive, job_id, reason, address."""

    def events(self, job_id: int) -> list[dict]:
        """The job's event log, sorted by time, each ``{"id", "t", "kind", "data"}``."""

    def stored_incidents(self, job_id: int) -> list[dict]:
        """The job's incidents as stored, in the report's order (their ``data`` holds the stacks)."""


class ControllerSource:
    """:class:`StatusSource` over a running ``Controller``.

    The report and the event log of the newest job asked for are read once per ``ttl_s`` and
    shared by every view and scrape for ``ttl_s`` after it is built (one reader builds, the others wait for it):
    ``status`` is ``Controller.status`` (``report.build_report`` plus the runner's ``live()``) built
    on the same event log that ``events`` returns.
    """

    def __init__(self, ctl: Controller, ttl_s: float = 1.0):
        self.ctl = ctl
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[float, dict, list[dict]]] = {}

    def _snapshot(self, job_id: int) -> tuple[dict, list[dict]]:
        with self._lock:
            hit = self._cache.get(job_id)
            if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
                return hit[1], hit[2]
            events = self.ctl.reports.events(job_id)          # read incrementally (reportcache.py)
            rep = self.ctl.reports.report(job_id, now=time.time())
            runner = self.ctl.jobs.get(job_id)
            if runner is not None:
                rep["live"] = runner.live()
            self._cache = {job_id: (time.monotonic(), rep, events)}
            return rep, events

    def resolve(self, job: str | int) -> int:
        return self.ctl.resolve_job(job)

    def latest(self) -> int | None:
        row = self.ctl.store.latest_job()
        return None if row is None else int(row["id"])

    def status(self, job_id: int) -> dict:
        return self._snapshot(job_id)[0]

    def machines(self) -> list[dict]:
        return self.ctl.machines()

    def events(self, job_id: int) -> list[dict]:
        return self._snapshot(job_id)[1]

    def stored_incidents(self, job_id: int) -> list[dict]:
        return self.ctl.store.incidents(job_id)


class Raw(NamedTuple):
    """A reply that is not JSON: its bytes and content type (a page, a script, the metrics)."""

    body: bytes
    content_type: str


def newest_status(source: StatusSource) -> dict | None:
    """The newest job's report, or None before the first job (the metrics' default summary)."""
    job_id = source.latest()
    return None if job_id is None else source.status(job_id)
