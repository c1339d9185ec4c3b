"""The job's start-up, split into its phases (pure, from the event log).

The ledger books `startup` from `job_submitted` to the start of the first step. Bootseer's lesson
is that start-up is a large share of the time lost at scale, and which phase dominates decides what
to shorten, so the report splits it at the events the job records:

    waiting     job_submitted -> run_started of the first run (machines taken)
    spawn       -> workers_started (the last machine's agent spawned its workers), less the time
                   the machine's fork server was still importing for them (`preload_s`)
    import      -> the last worker's SDK began (python, torch and the training script loaded)
    rendezvous  -> the last worker's process groups were up
    first_step  -> the start of the first step (restore and whatever the script does before it)

A boundary the log lacks (a script without the SDK says nothing of import and rendezvous) folds its
phase into the next one; the phases always add up to the ledger's start-up.
"""
from __future__ import annotations

from typing import Iterable, Mapping

PHASES = ("waiting", "spawn", "import", "rendezvous", "first_step")


def startup_phases(events: Iterable[Mapping]) -> dict[str, float]:
    t0 = first_run = None
    started: list[float] = []
    imported = ready = None
    first_step = None
    for e in events:
        kind, data, t = e["kind"], e.get("data") or {}, e["t"]
        if kind == "job_submitted" and t0 is None:
            t0 = t
        elif kind == "run_started" and first_run is None:
            first_run = (data.get("run"), t)
        elif first_run is None:
            continue
        elif kind == "workers_started" and data.get("run") == first_run[0]:
            started.append(t - float(data.get("preload_s") or 0.0))
        elif kind == "workers_ready" and data.get("run") == first_run[0] and ready is None:
            imported, ready = data.get("imported"), data.get("ready")
        elif kind == "step" and data.get("run") == first_run[0]:
            begin = t - float(data.get("dur") or 0.0)
            first_step = begin if first_step is None else min(first_step, begin)
    if t0 is None or first_run is None or first_step is None:
        return {}
    bounds = [t0, first_run[1], max(started) if started else None, imported, ready, first_step]
    out: dict[str, float] = {}
    prev = t0
    for name, b in zip(PHASES, bounds[1:]):
        b = prev if b is None else min(max(b, prev), first_step)
        out[name] = round(b - prev, 3)
        prev = b
    return out
