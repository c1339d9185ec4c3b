"""The job state's JSON (controller/job/state.py `dumps`) is written in pieces so that a save of a
large job does not hold the GIL for all of it (the API's event loop answers every agent's beat
meanwhile): the pieces must add up to exactly `json.dumps` of the whole, NaN and all."""
import json
import math
import threading
import time

import msgspec

from stalwart.controller.job import state as S
from stalwart.controller.peerwatch import PeerWatch


def whole(st: S.JobState) -> bytes:
    return json.dumps(msgspec.to_builtins(st, order="deterministic"), separators=(",", ":"),
                      allow_nan=True).encode()


def big_state(machines: int, buckets: int) -> S.JobState:
    names = [f"m{i}" for i in range(machines)]
    st = S.JobState(job_id=1, created_at=1.0, slots=names)
    st.last_loss = math.nan
    st.signals.loss_hist = [1.0, math.nan, math.inf]
    pw = PeerWatch.create([names], period_s=1.0, lookback_s=float(buckets), continuity_s=10.0, not_before=0.0)
    for m in names:
        for b in range(buckets):
            pw.add(m, float(b), {"cpu": 0.5 + b / 1000, "rss_mb": 3000.0, "gpu_temp": 60.0})
    st.signals.peerwatch = pw
    st.signals.rank_times = [{r: (1.0, 0.8) for r in range(machines)} for _ in range(20)]
    return st


def test_the_pieces_are_exactly_the_whole():
    for x in ({}, [], {"a": math.nan, "b": [1, {"c": math.inf}]}, {i: i for i in range(300)}, list(range(200)),
              [[]] * 100, {"k": {}}, {1: {2: [3.5]}}, {str(i): [i] * 3 for i in range(1000)}):
        out: list[str] = []
        S._encode(x, out)
        assert "".join(out) == S._json(x), x
    st = big_state(300, 40)
    saved = S.dumps(st)
    assert saved == whole(st)
    assert S.dumps(S.loads(saved)) == saved


def test_a_large_save_lets_other_threads_run():
    """A state of ~1,000 machines (~1.5 MB): another thread waits far less than the whole save."""
    st = big_state(1000, 60)
    t0 = time.perf_counter()
    S.dumps(st)
    took = time.perf_counter() - t0
    gaps: list[float] = []
    stop = threading.Event()

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    th = threading.Thread(target=ticker)
    th.start()
    time.sleep(0.02)
    S.dumps(st)
    stop.set()
    th.join()
    # the longest wait: to_builtins (one call) and a few ms, not the JSON encoding of it all
    t0 = time.perf_counter()
    msgspec.to_builtins(st, order="deterministic")
    builtins_s = time.perf_counter() - t0
    assert max(gaps) < builtins_s + 0.5 * took + 0.02, (max(gaps), builtins_s, took)
