"""Reporting a worker's end: one `worker_exit` event per worker, at its exit, or earlier when its
SDK says it is failing (its traceback then, rather than when the process is gone: interpreter
teardown takes ~0.5 s). A failure is reported after a sweep of the machine's probes, so that a
dead GPU is reported before the crash it caused."""
from __future__ import annotations

import logging
from typing import Callable

from stalwart import protocol as p
from stalwart.agent.workers import Worker

log = logging.getLogger("stalwart.agent")


class ExitReports:
    def __init__(self, workers: Callable[[], list[Worker]], sweep: Callable[[], None],
                 script_events: Callable[[list[Worker]], list[p.Script]], emit: Callable[[p.Event], None]):
        """`workers`: the run's workers; `sweep`: look at every probe now; `script_events`: a plain
        script's last step-hook records of some workers, as events."""
        self.workers, self.sweep, self.script_events, self.emit = workers, sweep, script_events, emit

    def failing(self, pid: int, msg: p.Failing) -> None:
        """A worker's SDK says it is going down with an exception: report the failure now."""
        w = next((w for w in self.workers() if w.proc.pid == pid), None)
        if w is None or w.expected_exit or w.failure_reported:
            return
        w.failure_reported = True
        self._report(w, None, False, "\n" + msg.traceback)

    def exited(self, w: Worker) -> None:
        try:        # a plain script's last steps (its step hook wrote them at exit) before its exit
            for ev in self.script_events([w]):
                self.emit(ev)
        except Exception:      # noqa: BLE001 - the exit matters more than its last steps
            log.exception("reading the step hook of rank %s", w.rank)
        if w.failure_reported:
            return             # reported when its SDK said it was failing
        # `expected` as it was at the exit: a stop may come during the sweep
        self._report(w, w.exit_code, w.expected_exit)

    def _report(self, w: Worker, code: int | None, expected: bool, more_log: str = "") -> None:
        """One `worker_exit` event (code None: failing, not gone yet)."""
        if not expected and code != 0:
            self.sweep()
        sig = -code if code is not None and code < 0 else None
        log.info("rank %s (pid %d) %s with code %s%s", w.rank, w.proc.pid,
                 "is failing" if code is None else "exited", code, " (stopped)" if expected else "")
        self.emit(p.WorkerExit(run=w.run, rank=w.rank, local_rank=w.local_rank, code=code, signal=sig,
                               expected=expected, pid=w.proc.pid,
                               log_tail="" if expected else w.log_tail() + more_log))
