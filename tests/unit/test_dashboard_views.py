"""controller/api/dashboard.py and controller/report/series.py: the JSON the live page polls, from a job's
report, events and machines."""
import time

import pytest
from synthjob import write_synthetic_job

from stalwart.controller.api import dashboard as dash
from stalwart.controller.report import ledger
from stalwart.controller.report import series
from stalwart.controller.report.build import build_report
from stalwart.controller.store.db import Store

T = 1_700_000_000.0


def ev(i, t, kind, **data):
    return {"id": i, "t": T + t, "kind": kind, "data": data}


def small_log():
    log = [ev(1, 0, "job_submitted"), ev(2, 1, "run_started", run=1)]
    log += [ev(3 + s, 2 + s, "step", run=1, step=s, dur=1.0, loss=10.0 - s) for s in range(5)]
    log += [ev(8, 7.5, "incident_opened", incident=1, symptom="gpu_xid", injected_at=None),
            ev(9, 8.0, "incident_localized", incident=1), ev(10, 9.0, "run_started", run=2)]
    log += [ev(11 + s, 10 + s * 0.5, "step", run=2, step=3 + s, dur=0.5, loss=7.0 - s) for s in range(4)]
    return log


def test_step_points_rate_per_run_and_cursor():
    log = small_log()
    out = series.step_points(log, T)
    pts = out["points"]
    assert [p[1] for p in pts] == [0, 1, 2, 3, 4, 3, 4, 5, 6]
    assert pts[0][3] is None and pts[1][3] == pytest.approx(1.0)        # 1 step per second in run 1
    assert pts[5][3] is None and pts[6][3] == pytest.approx(2.0)        # run 2 starts its own window
    assert pts[0][0] == 2.0 and pts[-1][4] == 2
    assert out["next"] == 14
    later = series.step_points(log, T, since=12)
    assert [p[1] for p in later["points"]] == [5, 6] and later["next"] == 14
    assert series.step_points(log, T, since=14)["points"] == []


def test_first_load_is_strided_but_keeps_the_last_point():
    log = [ev(1, 0, "job_submitted")] + [ev(2 + s, 1 + s, "step", run=1, step=s, dur=1.0, loss=1.0)
                                          for s in range(1001)]
    pts = series.step_points(log, T, max_points=100)["points"]
    assert len(pts) <= 101 and pts[-1][1] == 1000 and pts[0][1] == 0


def test_ettr_curve_is_the_ledger_series_from_zero():
    log = small_log()
    curve = series.ettr_curve(log, T + 12, points=6, window_s=3600)
    ref = ledger.series(log, T + 12, points=6, window_s=3600)
    assert curve[0] == [0.0, 0.0, 0.0]
    assert [c[1] for c in curve[1:]] == [round(p["ettr"], 5) for p in ref]
    assert series.ettr_curve([ev(1, 0, "step", run=1, step=0, dur=1.0)], T + 1) == []


def test_series_payload_without_a_job_start_is_empty():
    out = series.series_payload([], time.time(), since=3)
    assert out["steps"] == {"points": [], "next": 3} and out["ettr"] == []


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("dash")
    store = Store(f"sqlite:///{d}/s.db")
    try:
        job = write_synthetic_job(store, machines=1024, standby=16, incidents=8, steps=600)
        return build_report(store, job, now=time.time()), store.incidents(job), store.events(job)
    finally:
        store.close()


def test_machine_grid_of_1024_machines_sends_each_reason_once(big):
    rep, _, _ = big
    grid = dash.machine_grid(rep, [])
    assert len(grid["rows"]) == 1024
    assert grid["counts"]["active"] == 1000 and grid["counts"]["evicted"] == 8 and grid["counts"]["standby"] == 16
    assert len(grid["reasons"]) == 8
    evicted = [r for r in grid["rows"] if r[1] == "evicted"]
    assert all(grid["reasons"][r[4]].endswith(r[0]) for r in evicted)   # "... on m17"
    assert sorted(r[3] for r in grid["rows"] if r[1] == "active") == list(range(1000))
    # the controller's own table wins over the store's
    live = [{"id": "m5", "state": "active", "alive": False, "job_id": rep["job_id"]}]
    row = next(r for r in dash.machine_grid(rep, live)["rows"] if r[0] == "m5")
    assert row[2] == 0


def test_incident_detail_by_report_id_not_database_key(big):
    rep, stored, events = big
    # renumber the report's incidents (a per-job sequence, say): the stored row is found by position
    rep = dict(rep, incidents=[dict(i, id=100 + k) for k, i in enumerate(rep["incidents"])])
    events = [dict(e, data={**e["data"], "incident": e["data"]["incident"] + 99})
              if "incident" in e["data"] else e for e in events]
    d = dash.incident_detail(rep, stored, events, 101)
    assert d["id"] == 101 and d["evicted"] == stored[1]["evicted"]
    assert d["stacks"][0]["processes"] == [f"{stored[1]['evicted'][0]}/rank0/worker[S]"]
    kinds = [e["kind"] for e in d["evidence"]]
    assert {"chaos_applied", "health", "incident_opened", "incident_localized", "incident_resumed"} <= set(kinds)
    assert all(e["data"].get("incident", 101) == 101 for e in d["evidence"])
    assert d["phases"]["detection"] > 0 and d["phases"]["failover"] > 0
    with pytest.raises(LookupError, match="no incident 1 "):
        dash.incident_detail(rep, stored, events, 1)


def test_overview(big):
    rep, _, _ = big
    ov = dash.overview(rep, [])
    assert ov["restarts"] == 8 and ov["standby_pool"] == 16 and ov["restore_tiers"] == {"own": 9}
    assert len(ov["incidents"]) == 8 and ov["incidents"][0]["phases"]["detection"] > 0
    live = dict(rep, live={"state": "recovering", "step": 5, "standby": ["m1"], "slots": ["m0"]})
    ov = dash.overview(live, [])
    assert ov["phase"] == "recovering" and ov["standby_pool"] == 1 and ov["step"] == 5


def test_static_files_ship_with_the_package():
    body, ctype = dash.static_file("app.js")
    assert b"stalwartDash" in body and ctype.startswith("text/javascript")
    html, _ = dash.static_file("index.html")
    assert b"/static/app.js" in html and b"http" not in html
    with pytest.raises(LookupError):
        dash.static_file("../cli.py")


class _NoJobs:
    def latest(self):
        return None

    def resolve(self, job):
        raise LookupError("no job has been submitted yet")


def test_overview_before_the_first_job_waits_instead_of_failing():
    views = dash.DashboardViews(_NoJobs())
    assert views.overview("latest") == {"job": None, "job_id": None}
    with pytest.raises(LookupError):
        views.overview("3")
