"""The trace detector on a real local cluster: the workers' flight-recorder hooks trace their gloo
collectives, the agents forward them, the controller learns the healthy traces, judges the run's
healthy stretch without a word, and names the machine whose GPU runs hot once it does (alert only:
trace_evict is off, and fail-slow and peer similarity are held back so nothing else acts)."""
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
