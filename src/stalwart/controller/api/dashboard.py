"""The data behind the live dashboard (and the HTML report's plots), as plain functions.

Pure builders take a job's report (``report.build_report`` plus ``live``), its event log and the
controller's machine table and return JSON-ready dicts; :class:`DashboardViews` wires them to a
:class:`~stalwart.controller.api.observe.StatusSource` for the HTTP routes. Nothing here knows the HTTP
framework: a route calls a method and serialises what it returns.

Incident ids are always the report's ``incidents[i]["id"]``; the stored incident row that holds an
incident's stacks is found by its position in the report (the report lists the store's incidents in
order), never by a database key.
"""
from __future__ import annotations

import math
import re
import time
from importlib import resources

from stalwart.analyzer.stacks import group_records
from stalwart.controller.api.observe import StatusSource
from stalwart.controller.report.series import job_start, series_payload
from stalwart.errors import NotFound

MACHINE_STATES = ("active", "standby", "evicted", "idle", "provisioning", "released")
PHASE_KEYS = ("detection", "localization", "failover", "lost_progress", "hot_update")
EVIDENCE_KINDS = ("health", "chaos_sent", "chaos_applied", "command_failed", "run_stopped", "run_started",
                  "failslow_cleared", "failslow_no_standby", "version_applied", "version_rolled_back",
                  "machine_silent", "machine_unstopped", "machine_not_back")
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
                "style.css": "text/css; charset=utf-8"}


def natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


# -- overview ----------------------------------------------------------------------------------------
def machine_grid(rep: dict, live_machines: list[dict]) -> dict:
    """Every machine the job holds or held: ``{"rows": [[id, state, alive, slot, reason#]],
    "reasons": [...], "counts": {state: n}}`` (reasons deduplicated: 1,024 machines evicted for
    the same cause send it once)."""
    live = rep.get("live") or {}
    runs = rep.get("runs") or []
    slots: dict[str, int] = {}
    if runs:
        slots = {m: int(i) for i, m in (runs[-1].get("machines") or {}).items()}
    slots.update({m: i for i, m in enumerate(live.get("slots") or [])})
    ids = {m["id"] for m in rep.get("machines", [])} | set(slots) | set(live.get("standby") or [])
    for r in runs:
        ids |= set((r.get("machines") or {}).values())
    # the controller's own table is the freshest; the report's (from the store) fills the gaps
    by_id = {m["id"]: m for m in rep.get("machines", [])}
    by_id.update({m["id"]: m for m in live_machines if m["id"] in ids})
    reasons: list[str] = []
    index: dict[str, int] = {}
    rows, counts = [], dict.fromkeys(MACHINE_STATES, 0)
    for mid in sorted(ids, key=natural_key):
        m = by_id.get(mid, {"id": mid})
        state = m.get("state") or "provisioning"
        reason = m.get("reason") if state == "evicted" else None
        r = -1
        if reason:
            r = index.setdefault(reason, len(reasons))
            if r == len(reasons):
                reasons.append(reason)
        counts[state] = counts.get(state, 0) + 1
        rows.append([mid, state, 0 if m.get("alive") is False else 1,
                     slots.get(mid, -1) if state == "active" else -1, r])
    return {"rows": rows, "reasons": reasons, "counts": counts}


def incident_summary(inc: dict) -> dict:
    """One incident as the timeline needs it (the heavy parts, checks' results and stacks, are in
    :func:`incident_detail`)."""
    led = inc.get("ledger") or {}
    return {
        "id": inc["id"], "symptom": inc.get("symptom"), "category": inc.get("category"),
        "mechanism": inc.get("mechanism"), "cause": inc.get("cause"),
        "suspects": inc.get("machine_suspects") or [], "evicted": inc.get("machines_evicted") or [],
        "injected_at": inc.get("injected_at"), "detected_at": inc.get("detected_at"),
        "localized_at": inc.get("localized_at"), "resumed_at": inc.get("resumed_at"),
        "detection_s": inc.get("detection_s"), "run": inc.get("run"),
        "phases": {k: round(float(led.get(k) or 0.0), 3) for k in PHASE_KEYS},
        "has_checks": bool(inc.get("stop_time_checks")), "has_replay": bool(inc.get("replay")),
        "analysis": inc.get("analysis"),
    }


