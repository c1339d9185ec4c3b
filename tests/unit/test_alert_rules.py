"""docs/alerts: the Prometheus rule file and the PrometheusRule object hold the same alerts, query
only metrics the controller exports, and stalwart-rules.test.yml (the `promtool test rules` cases
that tests/integration/test_alert_rules_promtool.py runs) makes every alert fire."""
import os
import re

import yaml
from test_grafana_dashboard import exported

ALERTS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "alerts")
EXPECTED = {"StalwartJobNotProgressing", "StalwartStandbyPoolEmpty", "StalwartETTRLow", "StalwartStoreUnreachable"}


def load(name: str):
    with open(os.path.join(ALERTS, name)) as f:
        return yaml.safe_load(f)


def test_rule_file_and_prometheusrule_hold_the_same_alerts():
    rules, obj = load("stalwart-rules.yml"), load("prometheusrule.yaml")
    assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "PrometheusRule"
    assert obj["metadata"]["name"] == "stalwart"
    assert obj["spec"] == rules
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert names == EXPECTED


def test_rules_use_exported_metrics_and_keep_the_job_labels(tmp_path):
    labels: dict[str, set] = {}
    have = exported(tmp_path, labels)
    for g in load("stalwart-rules.yml")["groups"]:
        for r in g["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
            assert re.fullmatch(r"\d+[smh]", r["for"]) and r["labels"]["severity"] in ("warning", "critical")
            used = set(re.findall(r"stalwart_[a-z_]+", r["expr"]))
            assert used and used <= have, (r["alert"], used - have)
            if any("job_id" in labels[n] for n in used):     # a job's alert names the job
                assert "$labels.job_id" in r["annotations"]["summary"], r["alert"]


def test_the_promtool_tests_cover_every_alert():
    tests = load("stalwart-rules.test.yml")
    assert tests["rule_files"] == ["stalwart-rules.yml"]
    fired = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == EXPECTED
