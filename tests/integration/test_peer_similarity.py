"""The peer-similarity detector at run time — a machine whose metrics stay unlike its
peers' (here a hot, throttled GPU: temperature up, SM clock down) past the continuity window is
reported and evicted, with no probe alert or crash to go on."""
import pytest

from jobrun import gpt_spec, run_job


@pytest.mark.timeout(300)
def test_machine_unlike_its_peers_is_evicted(tmp_path):
    s = gpt_spec(machines=4, gpus=1, steps=80, standby=1, chaos=["gpu-hot@step=15,machine=2"])
    # steps of at least 0.2 s: the 65 steps after the fault outlast the detector's window plus its
    # continuity (about 8 s) however fast this machine trains the tiny model
    s["command"] += ["--min-compute-s", "0.2"]
    # fail-slow off (a 99% drop) so only the similarity detector can act; a short continuity
    s["policy"].update(similarity_continuity_s=4.0, similarity_window_s=10.0, failslow_drop=0.99,
                       hang_timeout_floor_s=30.0)
    rep = run_job(tmp_path, s, timeout=280)
    assert rep["state"] == "succeeded", rep.get("reason")
    [inc] = rep["incidents"]
    assert (inc["symptom"], inc["category"], inc["machines_evicted"]) == ("peer_outlier", "implicit", ["m2"])
    assert "stayed unlike its peers" in inc["cause"]
    assert inc["detection_s"] is not None and inc["detection_s"] < 30, inc
