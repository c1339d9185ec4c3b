"""controller/metrics.py: the exposition, parsed back with prometheus_client's parser, says what
the job's report says; labels stay bounded; each controller has its own registry."""
import time

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from synthjob import write_synthetic_job

from stalwart.controller.ledger import BUCKETS
from stalwart.controller.metrics import ControllerMetrics, incident_latencies
from stalwart.controller.report import build_report
from stalwart.controller.store import Store

ALLOWED_LABELS = {"state", "bucket", "symptom", "category", "mechanism", "tier", "le", "route", "method",
                  "code", "job_id", "name"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("metrics")
    store = Store(f"sqlite:///{d}/s.db")
    try:
        job = write_synthetic_job(store, machines=40, standby=4, incidents=3, steps=400, gpus=2)
        rep = build_report(store, job, now=time.time())
    finally:
        store.close()
    rep["live"] = {"state": "running", "step": rep["steps_completed"], "loss": 1.5, "steps_per_s": 2.0,
                   "standby": ["m37"], "slots": []}
    return rep


def machines_of(rep):
    return [{"id": m["id"], "state": m["state"], "alive": m["id"] != "m0"} for m in rep["machines"]]


def samples(metrics: ControllerMetrics) -> dict:
    body, ctype = metrics.exposition()
    assert ctype.startswith("text/plain; version=0.0.4")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            assert set(s.labels) <= ALLOWED_LABELS, s
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(out, metric, **labels):
    return out[(metric, tuple(sorted(labels.items())))]


def test_job_metrics_equal_the_report(report):
    out = samples(ControllerMetrics(lambda: report, lambda: machines_of(report)))
    assert v(out, "stalwart_ettr_ratio") == report["ettr"]
    assert v(out, "stalwart_ettr_window_ratio") == report["window_ettr"]
    assert v(out, "stalwart_steps_completed") == report["steps_completed"]
    assert v(out, "stalwart_steps_per_second") == 2.0 and v(out, "stalwart_loss") == 1.5
    assert v(out, "stalwart_job_state", state="running") == 1
    assert sum(val for (n, _), val in out.items() if n == "stalwart_job_state") == 1
    assert v(out, "stalwart_job_info", job_id=str(report["job_id"]), name="synthetic") == 1
    for b in BUCKETS:
        assert v(out, "stalwart_unproductive_seconds_total", bucket=b) == report["unproductive_s"][b]
    assert v(out, "stalwart_productive_seconds_total") == report["productive_s"]
    assert v(out, "stalwart_incidents_total", symptom="gpu_xid", category="explicit",
             mechanism="evict_restart") == len(report["incidents"]) == 3
    assert v(out, "stalwart_restarts_total") == len(report["runs"]) - 1 == 3
    assert v(out, "stalwart_restore_ranks_total", tier="own") == len(report["runs"])
    assert v(out, "stalwart_standby_pool_size") == 1
    counts = {s: sum(m["state"] == s for m in report["machines"]) for s in ("active", "standby", "evicted")}
    assert counts == {"active": 33, "standby": 4, "evicted": 3}
    for s, n in counts.items():
        assert v(out, "stalwart_machines", state=s) == n
    assert v(out, "stalwart_machines_unreachable") == 1          # m0 is active and silent


def test_latency_histograms_hold_each_incident(report):
    out = samples(ControllerMetrics(lambda: report, list))
    det = [i["detection_s"] for i in report["incidents"]]
    loc = [i["localized_at"] - i["detected_at"] for i in report["incidents"]]
    assert v(out, "stalwart_detection_seconds_count") == 3
    assert v(out, "stalwart_detection_seconds_sum") == pytest.approx(sum(det))
    assert v(out, "stalwart_localization_seconds_sum") == pytest.approx(sum(loc))
    assert v(out, "stalwart_detection_seconds_bucket", le="0.5") == sum(d <= 0.5 for d in det)
    assert v(out, "stalwart_detection_seconds_bucket", le="1.0") == sum(d <= 1.0 for d in det)
    buckets = sorted((float(dict(k[1])["le"]), val) for k, val in out.items()
                     if k[0] == "stalwart_localization_seconds_bucket")
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)     # cumulative
    assert buckets[-1] == (float("inf"), 3)


def test_incident_latencies_skip_planned_and_fall_back_to_the_ledger():
    rep = {"incidents": [
        {"detection_s": 0.4, "detected_at": 10.0, "localized_at": 12.5, "mechanism": "evict_restart",
         "ledger": {"detection": 0.3}},
        {"detection_s": None, "detected_at": 20.0, "localized_at": None, "mechanism": None,
         "ledger": {"detection": 1.25}},
        {"detection_s": None, "detected_at": 30.0, "localized_at": 30.1, "mechanism": "hot_update",
         "ledger": {"planned": True, "detection": 0.0}},
    ]}
    assert incident_latencies(rep) == ([0.4, 1.25], [2.5])


def test_an_incident_still_localizing_counts_as_pending(report):
    rep = dict(report, incidents=[dict(report["incidents"][0], mechanism=None)])
    out = samples(ControllerMetrics(lambda: rep, list))
    assert v(out, "stalwart_incidents_total", symptom="gpu_xid", category="explicit", mechanism="pending") == 1


def test_no_job_yet_and_request_latency_and_registries_apart():
    a = ControllerMetrics(lambda: None, lambda: [{"id": "m0", "state": "idle", "alive": True}])
    b = ControllerMetrics(lambda: None, list)
    a.observe_request("health", "GET", 200, 0.003)
    a.observe_request("health", "GET", 200, 0.2)
    out = samples(a)
    assert not any(n.startswith("stalwart_ettr") for n, _ in out)
    assert v(out, "stalwart_machines", state="idle") == 1
    key = {"route": "health", "method": "GET", "code": "200"}
    assert v(out, "stalwart_api_request_duration_seconds_count", **key) == 2
    assert v(out, "stalwart_api_request_duration_seconds_sum", **key) == pytest.approx(0.203)
    assert v(out, "stalwart_api_request_duration_seconds_bucket", le="0.005", **key) == 1
    assert ("stalwart_api_request_duration_seconds_count", tuple(sorted(key.items()))) not in samples(b)
    assert REGISTRY.get_sample_value("stalwart_api_request_duration_seconds_count", key) is None


def test_request_latency_matches_prometheus_clients_histogram():
    """The lock-free request histogram exposes what prometheus_client's Histogram would: same
    buckets (a value on a bound counts in it), +Inf, count and sum."""
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from stalwart.controller.metrics import REQUEST_BUCKETS

    ours = ControllerMetrics(lambda: None, list)
    reg = CollectorRegistry()
    ref = Histogram("stalwart_api_request_duration_seconds", "x", ["route", "method", "code"],
                    buckets=REQUEST_BUCKETS, registry=reg)
    rng = random.Random(3)
    values = [rng.choice(REQUEST_BUCKETS) for _ in range(50)] + [rng.uniform(0, 40) for _ in range(200)]
    for i, x in enumerate(values):
        route, code = ("agent_events", 200) if i % 3 else ("health", 404)
        ours.observe_request(route, "POST", code, x)
        ref.labels(route, "POST", str(code)).observe(x)
    mine = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in ours.registry.collect() for s in m.samples if s.name.startswith("stalwart_api_request")}
    theirs = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for m in reg.collect() for s in m.samples if not s.name.endswith("_created")}
    assert mine.keys() == theirs.keys()
    for k, val in theirs.items():
        assert mine[k] == pytest.approx(val), k
