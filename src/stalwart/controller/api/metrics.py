"""Prometheus metrics of a controller (``GET /metrics``), with ``prometheus_client``.

Every job-level series carries ``job_id`` and ``job_name`` labels and the exposition holds every
job the controller runs (``submit`` runs several at once), the jobs that ended in the last
``KEEP_ENDED_S`` and the newest one. Not ``job``: Prometheus sets ``job`` on every scraped series
to the scrape config's name and renames a target's own ``job`` label to ``exported_job``
(``honor_labels: false``, the default), so a ``job`` label would be renamed on arrival.

The values are computed at scrape time from the jobs' reports (``StatusSource.status``), so the
gauges are what ``stalwart report`` says at that moment. Counters follow Prometheus' rule that a
counter never goes down while its process lives:

- the ledger is rebuilt with hindsight (time counted as ``other`` after the last step becomes
  productive when the next step lands; a step later redone moves from productive to
  ``lost_progress``), so each counter is a ratchet: a scrape shows the highest value that series
  has shown in this process (:class:`Ratchet`). A bucket may then lead the report by the part
  that hindsight moved elsewhere, a fraction of a second per step; ``rate()`` and ``increase()``
  are right, and a restarted controller starts its counters afresh (a counter reset, which
  ``rate()`` handles).
- an incident is counted (``stalwart_incidents_total``) once it is localized, with the symptom,
  category and mechanism it had then; while it localizes it is in the gauge
  ``stalwart_incidents_open``. Its detection and localization latencies are observed once, when
  first known (a histogram's buckets are counters too).

Labels are bounded: states, symptoms, categories, mechanisms, ledger buckets, restore tiers and API
routes are small fixed sets, jobs are the few described now; nothing is labelled per step, rank or
machine. Each controller has its own ``CollectorRegistry`` (never the global one), so several
controllers in one process (tests) do not mix.
"""
from __future__ import annotations

import bisect
import logging
import threading
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
from stalwart.controller.report.ledger import BUCKETS

log = logging.getLogger("stalwart.metrics")

KEEP_ENDED_S = 600.0      # an ended job stays described this long (a scrape sees how it ended)
JOB_STATES = tuple(p.value for p in JobPhase)
MACHINE_STATES = ("provisioning", "idle", "standby", "active", "evicted", "released")
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

Summaries = Callable[[], "list[dict]"]
Machines = Callable[[], "list[dict]"]


def incident_latencies(rep: dict) -> tuple[dict[int, float], dict[int, float]]:
    """(detection, localization) seconds of the job's unplanned incidents, by incident id.

    Detection: injection -> detected when the fault's time is known (``detection_s``), else the
    ledger's detection phase (end of the last good step -> detected). Localization: detected ->
    localized, for localized incidents.
    """
    det: dict[int, float] = {}
    loc: dict[int, float] = {}
    for inc in rep.get("incidents", []):
        led = inc.get("ledger") or {}
        if led.get("planned") or inc.get("mechanism") == "hot_update":
            continue
        if inc.get("detection_s") is not None:
            det[inc["id"]] = float(inc["detection_s"])
        elif led.get("detection") is not None:
            det[inc["id"]] = float(led["detection"])
        if inc.get("localized_at") is not None and inc.get("detected_at") is not None:
            loc[inc["id"]] = max(0.0, float(inc["localized_at"]) - float(inc["detected_at"]))
    return det, loc


def histogram(name: str, doc: str, values: Iterable[float], buckets: tuple[float, ...],
              labels: tuple[list[str], list[str]] = ([], [])) -> HistogramMetricFamily:
    """A histogram family from raw observations (cumulative bucket counts, sum); `labels` is
    (names, values) of its one series."""
    values = sorted(values)
    counts, i = [], 0
    for le in buckets:
        while i < len(values) and values[i] <= le:
            i += 1
        counts.append((repr(float(le)), i))
    counts.append(("+Inf", len(values)))
    h = HistogramMetricFamily(name, doc, labels=labels[0])
    h.add_metric(labels[1], counts, sum(values))
    return h


JOB_LABELS = ["job_id", "job_name"]


