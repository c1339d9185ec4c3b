"""`stalwart report --html`: one self-contained page (inline SVG, no script, no external reference)
that reads the same when mailed or attached to a ticket.

Plots: loss per step, steps/s over time, cumulative and sliding ETTR with the incidents marked on
the time axis, and a stacked bar of each incident's unproductive time by ledger phase.
"""
from __future__ import annotations

import html
import json
import os
import time

from stalwart.backends.statedir import db_path
from stalwart.controller.report.plots import COLORS, Mark, Series, line_chart, stacked_bars
from stalwart.controller.report.series import series_payload
from stalwart.transport.client import ApiError, Client, ControllerUnreachable

PHASES = ("detection", "localization", "failover", "lost_progress", "hot_update")
CSS = """body{font-family:sans-serif;margin:2em;color:#1f2937;max-width:1400px}
td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
table{border-collapse:collapse;margin-bottom:1.5em}.plots{display:flex;flex-wrap:wrap;gap:12px}
.plot{border:1px solid #e5e7eb;background:#fff}.kpi{display:inline-block;margin-right:2em}
.kpi b{font-size:1.4em;display:block}pre{white-space:pre-wrap;font-size:11px}"""


def incident_marks(rep: dict) -> list[Mark]:
    """One mark per incident: from detection to training resumed (or localized)."""
    out = []
    for i in rep.get("incidents", []):
        if i.get("detected_at") is None:
            continue
        end = i.get("resumed_at") if i.get("resumed_at") is not None else i.get("localized_at")
        out.append(Mark(float(i["detected_at"]), f"#{i['id']}: {i.get('symptom')} -> "
                        f"{i.get('mechanism') or 'localizing'}", x2=None if end is None else float(end)))
    return out


def plots(rep: dict, series: dict | None) -> dict[str, str]:
    """The report's SVG plots by name: loss, throughput, ettr, incidents."""
    pts = (series or {}).get("steps", {}).get("points") or []
    losses = [(int(s), v) for s, v in (rep.get("losses") or {}).items()]
    if not losses:
        losses = [(p[1], p[2]) for p in pts]
    marks = incident_marks(rep)
    out = {"loss": line_chart([Series("loss", sorted(losses), COLORS["loss"])], title="Loss per step",
                              x_label="step", y_label="loss")}
    out["throughput"] = line_chart([Series("steps/s", [(p[0], p[3]) for p in pts], COLORS["throughput"])],
                                   title="Throughput", x_label="seconds since the job started",
                                   y_label="steps/s", marks=marks, y_min=0.0)
    curve = (series or {}).get("ettr") or []
    win = (series or {}).get("window_s", 3600.0)
    out["ettr"] = line_chart([Series("cumulative ETTR", [(p[0], p[1]) for p in curve], COLORS["ettr"]),
                              Series(f"sliding ETTR ({win / 3600:g} h)", [(p[0], p[2]) for p in curve],
                                     COLORS["window_ettr"], dash="5 3")],
                             title="ETTR", x_label="seconds since the job started", y_label="ETTR",
                             marks=marks, y_min=0.0, y_max=1.0)
    bars = [(f"#{i['id']} {i.get('symptom')}", {k: (i.get("ledger") or {}).get(k, 0.0) for k in PHASES})
            for i in rep.get("incidents", [])]
    out["incidents"] = stacked_bars(bars, keys=PHASES, title="Unproductive time per incident")
    return out


def _table(head: list[str], rows: list[list]) -> str:
    esc = html.escape
    return ("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{esc('' if c is None else str(c))}</td>" for c in r) + "</tr>"
                      for r in rows) + "</table>")


def render(rep: dict, series: dict | None = None) -> str:
    """The whole page. ``series`` is the dashboard's series payload (steps with throughput, the
    ETTR curve); without it the throughput and ETTR plots say there is no data."""
    esc = html.escape
    p = plots(rep, series)
    steps = (f"{rep['steps_completed']}/{rep['steps_target']}" if rep.get("steps_target")
             else str(rep["steps_completed"]))          # (a plain script's steps have no target)
    kpis = [("state", rep["state"]), ("steps", steps),
            ("ETTR", f"{rep['ettr']:.3f}"), ("sliding ETTR", f"{rep.get('window_ettr', 0):.3f}"),
            ("wall", f"{rep['wall_s']:.1f} s"), ("incidents", len(rep["incidents"])),
            ("final loss", rep["final_loss"] if rep["final_loss"] is None else f"{rep['final_loss']:.4f}")]
    incidents = _table(["id", "symptom", "category", "mechanism", "suspects", "evicted", "detected (s)",
                        "resumed (s)", "detection", "localization", "failover", "lost", "cause"],
                       [[i["id"], i["symptom"], i["category"], i["mechanism"], ", ".join(i["machine_suspects"]),
                         ", ".join(i["machines_evicted"]), i["detected_at"], i["resumed_at"]]
                        + [f"{(i.get('ledger') or {}).get(k, 0.0):.2f}" for k in PHASES[:4]] + [i["cause"]]
                        for i in rep["incidents"]])
    buckets = _table(["bucket", "seconds"], [[k, f"{v:.2f}"] for k, v in rep["unproductive_s"].items()])
    runs = _table(["run", "steps", "started (s)", "stopped (s)", "machines", "restored from"],
                  [[r["id"], f"{r['start_step']}..{r['end_step'] if r['end_step'] is not None else ''}",
                    r["started_at"], r["stopped_at"], " ".join((r.get("machines") or {}).values()),
                    ", ".join(sorted(set(((r.get("restore") or {}).get("tiers") or {}).values())))]
                   for r in rep.get("runs", [])])
    machines = _table(["machine", "state", "reason"], [[m["id"], m["state"], m.get("reason")]
                                                       for m in rep.get("machines", [])])
    raw = json.dumps({k: v for k, v in rep.items() if k not in ("losses", "live")}, indent=1)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>stalwart {esc(rep['job'])}</title>
<style>{CSS}</style></head><body>
<h1>stalwart report: {esc(rep['job'])}</h1>
<p>{''.join(f'<span class="kpi">{esc(k)}<b>{esc(str(v))}</b></span>' for k, v in kpis)}</p>
{f'<p>reason: {esc(rep["reason"])}</p>' if rep.get('reason') else ''}
<div class="plots" id="plots">{p['ettr']}{p['throughput']}{p['loss']}{p['incidents']}</div>
<h2>Incidents</h2>{incidents}
<h2>Unproductive time (s)</h2>{buckets}
<h2>Runs</h2>{runs}
<h2>Machines</h2>{machines}
<details><summary>Raw report (JSON)</summary><pre>{esc(raw)}</pre></details>
</body></html>"""


def load_series(client: Client | None, state_dir: str, job_id: int) -> dict | None:
    """The series of a job for the report: from the controller `client` talks to when it
    answers, else from the state dir's store; None when neither has it."""
    if client is not None:
        try:
            return client.get(f"/api/jobs/{job_id}/series?points=200")
        except (ApiError, ControllerUnreachable):
            pass
    db = db_path(state_dir)
    if not os.path.exists(db):
        return None
    from stalwart.controller.store.db import Store       # (sqlalchemy: only where the store is read)
    store = Store(f"sqlite:///{db}")
    try:
        return series_payload(store.events(job_id), time.time(), points=200)
    finally:
        store.close()
