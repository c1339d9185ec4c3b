"""What the dashboard and the Prometheus metrics read from the controller, behind one small interface.

:class:`StatusSource` is all they need; :class:`ControllerSource` implements it over today's
``Controller``: the same reports the API answers with (a dashboard polling every second, several
viewers and a Prometheus scrape share an expensive report through the controller's report cache).
A cheaper live summary can replace it without touching the views or the collector.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from stalwart.controller.service import Controller


class StatusSource(Protocol):
    def resolve(self, job: str | int) -> int:
        """A job id from "latest"/"current" or a number; NotFound (a LookupError) if there is none."""

    def latest(self) -> int | None:
        """The id of the newest job, None before the first."""

    def current(self, keep_s: float) -> list[int]:
        """The jobs worth describing now: every job that runs, those that ended less than `keep_s`
        seconds ago (a scrape still sees how they ended) and the newest one, oldest first."""

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

    ``status`` is ``Controller.status``, the very call that answers ``GET /api/jobs/{job}``: the
    API, the dashboard and ``/metrics`` read one report cache (``reportcache.ReportCache``, which
    shares an expensive report between its readers for a while), so a scrape and an API call made
    one after the other see the same report or a newer one, never an older one. ``events`` is
    that cache's event log of the job.
    """

    def __init__(self, ctl: Controller):
        self.ctl = ctl
        self._ended: dict[int, float] = {}

    def resolve(self, job: str | int) -> int:
        return self.ctl.resolve_job(job)

    def latest(self) -> int | None:
        row = self.ctl.store.latest_job()
        return None if row is None else int(row["id"])

    def current(self, keep_s: float) -> list[int]:
        now = time.time()
        ids = set()
        for job_id, runner in list(self.ctl.jobs.items()):
            if not runner.terminal:
                ids.add(job_id)
                continue
            ended = self._ended.setdefault(job_id, now)     # (first seen ended by this source)
            if now - ended < keep_s:
                ids.add(job_id)
        newest = self.latest()
        if newest is not None:
            ids.add(newest)
        return sorted(ids)

    def status(self, job_id: int) -> dict:
        return self.ctl.status(job_id)

    def ping(self) -> None:
        """Raises when the controller's store does not answer."""
        self.ctl.store.ping()

    def machines(self) -> list[dict]:
        return self.ctl.machines()

    def events(self, job_id: int) -> list[dict]:
        return self.ctl.reports.events(job_id)             # read incrementally (reportcache.py)

    def stored_incidents(self, job_id: int) -> list[dict]:
        return self.ctl.store.incidents(job_id)


class Raw(NamedTuple):
    """A reply that is not JSON: its bytes and content type (a page, a script, the metrics)."""

    body: bytes
    content_type: str


def newest_status(source: StatusSource) -> dict | None:
    """The newest job's report, or None before the first job."""
    job_id = source.latest()
    return None if job_id is None else source.status(job_id)


def current_statuses(source: StatusSource, keep_s: float) -> list[dict]:
    """The reports of the jobs `source.current(keep_s)` names (what /metrics describes)."""
    return [source.status(job_id) for job_id in source.current(keep_s)]
