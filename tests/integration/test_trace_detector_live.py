"""The trace detector on a real local cluster: the workers' flight-recorder hooks trace their gloo
collectives, the agents forward them, the controller learns the healthy traces, judges the run's
healthy stretch without a word, and names the machine whose GPU runs hot once it does (alert only:
trace_evict is off, and fail-slow and peer similarity are held back so nothing else acts); and, on
machines with network namespaces of their own, names the machine whose link is slowed from the
workers' TCP figures and evicts it, the job being slowed (trace_evict on)."""
import os
import shutil

import pytest

from jobrun import gpt_spec, run_job
from stalwart.controller.store.db import Store

FAULT_AT = 110


@pytest.mark.timeout(240)
def test_a_hot_gpu_is_named_and_the_healthy_stretch_raises_nothing(tmp_path):
    s = gpt_spec(machines=4, gpus=1, steps=190, standby=1, chaos=[f"gpu-hot@step={FAULT_AT},machine=2"])
    s["command"] += ["--min-compute-s", "0.05"]
    s["policy"].update(trace_train_s=4.0, trace_window_s=1.0, trace_evict=False, failslow_drop=0.99,
                       hang_timeout_floor_s=30.0, warm_spares=False)
    rep = run_job(tmp_path, s, timeout=200)
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["incidents"] == []                        # an alert alone evicts nothing
    store = Store(f"sqlite:///{tmp_path}/stalwart.db")
    try:
        evs = store.events(1)
    finally:
        store.close()
    [fitted] = [e for e in evs if e["kind"] == "trace_model_fitted"]
    [applied] = [e for e in evs if e["kind"] == "chaos_applied"]
    alerts = [e for e in evs if e["kind"] == "trace_suspect"]
    assert fitted["t"] < applied["t"], (fitted, applied)
    before = [a for a in alerts if a["t"] < applied["t"]]
    assert before == [], before                          # judged healthy windows: no alert
    assert alerts, "the hot GPU was not named"
    first = alerts[0]
    assert first["data"]["machines"] == ["m2"], first
    assert first["data"]["collectives"] and first["t"] - applied["t"] < 20, first


NAMESPACES = os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "tc", "ss", "nsenter"))
LINK_AT = 90


@pytest.mark.skipif(not NAMESPACES, reason="link-slow needs root, iproute2 (ip, tc, ss) and nsenter")
@pytest.mark.timeout(180)
def test_a_slow_link_is_named_from_the_tcp_figures_and_evicted(tmp_path):
    s = gpt_spec(machines=4, gpus=1, steps=130, standby=1, chaos=[f"link-slow@step={LINK_AT},machine=2"])
    s["command"] += ["--min-compute-s", "0.05"]
    s["policy"].update(trace_train_s=4.0, trace_window_s=1.0, trace_evict=True, failslow_period_s=3.0,
                       warm_spares=False)
    rep = run_job(tmp_path, s, timeout=160, network="auto")
    assert rep["state"] == "succeeded", rep.get("reason")
    store = Store(f"sqlite:///{tmp_path}/stalwart.db")
    try:
        evs = store.events(1)
        incidents = store.incidents(1)
    finally:
        store.close()
    [fitted] = [e for e in evs if e["kind"] == "link_model_fitted"]
    [applied] = [e for e in evs if e["kind"] == "chaos_applied"]
    links = [e for e in evs if e["kind"] == "trace_suspect" and e["data"].get("link")]
    assert fitted["t"] < applied["t"], (fitted, applied)
    early = [(a["t"] - applied["t"], a["data"]["reason"]) for a in links if a["t"] < applied["t"]]
    assert not early, (early, fitted["data"])                           # the healthy stretch: no alert
    assert links and "m2" in links[0]["data"]["machines"], links
    assert links[0]["t"] - applied["t"] < 15, links[0]
    assert incidents and incidents[0]["evicted"] == ["m2"], incidents
    assert incidents[0]["symptom"] == "trace_outlier", incidents      # the link alert evicted it
