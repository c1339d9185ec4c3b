"""Peer-similarity watch over per-machine metric rows, with an explicit clock."""
import math
import random

import msgspec
import numpy as np

from stalwart.agent.metrics import MetricsSampler, gpu_means, schedstat, wait_share
from stalwart.controller.rules.peerwatch import METRICS, PeerWatch


def feed(w, t, odd=None, n=4, temp_odd=95.0):
    rng = random.Random(int(t * 10))
    for i in range(n):
        m = f"m{i}"
        w.add(m, t, {"gpu_temp": temp_odd if m == odd else 45 + rng.random(),
                     "cpu": 0.9 + 0.05 * rng.random(), "step_s": 0.1 + 0.01 * rng.random()})


def run(w, odd_from=None, odd=None, until=60.0):
    return run_from(w, 0.0, odd_from, odd, until)


def run_from(w, t, odd_from=None, odd=None, until=None):
    first = None
    until = t + 60.0 if until is None else until
    while t < until:
        feed(w, t, odd if odd_from is not None and t >= odd_from else None)
        t += 1.0
        suspect, _ = w.check(t + 0.01)
        if suspect is not None and first is None:
            first = (t, suspect)
    return first


def test_a_hot_machine_is_a_suspect_after_the_continuity():
    w = PeerWatch.create([["m0", "m1", "m2", "m3"]], period_s=1.0, lookback_s=30, continuity_s=10)
    t, m = run(w, odd_from=20, odd="m2")
    assert m == "m2" and 30 <= t <= 35


def test_rows_before_the_warm_up_ends_are_ignored():
    w = PeerWatch.create([["m0", "m1", "m2", "m3"]], period_s=1.0, lookback_s=30, continuity_s=10,
                  not_before=math.inf)
    for t in range(40):                  # m1 is odd throughout a warm-up that never ends
        feed(w, float(t), "m1")
        assert w.check(t + 1.01)[0] is None
    w.start(40.0)
    w.start(45.0)                        # already started: the first start stands
    assert w.not_before == 40.0
    t, m = run_from(w, 40.0, odd_from=40.0, odd="m1")
    assert m == "m1" and 55 <= t <= 60       # a full window after the start, then the continuity


def test_healthy_noisy_peers_raise_nothing():
    w = PeerWatch.create([["m0", "m1", "m2", "m3"]], period_s=1.0, lookback_s=30, continuity_s=10)
    assert run(w, until=120) is None


def test_stages_are_compared_separately_and_small_stages_not_at_all():
    # the last stage of a pipeline is "different" by design; two machines per stage cannot vote
    w = PeerWatch.create([["m0", "m1"], ["m2", "m3"]], period_s=1.0, lookback_s=30, continuity_s=5)
    assert w.groups == []
    assert run(w, odd_from=0, odd="m3") is None


def test_a_machine_missing_a_metric_is_not_an_outlier_for_it():
    w = PeerWatch.create([["m0", "m1", "m2"]], period_s=1.0, lookback_s=20, continuity_s=5)
    for t in range(30):
        for m in ("m0", "m1", "m2"):
            w.add(m, t, {"cpu": 1.0} if m == "m1" else {"cpu": 1.0, "net_mbps": 100.0})
    assert w.check(30.01)[0] is None


def test_gpu_means_and_sampler_rates():
    assert gpu_means([{"temperature": 40, "clock_sm": 1000}, {"temperature": 60, "clock_sm": 2000},
                      {"present": False, "temperature": 99}]) == {"gpu_temp": 50.0, "gpu_clock": 1500.0}
    import os
    rows = []
    s = MetricsSampler(lambda: [os.getpid()], lambda: [{"temperature": 41}], None, rows.append)
    assert s.sample(100.0) is None                       # rates need two readings
    sum(i * i for i in range(200000))
    row = s.sample(101.0)
    assert row["cpu"] >= 0 and row["rss_mb"] > 1 and row["gpu_temp"] == 41 and "net_mbps" not in row


def test_cpu_wait_is_the_share_of_wanted_cpu_time_spent_waiting():
    import os
    got = schedstat(os.getpid())
    if got is None:
        import pytest
        pytest.skip("this kernel keeps no scheduler statistics (/proc/PID/schedstat)")
    assert all(isinstance(x, int) and x >= 0 for x in got)
    # two processes: one ran 30 ms and waited 10, one waited 60 ms and ran 20; one gone, one new
    before = {1: (0, 0), 2: (100, 100), 3: (5, 5)}
    now = {1: (30_000_000, 10_000_000), 2: (20_000_100, 60_000_100), 4: (9, 9)}
    assert wait_share(before, now) == 70 / 120
    assert wait_share(before, {1: (1000, 1000)}) is None       # wanted next to no CPU: no figure
    assert schedstat(2 ** 30) is None                            # no such process


def test_the_peer_check_thins_out_on_large_jobs_but_keeps_a_candidates_run_alive():
    from stalwart.analyzer.similarity import Continuity
    from stalwart.controller.job.flows.implicit import peer_check_period
    assert peer_check_period(1.0, 16) == 1.0 and peer_check_period(1.0, 256) == 1.0
    assert peer_check_period(1.0, 1024) == 4.0
    assert peer_check_period(1.0, 2048) == 5.0                    # capped
    assert peer_check_period(0.5, 8192) == 5.0
    assert peer_check_period(30.0, 4) == 30.0                     # never more often than a heartbeat
    assert peer_check_period(1.0, 100_000) < Continuity().grace_s  # a candidate's run survives the gaps