def overview(rep: dict, live_machines: list[dict]) -> dict:
    """The dashboard's main poll: progress, ETTR, machines, incidents."""
    live = rep.get("live") or {}
    runs = rep.get("runs") or []
    grid = machine_grid(rep, live_machines)
    tiers: dict[str, int] = {}
    for r in runs:
        for t in ((r.get("restore") or {}).get("tiers") or {}).values():
            tiers[t] = tiers.get(t, 0) + 1
    return {
        "job": rep["job"], "job_id": rep["job_id"], "state": rep["state"],
        "phase": live.get("state", rep["state"]), "reason": rep.get("reason"),
        "step": live.get("step", rep.get("steps_completed")), "steps_target": rep.get("steps_target"),
        "loss": live.get("loss", rep.get("final_loss")), "steps_per_s": live.get("steps_per_s"),
        "run": live.get("run", len(runs)), "restarts": max(0, len(runs) - 1),
        "standby_pool": len(live["standby"]) if "standby" in live else grid["counts"].get("standby", 0),
        "ettr": rep.get("ettr"), "window_ettr": rep.get("window_ettr"), "wall_s": rep.get("wall_s"),
        "productive_s": rep.get("productive_s"), "unproductive_s": rep.get("unproductive_s") or {},
        "steps_lost": rep.get("steps_lost"), "layout": rep.get("layout") or {},
        "restore_tiers": tiers, "machines": grid,
        "incidents": [incident_summary(i) for i in rep.get("incidents", [])],
    }


def incident_detail(rep: dict, stored: list[dict], events: list[dict], inc_id: int) -> dict:
    """Everything about one incident: cause, evidence (the job's events around it), stop-time
    checks, grouped stacks, replay groups, per-phase durations. Raises NotFound if unknown."""
    ids = [i["id"] for i in rep.get("incidents", [])]
    if inc_id not in ids:
        raise NotFound(f"no incident {inc_id} in job {rep.get('job_id')} (incidents: {ids or 'none'})")
    pos = ids.index(inc_id)
    inc = rep["incidents"][pos]
    row = stored[pos] if pos < len(stored) else {}
    stacks = (row.get("data") or {}).get("stacks") or {}
    t0 = job_start(events) or 0.0
    lo = (inc.get("injected_at") if inc.get("injected_at") is not None else inc["detected_at"]) - 30.0
    ends = [inc.get(k) for k in ("resumed_at", "localized_at") if inc.get(k) is not None]
    hi = max(ends) if ends else math.inf
    evidence = []
    for e in events:
        rel = e["t"] - t0
        d = e.get("data") or {}
        mine = d.get("incident") == inc_id
        if mine or (e["kind"] in EVIDENCE_KINDS and lo <= rel <= hi):
            evidence.append({"t": round(rel, 3), "kind": e["kind"],
                             "data": {k: v for k, v in d.items() if k not in ("spec", "machines")}})
    checks = inc.get("stop_time_checks") or {}
    return {
        **incident_summary(inc), "similarity": inc.get("similarity"), "evidence": evidence[-200:],
        "checks": {"checks": checks.get("checks", []), "seconds": checks.get("seconds"),
                   "bad": checks.get("bad", []), "results": checks.get("results", [])} if checks else None,
        "replay": inc.get("replay"),
        "stacks": [{"stack": key[-4000:], "processes": who} for key, who in group_records(stacks)]
        if stacks else [],
    }


# -- the views the routes call ------------------------------------------------------------------------
class DashboardViews:
    """What the dashboard's routes return, over a :class:`StatusSource`."""

    def __init__(self, source: StatusSource):
        self.source = source

    def page(self) -> tuple[bytes, str]:
        return static_file("index.html")

    def overview(self, job: str) -> dict:
        if job in ("latest", "current") and self.source.latest() is None:
            return {"job": None, "job_id": None}           # the page waits for the first job
        job_id = self.source.resolve(job)
        return overview(self.source.status(job_id), self.source.machines())

    def series(self, job: str, since: int = 0, points: int = 120) -> dict:
        job_id = self.source.resolve(job)
        out = series_payload(self.source.events(job_id), time.time(), since, points)
        out["job_id"] = job_id
        return out

    def incident(self, job: str, inc_id: int) -> dict:
        job_id = self.source.resolve(job)
        return incident_detail(self.source.status(job_id), self.source.stored_incidents(job_id),
                               self.source.events(job_id), inc_id)


def static_file(name: str) -> tuple[bytes, str]:
    """One of the dashboard's files shipped in the package (no CDN, no build step)."""
    if name not in STATIC_FILES:
        raise NotFound(f"no static file {name!r}")
    return (resources.files("stalwart.dashboard").joinpath(name).read_bytes(), STATIC_FILES[name])
