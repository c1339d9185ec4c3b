"""Job reports for the API without re-reading the whole event log on every request.

`stalwart run` asks for its job's status twice a second, `status --watch` and the dashboard as
often; a report is built from the job's whole event log (the ledger sweeps it), so rebuilding it
from the database each time cost the controller time in proportion to the job's length (20 ms
for 400 steps, seconds for 100,000). Here each job's log is read once and then only its new rows
(:class:`EventLog`), and a report that took long to build is reused for a while after it was built
while the job runs (ten times its build time, at most 30 s: the controller spends at most a tenth
of its time on reports however often they are asked for). A report of a short job is rebuilt
each time, as before; a job whose state changed gets a fresh one, and an ended job's report is
rebuilt whenever its log grew (it is exact, not a while old).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stalwart.controller.report.build import build_report

if TYPE_CHECKING:
    from stalwart.controller.store.db import Store

REUSE_FACTOR = 10.0     # a report is reused for this many times what it took to build...
MAX_REUSE_S = 30.0      # ...but never longer than this
MAX_JOBS = 32           # jobs whose logs are kept (the least recently asked for go first)
LOOKBACK_IDS = 500      # rows re-read behind the newest seen: a writer may commit ids out of order


@dataclass
class EventLog:
    """One job's event log as the store holds it, sorted by (t, id), read incrementally."""

    events: list[dict] = field(default_factory=list)
    ids: set[int] = field(default_factory=set)
    top: int = 0            # the largest id seen

    def extend(self, rows: list[dict]) -> None:
        new = [r for r in rows if r["id"] not in self.ids]
        if not new:
            return
        self.ids.update(r["id"] for r in new)
        self.top = max(self.top, max(r["id"] for r in new))
        new.sort(key=_key)                  # rows come in id order; agents' times need not
        late = bool(self.events) and _key(new[0]) < _key(self.events[-1])
        self.events.extend(new)
        if late:                            # an event older than the newest seen: sort (nearly sorted)
            self.events.sort(key=_key)


def _key(ev: dict) -> tuple[float, int]:
    return (ev["t"], ev["id"])


@dataclass
class _Entry:
    log: EventLog = field(default_factory=EventLog)
    report: dict | None = None
    built_at: float = 0.0       # monotonic
    cost_s: float = 0.0
    state: str | None = None
    top_built: int = 0          # the log's newest id when the report was built


class ReportCache:
    def __init__(self, store: "Store", reuse_factor: float = REUSE_FACTOR, max_reuse_s: float = MAX_REUSE_S):
        self.store = store
        self.reuse_factor, self.max_reuse_s = reuse_factor, max_reuse_s
        self._lock = threading.Lock()
        self._jobs: dict[int, _Entry] = {}

    def events(self, job_id: int) -> list[dict]:
        """The job's event log, sorted by (t, id) (a copy)."""
        with self._lock:
            return list(self._read(job_id).log.events)

    def _read(self, job_id: int) -> _Entry:
        e = self._jobs.pop(job_id, None) or _Entry()
        self._jobs[job_id] = e                  # the most recently asked for last
        while len(self._jobs) > MAX_JOBS:
            del self._jobs[next(iter(self._jobs))]
        # the ids behind the newest seen are read alone (a report asked for twice a second read
        # and decoded 500 rows each time); rows are read from the oldest id not seen yet
        unseen = [i for i in self.store.event_ids_since(job_id, max(0, e.log.top - LOOKBACK_IDS))
                  if i not in e.log.ids]
        if unseen:
            e.log.extend(self.store.events_since(job_id, unseen[0] - 1))
        return e

    def report(self, job_id: int, now: float | None = None) -> dict:
        """The job's report (`report.build_report`); LookupError for an unknown job."""
        with self._lock:
            job = self.store.job(job_id)
            if job is None:
                raise LookupError(f"no job {job_id}")
            t0 = time.monotonic()
            e = self._read(job_id)
            if e.report is not None and e.state == job["state"]:
                if job["finished_at"] is not None:      # an ended job's report changes with its log only
                    if e.top_built == e.log.top:
                        return dict(e.report)
                elif t0 - e.built_at < min(self.max_reuse_s, self.reuse_factor * e.cost_s):
                    return dict(e.report)
            rep = build_report(self.store, job_id, now=time.time() if now is None else now,
                               events=e.log.events)
            e.report, e.built_at, e.cost_s, e.state = rep, time.monotonic(), time.monotonic() - t0, job["state"]
            e.top_built = e.log.top
            return dict(rep)

    def forget(self, job_id: int) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)
