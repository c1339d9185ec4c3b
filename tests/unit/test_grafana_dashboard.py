"""docs/grafana-dashboard.json queries only metrics the controller exports, and all the names the
issue promises."""
import json
import os
import re
import time

from prometheus_client.parser import text_string_to_metric_families
from synthjob import write_synthetic_job

from stalwart.controller.metrics import ControllerMetrics
from stalwart.controller.report import build_report
from stalwart.controller.store import Store

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "grafana-dashboard.json")
PROMISED = {"stalwart_job_state", "stalwart_steps_completed", "stalwart_ettr_ratio", "stalwart_ettr_window_ratio",
            "stalwart_unproductive_seconds_total", "stalwart_incidents_total", "stalwart_detection_seconds",
            "stalwart_localization_seconds", "stalwart_machines"}


def exported(tmp_path) -> set[str]:
    store = Store(f"sqlite:///{tmp_path}/s.db")
    try:
        rep = build_report(store, write_synthetic_job(store, machines=10, standby=1, incidents=1, steps=300,
                                                      gpus=1), now=time.time())
    finally:
        store.close()
    rep["live"] = {"state": "running", "step": 1, "loss": 1.0, "steps_per_s": 1.0, "standby": []}
    m = ControllerMetrics(lambda: rep, lambda: [{"id": "m0", "state": "active", "alive": True}])
    m.observe_request("health", "GET", 200, 0.01)
    names = set()
    for fam in text_string_to_metric_families(m.exposition()[0].decode()):
        names.add(fam.name)
        names |= {s.name for s in fam.samples}
    return names


def test_grafana_dashboard_uses_exported_metrics(tmp_path):
    with open(DASHBOARD) as f:
        dash = json.load(f)
    used = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"stalwart_[a-z_]+", t["expr"])}
    have = exported(tmp_path)
    assert used - have == set()
    base = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert PROMISED <= base | used
