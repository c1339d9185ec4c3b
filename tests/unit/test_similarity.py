"""Minder-style peer similarity: detection, continuity, no false alarms."""

import numpy as np
import pytest

from stalwart.analyzer.similarity import (Continuity, align, all_window_scores, detect,
                                          find_suspects, normalize, reference_rows, window_scores)

METRICS = ["cpu", "step_time", "gpu_util", "pfc_tx"]


def healthy(rng, t=480, phase=0.0):
    """Periodic per-step metrics (period 12 s) with noise, shape (t, 4)."""
    x = np.arange(t)
    wave = np.sin(2 * np.pi * x / 12 + phase)
    cols = [50 + 20 * wave, 1.0 + 0.2 * wave, 80 + 10 * np.cos(2 * np.pi * x / 12 + phase),
            1000 + 300 * wave]
    out = np.stack(cols, axis=1)
    return out + rng.normal(0, 0.03, out.shape) * out.std(axis=0)


def cluster(seed=0, n=8, t=480):
    rng = np.random.default_rng(seed)
    return {f"m{i}": healthy(rng, t) for i in range(n)}


def diverge(series, machine, start, stop=None):
    """From `start` the machine's CPU and step time lose the step rhythm (a slow GPU)."""
    a = series[machine]
    stop = a.shape[0] if stop is None else stop
    rng = np.random.default_rng(99)
    a[start:stop, 0] = 15 + rng.normal(0, 1, stop - start)      # CPU drops to a flat line
    a[start:stop, 1] = 1.6 + rng.normal(0, 0.02, stop - start)  # step time up, flat


def test_divergent_machine_flagged_after_continuity_never_before():
    s = cluster()
    diverge(s, "m5", 100)
    reports = find_suspects(s, METRICS, now_index=479, continuity_s=240)
    assert [m for _, m in reports] == ["m5"]
    t_first = reports[0][0]
    assert 340 <= t_first <= 350
    # never flagged before the continuity window, whatever `now` the analyzer runs at
    assert find_suspects(s, METRICS, now_index=330, continuity_s=240) == []


def test_continuity_is_configurable_down_to_seconds():
    s = cluster()
    diverge(s, "m2", 100)
    reports = find_suspects(s, METRICS, now_index=200, continuity_s=5)
    assert reports and reports[0][1] == "m2" and 105 <= reports[0][0] <= 115


def test_all_healthy_reports_nothing():
    for seed in range(3):
        assert find_suspects(cluster(seed), METRICS, now_index=479, continuity_s=240) == []


def test_transient_blip_reports_nothing():
    s = cluster()
    diverge(s, "m3", 200, 210)  # a 10 s blip
    hits = [m for _, m, _ in detect(s, METRICS, now_index=479)]
    assert "m3" in hits  # the blip is seen by the detector ...
    assert find_suspects(s, METRICS, now_index=479, continuity_s=240) == []  # ... not reported


def test_detect_returns_window_candidates_with_scores():
    s = cluster()
    diverge(s, "m7", 50)
    found = detect(s, METRICS, now_index=120)
    late = [(t, m) for t, m, _ in found if t >= 60]
    assert late and all(m == "m7" for _, m in late)
    assert all(score > 0 for _, _, score in found)


def test_align_cuts_to_shortest_and_fills_gaps():
    a = np.array([[1.0], [np.nan], [np.nan], [4.0], [5.0]])
    machines, data = align({"a": a, "b": np.ones((4, 1)), "c": np.ones((6, 1))}, 1)
    assert machines == ["a", "b", "c"]
    assert data.shape == (3, 4, 1)
    assert data[0, :, 0].tolist() == [1.0, 1.0, 4.0, 4.0]


def test_normalize_and_scores():
    d = normalize(np.array([[[0.0], [10.0]], [[5.0], [5.0]], [[0.0], [0.0]]]))
    assert d.min() == 0.0 and d.max() == 1.0
    sc = window_scores(np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 4.0]]))
    assert sc.tolist() == [2.5, 2.5, 5.0]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least 3 machines"):
        detect({"a": np.ones((10, 4)), "b": np.ones((10, 4))}, METRICS, 5)
    with pytest.raises(ValueError, match="expected shape"):
        detect({k: np.ones((10, 3)) for k in "abc"}, METRICS, 5)
    with pytest.raises(ValueError, match="now_index"):
        detect({k: np.ones((10, 4)) for k in "abc"}, METRICS, 10)


