"""Prometheus metrics of a controller (``GET /metrics``), with ``prometheus_client``.

Job metrics describe the controller's newest job (a controller runs one job at a time);
``stalwart_job_info{job_id,name}`` says which. They are computed at scrape time from a summary
provider (by default the job's report, ``StatusSource.status``), so they are exactly what
``stalwart report`` says at that moment. Labels are bounded: states, symptoms, categories,
mechanisms, ledger buckets, restore tiers and API routes are small fixed sets; nothing is labelled
per step, rank or machine. Each controller has its own ``CollectorRegistry`` (never the global one),
so several controllers in one process (tests) do not mix.

The ledger is rebuilt with hindsight at each scrape: time counted as ``other`` after the last step
becomes productive when the next step lands, and a step later redone moves from productive to
``lost_progress``. ``stalwart_unproductive_seconds_total`` can therefore move back by a fraction of
a second between scrapes; plot it as is, or use ``deriv()``, rather than ``rate()``.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from stalwart.controller.job.state import JobPhase
from stalwart.controller.ledger import BUCKETS

JOB_STATES = tuple(p.value for p in JobPhase)
MACHINE_STATES = ("provisioning", "idle", "standby", "active", "evicted", "released")
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

Summary = Callable[[], "dict | None"]
Machines = Callable[[], "list[dict]"]


def incident_latencies(rep: dict) -> tuple[list[float], list[float]]:
    """(detection, localization) seconds of the job's unplanned incidents.

    Detection: injection -> detected when the fault's time is known (``detection_s``), else the
    ledger's detection phase (end of the last good step -> detected). Localization: detected ->
    localized, for localized incidents.
    """
    det, loc = [], []
    for inc in rep.get("incidents", []):
        led = inc.get("ledger") or {}
        if led.get("planned") or inc.get("mechanism") == "hot_update":
            continue
        if inc.get("detection_s") is not None:
            det.append(float(inc["detection_s"]))
        elif led.get("detection") is not None:
            det.append(float(led["detection"]))
        if inc.get("localized_at") is not None and inc.get("detected_at") is not None:
            loc.append(max(0.0, float(inc["localized_at"]) - float(inc["detected_at"])))
    return det, loc


def histogram(name: str, doc: str, values: Iterable[float], buckets: tuple[float, ...]) -> HistogramMetricFamily:
    """A histogram family from raw observations (cumulative bucket counts, sum)."""
    values = sorted(values)
    counts, i = [], 0
    for le in buckets:
        while i < len(values) and values[i] <= le:
            i += 1
        counts.append((repr(float(le)), i))
    counts.append(("+Inf", len(values)))
    return HistogramMetricFamily(name, doc, buckets=counts, sum_value=sum(values))


def job_families(rep: dict) -> list[Metric]:
    """The metrics of one job from its report (with ``live`` while it runs)."""
    live = rep.get("live") or {}
    state = live.get("state") or rep.get("state")
    out: list[Metric] = []
    info = InfoMetricFamily("stalwart_job", "The job these metrics describe (the controller's newest).",
                            labels=["job_id", "name"])
    info.add_metric([str(rep["job_id"]), str(rep["job"]).rsplit("#", 1)[0]], {})
    out.append(info)
    g = GaugeMetricFamily("stalwart_job_state", "1 for the job's current state, 0 for the others.",
                          labels=["state"])
    for s in JOB_STATES:
        g.add_metric([s], 1.0 if s == state else 0.0)
    out.append(g)

    def gauge(name: str, doc: str, value) -> None:
        if value is not None:
            out.append(GaugeMetricFamily(name, doc, value=float(value)))

    gauge("stalwart_steps_completed", "Steps completed and kept (the next step to run).",
          live.get("step", rep.get("steps_completed")))
    gauge("stalwart_steps_target", "Steps the job is to run.", rep.get("steps_target"))
    gauge("stalwart_steps_per_second", "Training throughput over the last 50 steps.", live.get("steps_per_s"))
    gauge("stalwart_loss", "Loss of the last committed step.", live.get("loss", rep.get("final_loss")))
    gauge("stalwart_ettr_ratio", "Effective training time ratio since the job started.", rep.get("ettr"))
    gauge("stalwart_ettr_window_ratio", "ETTR over the last hour (the ledger's sliding window).",
          rep.get("window_ettr"))
    gauge("stalwart_wall_seconds", "Wall time of the job so far.", rep.get("wall_s"))
    gauge("stalwart_standby_pool_size", "Standby machines kept warm for the job.",
          len(live["standby"]) if "standby" in live else None)
    out.append(CounterMetricFamily("stalwart_productive_seconds", "Time in steps that were kept.",
                                   value=float(rep.get("productive_s") or 0.0)))
    unp = CounterMetricFamily("stalwart_unproductive_seconds", "Unproductive time by ledger bucket "
                              "(they add up to wall - productive).", labels=["bucket"])
    for b in BUCKETS:
        unp.add_metric([b], float((rep.get("unproductive_s") or {}).get(b) or 0.0))
    out.append(unp)
    out.append(CounterMetricFamily("stalwart_steps_lost", "Steps that ran and were redone after a restore.",
                                   value=float(rep.get("steps_lost") or 0)))

    inc = CounterMetricFamily("stalwart_incidents", "Incidents by symptom, category and resolving "
                              "mechanism (pending while localizing).", labels=["symptom", "category", "mechanism"])
    by: dict[tuple[str, str, str], int] = {}
    for i in rep.get("incidents", []):
        key = (str(i.get("symptom")), str(i.get("category")), str(i.get("mechanism") or "pending"))
        by[key] = by.get(key, 0) + 1
    for key, n in sorted(by.items()):
        inc.add_metric(list(key), float(n))
    out.append(inc)
    det, loc = incident_latencies(rep)
    out.append(histogram("stalwart_detection_seconds", "Fault -> incident detected, per incident.",
                         det, LATENCY_BUCKETS))
    out.append(histogram("stalwart_localization_seconds", "Incident detected -> culprit decided, "
                         "per incident.", loc, LATENCY_BUCKETS))

    runs = rep.get("runs") or []
    out.append(CounterMetricFamily("stalwart_restarts", "Runs started after the first (restarts).",
                                   value=float(max(0, len(runs) - 1))))
    tiers = CounterMetricFamily("stalwart_restore_ranks", "Rank restores by the checkpoint tier that "
                                "served them.", labels=["tier"])
    by_tier: dict[str, int] = {}
    for r in runs:
        for t in ((r.get("restore") or {}).get("tiers") or {}).values():
            by_tier[str(t)] = by_tier.get(str(t), 0) + 1
    for t, n in sorted(by_tier.items()):
        tiers.add_metric([t], float(n))
    out.append(tiers)
    return out


def machine_families(machines: list[dict]) -> list[Metric]:
    g = GaugeMetricFamily("stalwart_machines", "Machines known to the controller, by state.", labels=["state"])
    counts = dict.fromkeys(MACHINE_STATES, 0)
    silent = 0
    for m in machines:
        counts[str(m.get("state"))] = counts.get(str(m.get("state")), 0) + 1
        silent += int(m.get("alive") is False and m.get("state") in ("active", "standby"))
    for s, n in counts.items():
        g.add_metric([s], float(n))
    u = GaugeMetricFamily("stalwart_machines_unreachable", "Active or standby machines whose agent "
                          "missed its heartbeats.", value=float(silent))
    return [g, u]


class JobCollector(Collector):
    """Collects at scrape time from ``summary()`` (the newest job's report or None) and ``machines()``."""

    def __init__(self, summary: Summary, machines: Machines):
        self.summary = summary
        self.machines = machines

    def describe(self) -> list[Metric]:
        return []           # families depend on the data: nothing to pre-register

    def collect(self) -> Iterable[Metric]:
        t = time.perf_counter()
        rep = self.summary()
        fams = job_families(rep) if rep is not None else []
        fams += machine_families(self.machines())
        fams.append(GaugeMetricFamily("stalwart_metrics_build_seconds", "Time this scrape spent reading "
                                      "the job's state.", value=time.perf_counter() - t))
        return fams


class RequestLatency(Collector):
    """``stalwart_api_request_duration_seconds``: the API's request latency by route, method and
    code. Observed by the API's event loop alone, thousands of times a second at scale: plain
    counters per label set (a bisect and two additions), no lock per observation as in
    prometheus_client's Histogram; a scrape reads a copy (a count at most one request behind)."""

    NAME = "stalwart_api_request_duration_seconds"
    DOC = "Controller API requests: seconds from request to reply, by route."

    def __init__(self, buckets: tuple[float, ...] = REQUEST_BUCKETS):
        self.bounds = tuple(float(b) for b in buckets)
        self.series: dict[tuple[str, str, str], list[float]] = {}   # bucket counts..., sum

    def observe(self, route: str, method: str, code: int, seconds: float) -> None:
        key = (route, method, str(code))
        row = self.series.get(key)
        if row is None:
            row = self.series[key] = [0.0] * (len(self.bounds) + 2)
        row[bisect.bisect_left(self.bounds, seconds)] += 1    # (the +Inf bucket: index len(bounds))
        row[-1] += seconds

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        h = HistogramMetricFamily(self.NAME, self.DOC, labels=["route", "method", "code"])
        for key, row in list(self.series.items()):
            row = list(row)
            cum, buckets = 0.0, []
            for le, n in zip([repr(b) for b in self.bounds] + ["+Inf"], row[:-1]):
                cum += n
                buckets.append((le, cum))
            h.add_metric(list(key), buckets, row[-1])
        yield h


class ControllerMetrics:
    """One controller's registry: the job collector and the API's request-latency histogram."""

    def __init__(self, summary: Summary, machines: Machines):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(summary, machines))
        self.requests = RequestLatency()
        self.registry.register(self.requests)

    def observe_request(self, route: str, method: str, code: int, seconds: float) -> None:
        self.requests.observe(route, method, code, seconds)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the classic text format (0.0.4: every Prometheus reads it)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
