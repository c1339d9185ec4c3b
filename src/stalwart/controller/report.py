"""The job report (`stalwart report --json/--html`), built from the store alone.

The JSON is a contract that later checks read: the keys of the issue's example are never renamed.
"""
from __future__ import annotations

import html
import json
import time

from stalwart.controller import ledger
from stalwart.controller.store import Store


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def build_report(store: Store, job_id: int, now: float | None = None) -> dict:
    job = store.job(job_id)
    if job is None:
        raise LookupError(f"no job {job_id}")
    now = time.time() if now is None else now
    t0 = job["created_at"]
    end = job["finished_at"] or now
    events = store.events(job_id)
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
    gaps = [{"down_at": _rel(e["data"]["down_at"], t0), "up_at": _rel(e["data"]["up_at"], t0)}
            for e in events if e["kind"] == "control_plane_down"]
    for e in events:
        if e["kind"] == "control_plane_reconciled":
            for g in gaps:
                if g["down_at"] == _rel(e["data"]["down_at"], t0):
                    g["reconciled_at"] = _rel(e["t"], t0)
    for g in gaps:
        end_at = g.get("reconciled_at") or g["up_at"]
        g["seconds"] = round(end_at - g["down_at"], 3)
    by_mech: dict[str, int] = {}
    for i in incidents:
        by_mech[i["mechanism"] or "open"] = by_mech.get(i["mechanism"] or "open", 0) + 1
    return {
        "job": f"{job['name']}#{job_id}", "job_id": job_id, "state": _public_state(job["state"]),
        "reason": job["reason"], "steps_target": spec.get("steps"),
        "steps_completed": max(steps) + 1 if steps else 0, "final_loss": final_loss,
        "wall_s": round(led.wall_s, 3), "productive_s": round(led.productive_s, 3),
        "ettr": round(led.ettr, 5), "window_ettr": round(led.window_ettr, 5),
        "unproductive_s": {k: round(v, 3) for k, v in led.unproductive.items()},
        "steps_lost": led.steps_lost, "incidents": incidents, "incidents_by_mechanism": by_mech,
        "machines": machines, "runs": runs, "losses": {str(k): v for k, v in losses.items()},
        "control_plane": gaps,
        "layout": {k: spec.get(k) for k in ("machines", "gpus_per_machine", "tp", "pp", "dp")},
    }


def _public_state(state: str) -> str:
    return state if state in ("succeeded", "failed", "cancelled") else "running"


def render_html(rep: dict) -> str:
    """A self-contained HTML page: summary, ETTR buckets, incidents, runs, loss curve (SVG)."""
    esc = html.escape
    rows = "".join(
        f"<tr><td>{i['id']}</td><td>{esc(str(i['symptom']))}</td><td>{esc(str(i['mechanism']))}</td>"
        f"<td>{esc(', '.join(i['machine_suspects']))}</td><td>{esc(', '.join(i['machines_evicted']))}</td>"
        f"<td>{i['detected_at']}</td><td>{i['resumed_at']}</td><td>{esc(str(i['cause']))}</td></tr>"
        for i in rep["incidents"])
    buckets = "".join(f"<tr><td>{esc(k)}</td><td>{v:.2f}</td></tr>" for k, v in rep["unproductive_s"].items())
    pts = [(int(s), l) for s, l in rep["losses"].items() if l is not None]
    svg = ""
    if len(pts) > 1:
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
        sx = lambda x: 10 + 580 * (x - x0) / max(1, x1 - x0)
        sy = lambda y: 190 - 180 * (y - y0) / max(1e-9, y1 - y0)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        svg = (f'<svg width="600" height="200" style="border:1px solid #ccc">'
               f'<polyline fill="none" stroke="#2563eb" points="{path}"/></svg>')
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>stalwart {esc(rep['job'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{border:1px solid #ddd;padding:4px 8px}}
table{{border-collapse:collapse;margin-bottom:1.5em}}</style></head><body>
<h1>stalwart report: {esc(rep['job'])}</h1>
<p>state <b>{esc(rep['state'])}</b>{(' (' + esc(rep['reason']) + ')') if rep.get('reason') else ''};
steps {rep['steps_completed']}/{rep['steps_target']}; final loss {rep['final_loss']};
wall {rep['wall_s']:.1f}s; productive {rep['productive_s']:.1f}s; <b>ETTR {rep['ettr']:.3f}</b></p>
<h2>Unproductive time (s)</h2><table>{buckets}</table>
<h2>Incidents</h2><table><tr><th>id</th><th>symptom</th><th>mechanism</th><th>suspects</th>
<th>evicted</th><th>detected (s)</th><th>resumed (s)</th><th>cause</th></tr>{rows}</table>
<h2>Loss</h2>{svg}
<h2>Raw</h2><pre>{esc(json.dumps({k: v for k, v in rep.items() if k != 'losses'}, indent=1))}</pre>
</body></html>"""
