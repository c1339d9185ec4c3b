"""What a simulation measured: the ETTR ledger of every submission of the job, summed over the
simulated days; incidents by category and mechanism; the ETTR over time. Then the same over
several seeds and policies: the table, the JSON, the plot.

The ledger is the controller's (`controller.ledger`, rebuilt from each submission's event log);
between two submissions the job does not train: a requeue (`requeue`) or a person's diagnosis
and resubmission (`manual`), two buckets of their own. Steps a resubmitted job redid (after its
durable checkpoint) move from productive to `lost_progress`.
"""
from __future__ import annotations

import bisect
import math
import statistics
from collections import Counter
from typing import Any

from stalwart.controller.report import plots
from stalwart.controller.report import ledger
from stalwart.sim.engine import DAY, Sim

BUCKETS = ledger.BUCKETS + ("requeue", "manual")
PALETTE = ("#6b7280", "#f59e0b", "#16a34a", "#2563eb", "#ef4444", "#9333ea", "#0d9488", "#db2777", "#92400e")


GRID_S = 300.0          # the sliding window moves in 5-minute steps
WINDOW = 12            # grid steps in the paper's 1-hour window


def _kept_after(events: list[dict], step: int) -> list[tuple[float, float]]:
    """(start, end) of the kept executions of steps after `step`, in time order."""
    last: dict[int, tuple[float, float]] = {}
    for e in events:
        if e["kind"] == "step":
            last[e["data"]["step"]] = (e["t"] - e["data"]["dur"], e["t"])
    return sorted(iv for s, iv in last.items() if s > step)


def _covered(ivs: list[tuple[float, float]], times: list[float]) -> list[float]:
    """Seconds of the sorted, disjoint intervals `ivs` before each of `times`."""
    los = [lo for lo, _ in ivs]
    pref = [0.0]
    for lo, hi in ivs:
        pref.append(pref[-1] + hi - lo)
    out = []
    for t in times:
        j = bisect.bisect_right(los, t)
        out.append(pref[j] - (max(0.0, ivs[j - 1][1] - t) if j else 0.0))
    return out


def window_minutes(prod_at: list[float]) -> list[float]:
    """Unproductive minutes in every 1-hour window (the paper's sliding view), from productive
    seconds at each grid point."""
    return [max(0.0, 60.0 - (prod_at[i + WINDOW] - prod_at[i]) / 60.0) for i in range(len(prod_at) - WINDOW)]


def percentiles(xs: list[float]) -> dict[str, float]:
    """max, p99, p90, p50 (nearest rank) of unproductive minutes per sliding hour."""
    if not xs:
        return {"max": 0.0, "p99": 0.0, "p90": 0.0, "p50": 0.0}
    s = sorted(xs)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))], 2)
    return {"max": round(s[-1], 2), "p99": q(0.99), "p90": q(0.90), "p50": q(0.50)}