def test_the_window_holds_each_rows_values_and_nan_where_a_row_lacks_one():
    w = PeerWatch.create([["a", "b", "c"]], 1.0, 10.0, 60.0)
    want: dict[str, dict[int, dict[str, float]]] = {m: {} for m in "abc"}
    for t in range(30):                     # 30 buckets through a ring of 10 + slack
        for i, m in enumerate("abc"):
            row = {"step_s": 1.0 + i + t / 100, "compute_s": 0.5 + i, "cpu": 10.0 * i + t, "junk": 1.0}
            if (t + i) % 4 == 0:
                del row["cpu"]
            if t == 25 and m == "b":
                row["step_s"] = math.nan       # not finite: not a sample
            w.add(m, t + 0.5, row)
            want[m].setdefault(t, {}).update({k: v for k, v in row.items() if k != "junk" and math.isfinite(v)})
    w.add("a", 3.5, {"step_s": 99.0})          # older than what its ring slot holds now: dropped
    sm = w._samples
    for m in "abc":
        for b in range(20, 30):
            s = b % sm.size
            assert sm.ids[sm.index[m], s] == b
            got = dict(zip(METRICS, sm.vals[sm.index[m], s]))
            assert {k: v for k, v in got.items() if not np.isnan(v)} == want[m][b]
    _, seen = w.check(30.0)
    assert seen[0]["samples"] == 10 and seen[0]["metrics"] == ["compute_s", "step_s", "cpu"]


def test_the_samples_are_not_saved_with_the_state_and_the_window_fills_again():
    w = PeerWatch.create([[f"m{i}" for i in range(4)]], 1.0, 30.0, 20.0)
    assert run(w, odd_from=10.0, odd="m2") is not None
    saved = msgspec.to_builtins(w)
    assert set(saved) == {"groups", "period_s", "lookback", "conts", "since"}
    back = msgspec.convert(saved, type=PeerWatch)
    back.conts = [type(c)(continuity_s=c.continuity_s, grace_s=c.grace_s) for c in back.conts]
    assert back.check(61.0) == (None, {0: {"samples": 0}})     # the window starts empty after a restart
    assert run_from(back, 61.0, odd_from=61.0, odd="m2")[1] == "m2"


def test_a_rows_columns_go_where_its_rows_would_go_one_by_one():
    """`add_columns` leaves the window as `add` of each machine's row does: unknown machines
    ignored, non-finite values left out, a bucket older than the one a slot holds dropped, rows
    before the start ignored."""
    rng = np.random.default_rng(3)
    groups = [[f"m{i}" for i in range(g * 5, g * 5 + 5)] for g in range(3)]
    one, cols = (PeerWatch.create(groups, period_s=1.0, lookback_s=8, continuity_s=10, not_before=2.0)
                 for _ in range(2))
    for t in [0.5, 3.0, 4.2, 4.9, 20.0, 4.5, 21.0, 37.0]:        # 4.5: older than what its slot holds
        machines = [f"m{i}" for i in rng.permutation(16)[:12]]      # (m15 is nobody's)
        step = rng.choice([0.1, 0.2, np.nan, np.inf], size=12, p=[0.45, 0.45, 0.05, 0.05])
        comp = rng.random(12)
        for m, s, c in zip(machines, step, comp):
            one.add(m, t, {"step_s": float(s), "compute_s": float(c)})
        cols.add_columns(machines, t, {"step_s": step, "compute_s": comp})
        a, b = one._samples, cols._samples
        assert a.empty == b.empty == (t < 2.0)
        assert a.empty or (np.array_equal(a.ids, b.ids) and np.array_equal(a.vals, b.vals, equal_nan=True))
    assert (one._samples.ids >= 0).sum() > 20


def test_a_committed_step_gives_the_same_window_by_columns_and_rank_by_rank(monkeypatch):
    """The peer detector's column path and its rank-by-rank path (a time that is None) leave the
    same rows in the watch."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from corekit import Harness

    from stalwart.controller.job.detectors.peers import PeerDetector
    from stalwart.controller.job.state import JobPhase

    def window(by_columns: bool):
        if not by_columns:
            monkeypatch.setattr(PeerDetector, "_add_columns", lambda self, st, acc: False)
        h = Harness(machines=6, gpus=2, standby=0, steps=500)
        h.tick()
        assert h.st.phase == JobPhase.RUNNING
        rng = np.random.default_rng(5)
        for _ in range(30):
            h.step(dur=0.5, compute={r: float(x) for r, x in enumerate(rng.random(12))})
        monkeypatch.undo()
        return h.st.signals.peerwatch._samples

    cols, rows = window(True), window(False)
    assert (cols.ids >= 0).sum() >= 6 * 10
    assert np.array_equal(cols.ids, rows.ids) and np.array_equal(cols.vals, rows.vals, equal_nan=True)
