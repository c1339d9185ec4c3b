"""controller/api/metrics.py: the exposition, parsed back with prometheus_client's parser, says what
the jobs' reports say, each job under its own job_id/job_name labels; counters never go down across
a job's life; labels stay bounded; each controller has its own registry."""
import time

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from synthjob import write_synthetic_job

from stalwart.controller.report.ledger import BUCKETS
from stalwart.controller.api.metrics import ControllerMetrics, incident_latencies
from stalwart.controller.report.build import build_report
from stalwart.controller.store.db import Store
from stalwart.controller.store.ops import OpenIncident, UpdateIncident

ALLOWED_LABELS = {"state", "bucket", "symptom", "category", "mechanism", "tier", "le", "route", "method",
                  "code", "job_id", "job_name"}
CONTROLLER_LEVEL = {"stalwart_machines", "stalwart_machines_unreachable", "stalwart_store_up",
                    "stalwart_metrics_build_seconds"}


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
                   "standby": ["m37"], "standby_target": 4, "slots": []}
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
            if fam.name not in CONTROLLER_LEVEL and not fam.name.startswith("stalwart_api_"):
                assert {"job_id", "job_name"} <= set(s.labels), s       # every job-level series
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(out, metric, **labels):
    return out[(metric, tuple(sorted(labels.items())))]


def vj(out, rep, metric, **labels):
    """The value of a job-level series of the job of `rep`."""
    return v(out, metric, job_id=str(rep["job_id"]), job_name=rep["job"].rsplit("#", 1)[0], **labels)


def test_job_metrics_equal_the_report(report):
    out = samples(ControllerMetrics(lambda: [report], lambda: machines_of(report)))
    out = {(n, tuple(kv for kv in k if kv[0] not in ("job_id", "job_name"))): x for (n, k), x in out.items()}
    assert v(out, "stalwart_ettr_ratio") == report["ettr"]
    assert v(out, "stalwart_ettr_window_ratio") == report["window_ettr"]
    assert v(out, "stalwart_steps_completed") == report["steps_completed"]
    assert v(out, "stalwart_steps_per_second") == 2.0 and v(out, "stalwart_loss") == 1.5
    assert v(out, "stalwart_job_state", state="running") == 1
    assert sum(val for (n, _), val in out.items() if n == "stalwart_job_state") == 1
    assert v(out, "stalwart_job_info") == 1
    for b in BUCKETS:
        assert v(out, "stalwart_unproductive_seconds_total", bucket=b) == report["unproductive_s"][b]
    assert v(out, "stalwart_productive_seconds_total") == report["productive_s"]
    assert v(out, "stalwart_incidents_total", symptom="gpu_xid", category="explicit",
             mechanism="evict_restart") == len(report["incidents"]) == 3
    assert v(out, "stalwart_restarts_total") == len(report["runs"]) - 1 == 3
    assert v(out, "stalwart_restore_ranks_total", tier="own") == len(report["runs"])
    assert v(out, "stalwart_standby_pool_size") == 1 and v(out, "stalwart_standby_pool_target") == 4
    assert v(out, "stalwart_incidents_open") == 0 and v(out, "stalwart_store_up") == 1
    counts = {s: sum(m["state"] == s for m in report["machines"]) for s in ("active", "standby", "evicted")}
    assert counts == {"active": 33, "standby": 4, "evicted": 3}
    for s, n in counts.items():
        assert v(out, "stalwart_machines", state=s) == n
    assert v(out, "stalwart_machines_unreachable") == 1          # m0 is active and silent


def test_latency_histograms_hold_each_incident(report):
    out = samples(ControllerMetrics(lambda: [report], list))
    out = {(n, tuple(kv for kv in k if kv[0] not in ("job_id", "job_name"))): x for (n, k), x in out.items()}
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
    for inc, i in zip(rep["incidents"], (1, 2, 3)):
        inc["id"] = i
    assert incident_latencies(rep) == ({1: 0.4, 2: 1.25}, {1: 2.5})


def test_an_incident_still_localizing_is_open_not_counted(report):
    rep = dict(report, incidents=[dict(report["incidents"][0], mechanism=None)])
    out = samples(ControllerMetrics(lambda: [rep], list))
    assert vj(out, rep, "stalwart_incidents_open") == 1
    assert not any(n == "stalwart_incidents_total" for n, _ in out)


def test_no_job_yet_and_request_latency_and_registries_apart():
    a = ControllerMetrics(list, lambda: [{"id": "m0", "state": "idle", "alive": True}])
    b = ControllerMetrics(list, list)
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

    from stalwart.controller.api.metrics import REQUEST_BUCKETS

    ours = ControllerMetrics(list, list)
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


