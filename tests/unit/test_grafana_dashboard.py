"""docs/grafana-dashboard.json queries only metrics the controller exports, all the names promised,
and picks the controller (instance) and the jobs with its variables."""
import json
import os
import re
import time

from prometheus_client.parser import text_string_to_metric_families
from synthjob import write_synthetic_job

from stalwart.controller.api.metrics import ControllerMetrics
from stalwart.controller.report.build import build_report
from stalwart.controller.store.db import Store

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "grafana-dashboard.json")
PROMISED = {"stalwart_job_state", "stalwart_steps_completed", "stalwart_ettr_ratio", "stalwart_ettr_window_ratio",
            "stalwart_unproductive_seconds_total", "stalwart_incidents_total", "stalwart_detection_seconds",
            "stalwart_localization_seconds", "stalwart_machines"}


def exported(tmp_path, labels: dict | None = None) -> set[str]:
    store = Store(f"sqlite:///{tmp_path}/s.db")
    try:
        rep = build_report(store, write_synthetic_job(store, machines=10, standby=1, incidents=1, steps=300,
                                                      gpus=1), now=time.time())
    finally:
        store.close()
    rep["live"] = {"state": "running", "step": 1, "loss": 1.0, "steps_per_s": 1.0, "standby": [], "standby_target": 1}
    m = ControllerMetrics(lambda: [rep], lambda: [{"id": "m0", "state": "active", "alive": True}])
    m.observe_request("health", "GET", 200, 0.01)
    names = set()
    for fam in text_string_to_metric_families(m.exposition()[0].decode()):
        names.add(fam.name)
        names |= {s.name for s in fam.samples}
        if labels is not None:
            for s in fam.samples:
                labels.setdefault(s.name, set()).update(s.labels)
    return names


def test_grafana_dashboard_uses_exported_metrics(tmp_path):
    with open(DASHBOARD) as f:
        dash = json.load(f)
    used = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"stalwart_[a-z_]+", t["expr"])}
    have = exported(tmp_path)
    assert used - have == set()
    base = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert PROMISED <= base | used


def test_every_query_follows_the_instance_and_job_variables(tmp_path):
    with open(DASHBOARD) as f:
        dash = json.load(f)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"instance", "job_id"}
    assert all(v["multi"] and v["includeAll"] for v in variables.values())
    labels: dict[str, set] = {}
    exported(tmp_path, labels)
    for p in dash["panels"]:
        for t in p["targets"]:
            for name in re.findall(r"stalwart_[a-z_]+", t["expr"]):
                sel = re.search(re.escape(name) + r"\{([^}]*)\}", t["expr"])
                assert sel and 'instance=~"$instance"' in sel.group(1), (p["title"], t["expr"])
                if "job_id" in labels[name]:        # a job-level series: the job variable too
                    assert 'job_id=~"$job_id"' in sel.group(1), (p["title"], t["expr"])
                    assert "{{job_id}}" in t["legendFormat"], (p["title"], t["legendFormat"])
