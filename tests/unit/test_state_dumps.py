"""The job state's JSON (controller/job/state.py `dumps`) is written in pieces so that a save of a
large job does not hold the GIL for all of it (the API's event loop answers every agent's beat
meanwhile): the pieces must add up to exactly `json.dumps` of the whole, NaN and all."""
import json
import math
import threading
import time
from types import SimpleNamespace

import msgspec

from stalwart.controller.job import state as S
from stalwart.controller.rules.peerwatch import PeerWatch


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
    assert saved == whole(st) == S.dumps(st, pieces=False)    # (a small state's one call)
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


def test_a_runner_writes_a_small_state_in_one_call_and_a_large_one_in_pieces(monkeypatch):
    """`JobRunner.dispatch` saves the state (here at each transition) in pieces until it knows the
    state is small, then in one call; a large state stays in pieces."""
    from stalwart.controller.job.events import Tick
    from stalwart.controller.job.runner import JobRunner
    calls: list[bool] = []
    real = S.dumps
    monkeypatch.setattr(S, "dumps", lambda st, pieces=True: calls.append(pieces) or real(st, pieces))

    class Core:
        def handle(self, st, ev, now):
            st.run_seq += 1                   # a transition: saved at once
            return []

    class Executor:
        def __init__(self) -> None:
            self.saved: list[bytes] = []

        def perform(self, st, acts, data, on_committed=None):
            self.saved.append(data)

    def dispatch_three(st: S.JobState) -> list[bool]:
        calls.clear()
        r = JobRunner.__new__(JobRunner)      # (its dispatch alone: no controller, no thread)
        r.state, r.job_id, r.core, r.executor = st, st.job_id, Core(), Executor()
        r._saved_key, r._saved_at, r._save_cost, r._save_bytes, r._dirty = None, 0.0, 0.0, 1 << 62, True
        r.ports = SimpleNamespace(now=lambda: 1.0, on_phase=None)
        for _ in range(3):
            r.dispatch(Tick())
        assert r.executor.saved[-1] == whole(st)
        return list(calls)
    assert dispatch_three(S.JobState(job_id=1, created_at=1.0, slots=["m0", "m1"])) == [True, False, False]
    assert dispatch_three(big_state(1000, 60)) == [True, True, True]