def test_two_jobs_on_one_controller_each_under_its_own_labels(report):
    other = dict(report, job_id=report["job_id"] + 1, job="second#" + str(report["job_id"] + 1), ettr=0.5,
                 live=dict(report["live"], state="recovering", step=7))
    out = samples(ControllerMetrics(lambda: [report, other], list))
    assert vj(out, report, "stalwart_ettr_ratio") == report["ettr"] and vj(out, other, "stalwart_ettr_ratio") == 0.5
    assert vj(out, report, "stalwart_job_state", state="running") == 1
    assert vj(out, other, "stalwart_job_state", state="recovering") == 1
    assert vj(out, other, "stalwart_steps_completed") == 7
    assert vj(out, other, "stalwart_job_info") == 1 and vj(out, report, "stalwart_job_info") == 1
    for b in BUCKETS:
        assert vj(out, other, "stalwart_unproductive_seconds_total", bucket=b) == report["unproductive_s"][b]
    ids = {dict(k)["job_id"] for n, k in out if n == "stalwart_ettr_ratio"}
    assert ids == {str(report["job_id"]), str(other["job_id"])}


def test_a_store_that_does_not_answer_is_a_gauge_not_a_failed_scrape(report):
    def down():
        raise OSError("connection refused")
    out = samples(ControllerMetrics(lambda: [report], list, ping=down))
    assert v(out, "stalwart_store_up") == 0
    assert not any(n.startswith("stalwart_ettr") for n, _ in out)


# -- a job's life: counters never go down ------------------------------------------------------------

def _life(store, job: int, t0: float):
    """A job's event log written as it would grow, yielding `now` for a scrape between events: steps
    of 1 s, scraped at varying points between them (the ledger rebuilt with hindsight then moves
    time from `other` to productive), a failure with an incident that localizes to another
    symptom than it opened with, steps redone after the restore."""
    store.add_event(job, "job_submitted", {"spec": {}}, t=t0)
    store.add_event(job, "run_started", {"run": 1, "start_step": 0, "machines": ["m0"]}, t=t0 + 1)
    t, step, run = t0 + 1, 0, 1
    for k in range(24):
        t += 1.0
        if k == 12:
            store.add_event(job, "incident_opened", {"incident": 1, "symptom": "exit", "planned": False}, t=t)
            store.commit(job, [OpenIncident(seq=1, run=1, symptom="exit", category="explicit", detected_at=t)], None)
            yield t + 0.5
            store.add_event(job, "incident_localized", {"incident": 1, "mechanism": "evict_restart"}, t=t + 1)
            store.commit(job, [UpdateIncident(seq=1, fields={"symptom": "gpu_xid", "mechanism": "evict_restart",
                                                             "localized_at": t + 1})], None)
            run, step, t = 2, step - 3, t + 3
            store.add_event(job, "run_started", {"run": run, "start_step": step, "machines": ["m1"]}, t=t)
            store.add_event(job, "incident_resumed", {"incident": 1}, t=t + 1)
            t += 1
        store.add_event(job, "step", {"run": run, "step": step, "dur": 1.0, "loss": 1.0}, t=t)
        step += 1
        yield t + (0.9 if k % 2 else 0.1)


def counters(out: dict) -> dict:
    return {k: x for k, x in out.items() if k[0].endswith(("_total", "_bucket", "_count", "_sum"))}


def test_no_counter_goes_down_across_a_jobs_life(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/life.db")
    try:
        t0 = time.time() - 100
        job = store.create_job("life", {"name": "life", "machines": 1, "steps": 100}, t0)
        store.update_job(job, state="running")
        reports: list[dict] = []
        metrics = ControllerMetrics(lambda: reports[-1:], list)
        prev: dict = {}
        raw_went_down = False
        for now in _life(store, job, t0):
            rep = build_report(store, job, now=now)
            if reports:
                raw_went_down |= any(x < reports[-1]["unproductive_s"][b] for b, x in rep["unproductive_s"].items())
            reports.append(rep)
            cur = counters(samples(metrics))
            for key, x in prev.items():
                assert cur.get(key, 0.0) >= x, (key, x, cur.get(key))
            prev = cur
        assert raw_went_down          # (the report's ledger does go down: the ratchet is what holds)
        key = ("stalwart_incidents_total", (("category", "explicit"), ("job_id", str(job)), ("job_name", "life"),
                                            ("mechanism", "evict_restart"), ("symptom", "gpu_xid")))
        assert prev[key] == 1
        assert sum(x for (n, _), x in prev.items() if n == "stalwart_localization_seconds_count") == 1
        assert sum(x for (n, _), x in prev.items() if n == "stalwart_unproductive_seconds_total") >= \
            sum(reports[-1]["unproductive_s"].values())
    finally:
        store.close()