def test_continuity_tracker():
    c = Continuity(continuity_s=30, grace_s=5)
    assert c.observe(0, "x") is None
    assert c.observe(10, "x") is None
    assert c.observe(14, None) is None          # within grace: the run goes on
    assert c.observe(30, "x") is None           # gap 16 s > grace: the run restarts at 30
    for t in range(33, 60, 3):
        assert c.observe(t, "x") is None
    assert c.observe(60, "x") == "x"
    c = Continuity(continuity_s=30, grace_s=5)
    for t in range(0, 31, 3):
        r = c.observe(t, "x")
    assert r == "x"
    assert c.observe(32, "y") is None           # another candidate resets
    with pytest.raises(ValueError, match="forward"):
        c.observe(1, "y")
    with pytest.raises(ValueError, match="positive"):
        Continuity(continuity_s=0)


def test_out_of_rhythm_machine_is_flagged():
    """Same values, wrong timing: a machine whose steps drift half a period out of phase."""
    rng = np.random.default_rng(5)
    s = {f"m{i}": healthy(rng) for i in range(8)}
    s["m1"][150:] = healthy(rng, phase=np.pi)[150:]
    reports = find_suspects(s, METRICS, now_index=479, continuity_s=240)
    assert [m for _, m in reports] == ["m1"] and reports[0][0] >= 390


@pytest.mark.parametrize("outlier", [0, 7, 1999])      # 0 and 1999 are references, 7 is not
def test_sampled_scores_find_the_outlier_of_a_large_group(outlier):
    rng = np.random.default_rng(outlier)
    x = 0.2 * np.sin(np.arange(8))[None] + rng.normal(0, 0.03, (2000, 8))
    x[outlier] += rng.normal(0, 0.15, 8)
    exact, sampled = window_scores(x, max_refs=2000), window_scores(x, max_refs=256)
    assert len(reference_rows(2000, 256)) == 256 and reference_rows(256, 256) is None
    assert exact.argmax() == sampled.argmax() == outlier
    healthy = np.delete(np.arange(2000), outlier)
    # every healthy machine's estimate within a small fraction of the spread between machines
    spread = exact[healthy].std()
    assert np.abs(sampled[healthy] - exact[healthy]).max() < 0.5 * spread
    assert np.corrcoef(sampled[healthy], exact[healthy])[0, 1] > 0.95
    z = [(s[outlier] - s[healthy].mean()) / s[healthy].std() for s in (exact, sampled)]
    assert z[0] > 10 and abs(z[1] - z[0]) < 0.05 * z[0]


def test_scores_of_a_small_group_compare_every_pair():
    x = np.random.default_rng(2).normal(size=(256, 8))
    d = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=2))
    assert np.allclose(window_scores(x), d.sum(axis=1) / 255)


def test_all_window_scores_match_one_window_at_a_time():
    x = np.random.default_rng(1).normal(size=(6, 20))
    allw = all_window_scores(x, 8)
    assert allw.shape == (13, 6)
    for i in range(13):
        assert np.allclose(allw[i], window_scores(x[:, i: i + 8]))


def test_start_index_and_lookback_restrict_the_windows():
    s = cluster()
    diverge(s, "m4", 100)
    full = detect(s, METRICS, now_index=300)
    assert detect(s, METRICS, now_index=300, start_index=250) == [f for f in full if f[0] >= 250]
    recent = detect(s, METRICS, now_index=300, lookback=60)  # Minder's "last N samples"
    assert [t for t, _, _ in recent] == list(range(248, 301))
    assert {m for _, m, _ in recent} == {"m4"}
    with pytest.raises(ValueError, match="lookback"):
        detect(s, METRICS, now_index=300, lookback=4)