class Observed:
    """What a job's metrics observe once and keep: each localized incident's labels, each
    incident's detection and localization latency (by incident id), as first seen."""

    def __init__(self) -> None:
        self.incidents: dict[int, tuple[str, str, str]] = {}
        self.detection: dict[int, float] = {}
        self.localization: dict[int, float] = {}

    def update(self, rep: dict) -> None:
        for i in rep.get("incidents", []):
            if i.get("mechanism") and i["id"] not in self.incidents:
                self.incidents[i["id"]] = (str(i.get("symptom")), str(i.get("category")), str(i["mechanism"]))
        det, loc = incident_latencies(rep)
        for inc_id, x in det.items():
            self.detection.setdefault(inc_id, x)
        for inc_id, x in loc.items():
            self.localization.setdefault(inc_id, x)


def job_families(rep: dict, seen: Observed | None = None) -> list[Metric]:
    """The metrics of one job from its report (with ``live`` while it runs); `seen` keeps what is
    observed once across scrapes (a fresh one: what this report alone says)."""
    if seen is None:
        seen = Observed()
    seen.update(rep)
    live = rep.get("live") or {}
    state = live.get("state") or rep.get("state")
    ids = [str(rep["job_id"]), str(rep["job"]).rsplit("#", 1)[0]]
    out: list[Metric] = []
    info = InfoMetricFamily("stalwart_job", "A job these metrics describe.", labels=JOB_LABELS)
    info.add_metric(ids, {})
    out.append(info)
    g = GaugeMetricFamily("stalwart_job_state", "1 for the job's current state, 0 for the others.",
                          labels=[*JOB_LABELS, "state"])
    for s in JOB_STATES:
        g.add_metric([*ids, s], 1.0 if s == state else 0.0)
    out.append(g)

    def one(family, name: str, doc: str, value) -> None:
        if value is not None:
            m = family(name, doc, labels=JOB_LABELS)
            m.add_metric(ids, float(value))
            out.append(m)

    def by(family, name: str, doc: str, label: str, values: dict) -> None:
        m = family(name, doc, labels=[*JOB_LABELS, label])
        for k, v in values.items():
            m.add_metric([*ids, str(k)], float(v))
        out.append(m)

    one(GaugeMetricFamily, "stalwart_steps_completed", "Steps completed and kept (the next step to run).",
        live.get("step", rep.get("steps_completed")))
    one(GaugeMetricFamily, "stalwart_steps_target", "Steps the job is to run.", rep.get("steps_target"))
    one(GaugeMetricFamily, "stalwart_steps_per_second", "Training throughput over the last 50 steps.",
        live.get("steps_per_s"))
    one(GaugeMetricFamily, "stalwart_loss", "Loss of the last committed step.", live.get("loss", rep.get("final_loss")))
    one(GaugeMetricFamily, "stalwart_ettr_ratio", "Effective training time ratio since the job started.",
        rep.get("ettr"))
    one(GaugeMetricFamily, "stalwart_ettr_window_ratio", "ETTR over the last hour (the ledger's sliding window).",
        rep.get("window_ettr"))
    one(GaugeMetricFamily, "stalwart_wall_seconds", "Wall time of the job so far.", rep.get("wall_s"))
    one(GaugeMetricFamily, "stalwart_standby_pool_size", "Standby machines kept warm for the job now.",
        len(live["standby"]) if "standby" in live else None)
    one(GaugeMetricFamily, "stalwart_standby_pool_target", "Standby machines the job's spec asks for.",
        live.get("standby_target"))
    one(CounterMetricFamily, "stalwart_productive_seconds", "Time in steps that were kept.",
        rep.get("productive_s") or 0.0)
    by(CounterMetricFamily, "stalwart_unproductive_seconds", "Unproductive time by ledger bucket "
       "(they add up to wall - productive, up to what hindsight moved).", "bucket",
       {b: (rep.get("unproductive_s") or {}).get(b) or 0.0 for b in BUCKETS})
    one(CounterMetricFamily, "stalwart_steps_lost", "Steps that ran and were redone after a restore.",
        rep.get("steps_lost") or 0)

    inc = CounterMetricFamily("stalwart_incidents", "Localized incidents by symptom, category and "
                              "resolving mechanism.", labels=[*JOB_LABELS, "symptom", "category", "mechanism"])
    counts: dict[tuple[str, str, str], int] = {}
    for key in seen.incidents.values():
        counts[key] = counts.get(key, 0) + 1
    for key, n in sorted(counts.items()):
        inc.add_metric([*ids, *key], float(n))
    out.append(inc)
    one(GaugeMetricFamily, "stalwart_incidents_open", "Incidents detected and still localizing.",
        sum(1 for i in rep.get("incidents", []) if not i.get("mechanism")))
    out.append(histogram("stalwart_detection_seconds", "Fault -> incident detected, per incident.",
                         seen.detection.values(), LATENCY_BUCKETS, (JOB_LABELS, ids)))
    out.append(histogram("stalwart_localization_seconds", "Incident detected -> culprit decided, "
                         "per incident.", seen.localization.values(), LATENCY_BUCKETS, (JOB_LABELS, ids)))

    runs = rep.get("runs") or []
    one(CounterMetricFamily, "stalwart_restarts", "Runs started after the first (restarts).", max(0, len(runs) - 1))
    by_tier: dict[str, int] = {}
    for r in runs:
        for t in ((r.get("restore") or {}).get("tiers") or {}).values():
            by_tier[str(t)] = by_tier.get(str(t), 0) + 1
    by(CounterMetricFamily, "stalwart_restore_ranks", "Rank restores by the checkpoint tier that served "
       "them.", "tier", dict(sorted(by_tier.items())))
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


