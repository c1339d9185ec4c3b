"""The job report (`stalwart report --json/--html`), built from the store alone.

The JSON is a contract that later checks read: the keys of the issue's example are never renamed.
"""
from __future__ import annotations

import time

from stalwart.controller.report import ledger
from stalwart.controller.report.startup import startup_phases
from stalwart.controller.store.db import Store


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def build_report(store: Store, job_id: int, now: float | None = None,
                 events: list[dict] | None = None) -> dict:
    """The job's report; ``events`` is its event log when the caller has read it already."""
    job = store.job(job_id)
    if job is None:
        raise LookupError(f"no job {job_id}")
    now = time.time() if now is None else now
    t0 = job["created_at"]
    end = job["finished_at"] or now
    events = store.events(job_id) if events is None else events
    led = ledger.compute(events, end)
    steps: dict[int, dict] = {}
    for e in events:
        if e["kind"] == "step":
            steps[e["data"]["step"]] = e["data"]   # the last execution of a step wins
    losses = {s: d.get("loss") for s, d in sorted(steps.items())}
    final_loss = losses[max(losses)] if losses else None
    incidents = []
    per_inc = led.incidents
    for inc in store.incidents(job_id):
        incidents.append({
            "id": inc["id"], "symptom": inc["symptom"], "category": inc["category"],
            "machine_suspects": inc["suspects"], "machines_evicted": inc["evicted"],
            "mechanism": inc["mechanism"], "cause": inc["cause"],
            "injected_at": _rel(inc["injected_at"], t0), "detected_at": _rel(inc["detected_at"], t0),
            "localized_at": _rel(inc["localized_at"], t0), "resumed_at": _rel(inc["resumed_at"], t0),
            "detection_s": (round(inc["detected_at"] - inc["injected_at"], 3)
                            if inc["injected_at"] else None),
            "run": inc["run_seq"], "ledger": per_inc.get(inc["id"], {}),
            **{k: v for k, v in inc["data"].items() if k != "stacks"},   # `stalwart stacks ID`
        })
    runs = [{"id": r["seq"], "start_step": r["start_step"], "end_step": r["end_step"],
             "started_at": _rel(r["started_at"], t0), "stopped_at": _rel(r["stopped_at"], t0),
             "machines": r["machines"], "restore": r["restore"]} for r in store.runs(job_id)]
    machines = [{"id": m["id"], "state": m["state"], "address": m["address"], "reason": m["reason"]}
                for m in store.machines() if m["job_id"] == job_id or m["state"] == "evicted"]
    spec = job["spec"]
    script = any(e["kind"] == "script_steps" for e in events)   # steps from the step hook: no target
    gaps = [{"down_at": _rel(e["data"]["down_at"], t0), "up_at": _rel(e["data"]["up_at"], t0)}
            for e in events if e["kind"] == "control_plane_down"]
    for e in events:
        if e["kind"] == "control_plane_reconciled":
            for g in gaps:
                if g["down_at"] == _rel(e["data"]["down_at"], t0):
                    g["reconciled_at"] = _rel(e["t"], t0)
    for g in gaps:
        end_at, down = g.get("reconciled_at") or g["up_at"], g["down_at"]
        g["seconds"] = round(end_at - down, 3) if end_at is not None and down is not None else None
    by_mech: dict[str, int] = {}
    for i in incidents:
        by_mech[i["mechanism"] or "open"] = by_mech.get(i["mechanism"] or "open", 0) + 1
    return {
        "job": f"{job['name']}#{job_id}", "job_id": job_id, "state": _public_state(job["state"]),
        "reason": job["reason"], "steps_target": None if script else spec.get("steps"),
        "steps_source": "script" if script else "sdk",
        "steps_completed": max(steps) + 1 if steps else 0, "final_loss": final_loss,
        "wall_s": round(led.wall_s, 3), "productive_s": round(led.productive_s, 3),
        "ettr": round(led.ettr, 5), "window_ettr": round(led.window_ettr, 5),
        "unproductive_s": {k: round(v, 3) for k, v in led.unproductive.items()},
        "startup_phases": startup_phases(events),
        "steps_lost": led.steps_lost, "incidents": incidents, "incidents_by_mechanism": by_mech,
        "machines": machines, "runs": runs, "losses": {str(k): v for k, v in losses.items()},
        "control_plane": gaps,
        "layout": {k: spec.get(k) for k in ("machines", "gpus_per_machine", "tp", "pp", "dp")},
    }


def _public_state(state: str) -> str:
    return state if state in ("succeeded", "failed", "cancelled") else "running"
