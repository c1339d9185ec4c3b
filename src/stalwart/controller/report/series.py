"""A job's time series from its event log: committed steps with their rate, and the ETTR curve.

Pure functions over the event rows; the live dashboard polls them through the controller and
the HTML report reads them from a stopped controller's store, so they depend on nothing but
the ledger.
"""
from __future__ import annotations

import math
from collections import deque

from stalwart.controller.report import ledger
RATE_WINDOW = 20            # steps/s over the last 20 committed steps of a run


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def job_start(events: list[dict]) -> float | None:
    return next((e["t"] for e in events if e["kind"] == "job_submitted"), None)


def step_points(events: list[dict], t0: float, since: int = 0, max_points: int = 2000) -> dict:
    """Committed steps after event id ``since``: ``{"points": [[t, step, loss, steps_per_s, run]],
    "next": cursor}`` with ``t`` in seconds since ``t0`` and steps/s over the last
    ``RATE_WINDOW`` steps of the same run. A first load (``since`` 0) keeps at most ``max_points``
    evenly strided points (the last one always)."""
    recent: dict[int, deque] = {}
    pts, nxt = [], since
    for i, e in enumerate(events):
        if e["kind"] != "step":
            continue
        eid = int(e.get("id") or i + 1)
        d = e.get("data") or {}
        run = int(d.get("run") or 0)
        q = recent.setdefault(run, deque(maxlen=RATE_WINDOW + 1))
        q.append(float(e["t"]))
        rate = (len(q) - 1) / (q[-1] - q[0]) if len(q) >= 2 and q[-1] > q[0] else None
        if eid > since:
            pts.append([round(e["t"] - t0, 3), d.get("step"), _num(d.get("loss")),
                        None if rate is None else round(rate, 4), run])
            nxt = max(nxt, eid)
    if since == 0 and len(pts) > max_points:
        stride = math.ceil(len(pts) / max_points)
        pts = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
    return {"points": pts, "next": nxt}


def ettr_curve(events: list[dict], now: float, points: int = 120, window_s: float = 3600.0) -> list[list]:
    """``[[elapsed_s, ettr, window_ettr]]`` at ``points`` evenly spaced times (ledger.series), with
    the job's start (0, 0, 0) first; [] for a log without a job_submitted event."""
    try:
        curve = ledger.series(events, now, points=points, window_s=window_s)
    except ValueError:
        return []
    out = [[0.0, 0.0, 0.0]]
    out += [[round(p["elapsed_s"], 3), round(p["ettr"], 5), round(p["window_ettr"], 5)] for p in curve
            if p["elapsed_s"] > 0]
    return out


def series_payload(events: list[dict], now: float, since: int = 0, points: int = 120,
                   window_s: float = 3600.0) -> dict:
    """What the dashboard polls for its plots: new steps after ``since`` and the whole ETTR curve
    (recomputed each time: the ledger labels with hindsight, so past points can move)."""
    t0 = job_start(events)
    if t0 is None:
        return {"steps": {"points": [], "next": since}, "ettr": [], "window_s": window_s}
    return {"steps": step_points(events, t0, since), "ettr": ettr_curve(events, now, points, window_s),
            "window_s": window_s}