def summarize(sim: Sim, runtime_s: float) -> dict[str, Any]:
    """One policy on one trace."""
    start, wall = sim.segments[0].start if sim.segments else sim.end, sim.cfg.days * DAY
    hours = [i * GRID_S for i in range(int(wall // GRID_S) + 1)]
    prod_at = [0.0] * len(hours)
    buckets = dict.fromkeys(BUCKETS, 0.0)
    productive = 0.0
    for seg in sim.segments:
        events = sorted(seg.log, key=lambda e: e["t"])
        end = seg.end if seg.end is not None else sim.end
        led = ledger.compute(events, end)
        productive += led.productive_s
        for b, v in led.unproductive.items():
            buckets[b] += v
        rel = [h - (seg.start - start) for h in hours]
        # the ledger is asked only inside the submission: before it nothing, after it its total
        inside = [i for i, x in enumerate(rel) if 0 < x < end - seg.start]
        asked = ledger.productive_upto(events, end, [rel[i] for i in inside] + [end - seg.start])
        upto = [0.0 if x <= 0 else asked[-1] for x in rel]
        for k, i in enumerate(inside):
            upto[i] = asked[k]
        moved = _kept_after(events, seg.lost_after) if seg.lost_after is not None else []
        lost = sum(hi - lo for lo, hi in moved)
        productive -= lost
        buckets["lost_progress"] += lost
        redone = _covered(moved, [seg.start + x for x in rel])
        for i, x in enumerate(rel):
            if x > 0:
                prod_at[i] += upto[i] - redone[i]
    for lo, hi, why in sim.gaps:
        buckets[why] += max(0.0, min(hi, sim.end) - lo)
    minutes = window_minutes(prod_at)
    per_hour = WINDOW
    window = [1.0 - m / 60.0 for m in minutes[::per_hour]]
    cumulative = [prod_at[i] / hours[i] for i in range(per_hour, len(hours), per_hour)]
    mech = Counter((i["fault"], i["mechanism"] or "open") for i in sim.incidents)
    return {
        "policy": sim.platform.name, "seed": sim.seed, "ettr": productive / wall, "productive_s": productive,
        "wall_s": wall, "unproductive_s": buckets, "incidents": len(sim.incidents),
        "faults": dict(sim.injection.injected),
        "by_category_mechanism": {f"{f}/{m}": n for (f, m), n in sorted(mech.items())},
        "mechanisms": dict(Counter(i["mechanism"] or "open" for i in sim.incidents)),
        "evicted": sum(i.get("evicted", 0) for i in sim.incidents), "submissions": len(sim.segments),
        "throughput": (sim.pace.max_step + 1) * sim.cfg.step_s / wall,
        "window_ettr_min": min(window) if window else None,
        "window_1h_min": percentiles(minutes),
        "series_hours": {"cumulative": cumulative, "window": window},
        "runtime_s": runtime_s, "stats": dict(sim.stats),
    }


def aggregate(runs: list[dict]) -> dict[str, dict]:
    """Mean and spread per policy over seeds."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["policy"], []).append(r)
    out = {}
    for name, rs in by.items():
        e = [r["ettr"] for r in rs]
        mean = lambda key: statistics.fmean(r[key] for r in rs)  # noqa: E731
        mech: Counter = Counter()
        cats: Counter = Counter()
        for r in rs:
            mech.update(r["mechanisms"])
            cats.update(r["by_category_mechanism"])
        out[name] = {
            "ettr": statistics.fmean(e), "ettr_min": min(e), "ettr_max": max(e),
            "ettr_std": statistics.pstdev(e) if len(e) > 1 else 0.0,
            "unproductive_s": {b: statistics.fmean(r["unproductive_s"][b] for r in rs) for b in BUCKETS},
            "incidents": mean("incidents"), "evicted": mean("evicted"), "submissions": mean("submissions"),
            "throughput": mean("throughput"),
            "window_ettr_min": min((r["window_ettr_min"] for r in rs if r["window_ettr_min"] is not None),
                                   default=None),
            "window_1h_min": {"max": max(r["window_1h_min"]["max"] for r in rs),
                              **{q: round(statistics.fmean(r["window_1h_min"][q] for r in rs), 2)
                                 for q in ("p99", "p90", "p50")}},
            "mechanisms": {k: v / len(rs) for k, v in sorted(mech.items())},
            "by_category_mechanism": {k: v / len(rs) for k, v in sorted(cats.items())},
            "seeds": [r["seed"] for r in rs], "runtime_s": [round(r["runtime_s"], 2) for r in rs],
            "slowest_simulation_s": round(max(r["runtime_s"] for r in rs), 2),
        }
    return out


def _h(s: float) -> str:
    return f"{s / 3600:.1f}"


def table(agg: dict[str, dict]) -> str:
    """ETTR per policy side by side, with the spread and the unproductive hours by bucket."""
    cols = ("detection", "localization", "failover", "lost_progress", "hot_update", "startup", "requeue", "manual")
    short = ("detect", "locate", "failover", "lost", "hot-upd", "startup", "requeue", "manual")
    head = (f"{'policy':<22} {'ETTR':>7} {'std':>6} {'min':>7} {'max':>7} {'1h max':>6} {'1h p99':>6} " +
            " ".join(f"{c:>8}" for c in short) + f" {'incid.':>6} {'thrpt':>6}")
    lines = [head, "-" * len(head)]
    for name, r in agg.items():
        u = r["unproductive_s"]
        w = r["window_1h_min"]
        lines.append(f"{name:<22} {r['ettr']:>7.2%} {r['ettr_std']:>6.2%} {r['ettr_min']:>7.2%} {r['ettr_max']:>7.2%} "
                     f"{w['max']:>6.1f} {w['p99']:>6.1f} " +
                     " ".join(f"{_h(u[c]):>8}" for c in cols) +
                     f" {r['incidents']:>6.0f} {r['throughput']:>6.1%}")
    lines.append("unproductive time in hours (mean over seeds); '1h max' / '1h p99' = unproductive minutes in "
                 "the worst / 99th-percentile sliding hour (max over seeds / mean); thrpt = steps done / steps of "
                 "a job that never stops")
    return "\n".join(lines)


def mechanisms_table(agg: dict[str, dict], policy: str = "stalwart") -> str:
    r = agg.get(policy)
    if r is None:
        return ""
    lines = [f"incidents by category and mechanism ({policy}, mean per run):"]
    rows: dict[str, dict[str, float]] = {}
    for key, n in r["by_category_mechanism"].items():
        cat, mech = key.split("/", 1)
        rows.setdefault(cat, {})[mech] = n
    for cat, ms in sorted(rows.items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"  {cat:<18} " + ", ".join(f"{m} {n:.1f}" for m, n in sorted(ms.items(), key=lambda x: -x[1])))
    return "\n".join(lines)


def svg(runs: list[dict], title: str) -> str:
    """Cumulative ETTR of every policy (first seed) and stalwart's 1-hour sliding ETTR, over days."""
    seed = min(r["seed"] for r in runs)
    first = [r for r in runs if r["seed"] == seed]
    series = []
    for i, r in enumerate(first):
        pts = [((h + 1) / 24, v) for h, v in enumerate(r["series_hours"]["cumulative"]) if h % 6 == 5 or h < 24]
        series.append(plots.Series(r["policy"], pts, color=PALETTE[i % len(PALETTE)]))
    top = plots.line_chart(series, title=f"Cumulative ETTR ({title})", x_label="days", y_label="ETTR",
                           width=760, height=320)
    sw = next((r for r in first if r["policy"] == "stalwart"), first[0])
    win = [plots.Series(f"{sw['policy']}: 1-hour sliding ETTR",
                        [((h + 1) / 24, v) for h, v in enumerate(sw["series_hours"]["window"])],
                        color=plots.COLORS["window_ettr"])]
    bottom = plots.line_chart(win, title="1-hour sliding ETTR", x_label="days", y_label="ETTR", width=760,
                              height=240, y_min=0.0, y_max=1.0)
    bottom = bottom.replace("<svg ", '<svg y="330" ', 1)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="570" viewBox="0 0 760 570">'
            f'<rect width="760" height="570" fill="white"/>{top}{bottom}</svg>\n')


def json_doc(cfg: Any, profile: str, agg: dict[str, dict], runs: list[dict], runtime_s: float,
             user_s: float | None) -> dict:
    return {"gpus": cfg.gpus, "days": cfg.days, "runtime_s": round(runtime_s, 2), "cpu_user_s": user_s,
            "slowest_simulation_s": round(max((r["runtime_s"] for r in runs), default=0.0), 2),
            "profile": profile, "machines": cfg.machines, "step_s": cfg.step_s, "pp": cfg.pp,
            "policies": {name: {k: v for k, v in r.items()} for name, r in agg.items()},
            "runs": [{k: v for k, v in r.items() if k != "series_hours"} for r in runs]}


def finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)