class Ratchet:
    """Counters that never go down: each counter sample shows the highest value its series has
    shown (the report's ledger is rebuilt with hindsight and may move a fraction of a second
    between buckets). Series of jobs no longer described are forgotten."""

    def __init__(self) -> None:
        self.high: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def apply(self, families: list[Metric]) -> None:
        seen = set()
        for fam in families:
            if fam.type != "counter":
                continue
            for i, smp in enumerate(fam.samples):
                if not smp.name.endswith("_total"):
                    continue            # (a counter's _created sample, when there is one)
                key = (smp.name, tuple(sorted(smp.labels.items())))
                seen.add(key)
                top = max(smp.value, self.high.get(key, smp.value))
                self.high[key] = top
                if top != smp.value:
                    fam.samples[i] = smp._replace(value=top)
        for key in set(self.high) - seen:
            del self.high[key]


class JobCollector(Collector):
    """Collects at scrape time from ``summaries()`` (the reports of the jobs to describe),
    ``machines()`` and ``ping()`` (raises when the store is unreachable)."""

    def __init__(self, summaries: Summaries, machines: Machines, ping: Callable[[], None] | None = None):
        self.summaries = summaries
        self.machines = machines
        self.ping = ping
        self.ratchet = Ratchet()
        self.observed: dict[int, Observed] = {}
        self._lock = threading.Lock()       # (scrapes may overlap: one updates the state at a time)

    def describe(self) -> list[Metric]:
        return []           # families depend on the data: nothing to pre-register

    def collect(self) -> Iterable[Metric]:
        t = time.perf_counter()
        fams: list[Metric] = []
        up = 1.0
        try:
            if self.ping is not None:
                self.ping()
            reps = self.summaries()
        except Exception as e:      # the store is down (or a report failed): say so, keep serving
            log.warning("metrics: the job state could not be read: %s", e)
            up, reps = 0.0, []
        with self._lock:
            for rep in reps:
                fams += job_families(rep, self.observed.setdefault(int(rep["job_id"]), Observed()))
            for job_id in set(self.observed) - {int(r["job_id"]) for r in reps}:
                if up:
                    del self.observed[job_id]
            if up:
                self.ratchet.apply(fams)
        try:
            fams += machine_families(self.machines())
        except Exception as e:
            log.warning("metrics: the machines could not be read: %s", e)
        fams.append(GaugeMetricFamily("stalwart_store_up", "1 when the controller's store answered this "
                                      "scrape, 0 when it did not.", value=up))
        fams.append(GaugeMetricFamily("stalwart_metrics_build_seconds", "Time this scrape spent reading "
                                      "the jobs' state.", value=time.perf_counter() - t))
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

    def __init__(self, summaries: Summaries, machines: Machines, ping: Callable[[], None] | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.jobs = JobCollector(summaries, machines, ping)
        self.registry.register(self.jobs)
        self.requests = RequestLatency()
        self.registry.register(self.requests)

    def observe_request(self, route: str, method: str, code: int, seconds: float) -> None:
        self.requests.observe(route, method, code, seconds)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the classic text format (0.0.4: every Prometheus reads it)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
