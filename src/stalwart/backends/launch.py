"""Running one job on a cluster a launcher started (`stalwart run`, `stalwart slurm submit`):
submit it, show its progress, stop the cluster at the end or on Ctrl-C, print the summary."""
from __future__ import annotations

import sys
import time
import uuid
from typing import Callable

from stalwart.console.progress import Progress, summary
from stalwart.transport.client import ApiError, ControllerUnreachable

PROGRESS_EVERY_S = 1.0     # the progress line's refresh, from the job's live progress (cheap)...
REPORT_EVERY = 5           # ...and every this many refreshes its report (ETTR, incidents: a few ms
                           # of the controller's CPU each), or at once when the run or phase changed
LOGS_EVERY_S = 0.2         # the workers' new log lines reach the console this often


def poll(cluster, path: str, patience_s: float = 90.0) -> dict:
    """GET from the cluster's controller, riding out a controller restart (its supervisor brings
    it back, maybe on another port)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return cluster.client(timeout=10).get(path)
        except ControllerUnreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run_job(cluster, spec, start: Callable[[], None], job: int | None = None,
            tick: Callable[[], None] | None = None, logs=None, target_given: bool = True) -> int:
    """`start()` the cluster, run `spec` on it to the end (or follow `job`, already submitted: a
    controller that took it over); the exit code (0 succeeded, 1 not, 130 interrupted). `tick` is
    called at each refresh. `logs`: the workers' output to show (a `cli.logs.LogTail`), printed
    above the progress line as it comes. The cluster is stopped whatever happens."""
    rep = None
    cluster.on_controller_restart = lambda msg: print(f"\nstalwart: {msg}", file=sys.stderr, flush=True)
    try:
        start()
        if job is None:
            job = cluster.client().post("/api/jobs", {"spec": spec.to_dict(),
                                                      "idempotency_key": uuid.uuid4().hex})["job"]
            print(f"stalwart: job {job} submitted: {' '.join(spec.command)}", flush=True)
        print(f"stalwart: dashboard at {cluster.url}/#token={cluster.token}", flush=True)
        prog = Progress(target_given=target_given)
        full: dict = {}
        seen, polls = None, 0
        while True:
            st = poll(cluster, f"/api/jobs/{job}/live")
            live = st.get("live") or {}
            if "ettr" not in st and (polls % REPORT_EVERY == 0 or (live.get("run"), live.get("state")) != seen):
                full = st = poll(cluster, f"/api/jobs/{job}")
            seen, polls = (live.get("run"), live.get("state")), polls + 1
            prog.update({**full, **st})
            if tick is not None:
                tick()
            if st["state"] != "running":
                rep = st
                break
            wake = time.monotonic() + PROGRESS_EVERY_S
            while True:
                if logs is not None:
                    prog.print_lines(logs.lines())
                if time.monotonic() >= wake:
                    break
                time.sleep(LOGS_EVERY_S)
        if logs is not None:
            prog.print_lines(logs.lines(final=True))
        prog.close()
    except KeyboardInterrupt:
        print("\nstalwart: interrupted; stopping everything", file=sys.stderr)
        if job is not None:
            try:
                cluster.client(timeout=2).post(f"/api/jobs/{job}/cancel", {"reason": "interrupted (Ctrl-C)"})
            except (ControllerUnreachable, ApiError):
                pass
        return 130
    finally:
        cluster.stop()
    print(summary(rep, target_given=target_given))
    return 0 if rep["state"] == "succeeded" else 1
