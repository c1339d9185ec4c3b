"""The store as a dependency that fails: retries through a lock, bounded waits for API callers,
the health signal, private files; the lease and its fence; timers of a decision that waited;
the steady clock; supervised threads."""
import logging
import os
import sqlite3
import stat
import threading
import time

import pytest
import sqlalchemy as sa

from stalwart.controller import clock
from stalwart.controller.store import db as store_mod
from stalwart.controller import supervise
from stalwart.controller.job import state as S
from stalwart.controller.store.lease import Lease
from stalwart.controller.store.db import LeaseLost, Store, StoreUnavailable
from stalwart.controller.store.ops import Record, UpdateRun


@pytest.fixture
def db(tmp_path):
    return f"sqlite:///{tmp_path}/s.db", str(tmp_path / "s.db")


def locked(path: str) -> sqlite3.Connection:
    """Another process's exclusive lock on the database (a backup tool, an operator's shell)."""
    c = sqlite3.connect(path, timeout=0, isolation_level=None)
    c.execute("BEGIN EXCLUSIVE")
    return c


def test_database_files_are_private(db):
    url, path = db
    s = Store(url)
    s.create_job("j", {}, 1.0)
    for p in (path, path + "-wal"):
        if os.path.exists(p):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    assert s.read(lambda c: c.exec_driver_sql("PRAGMA synchronous").scalar()) == 2     # FULL
    s.close()


def test_a_patient_write_waits_out_a_lock_and_health_says_so(db, monkeypatch):
    monkeypatch.setattr(store_mod, "STALL_S", 0.3)
    url, path = db
    s = Store(url)
    job = s.create_job("j", {}, 1.0)
    lock = locked(path)
    done = threading.Event()

    def writer():
        s.patient()
        s.commit(job, [Record(kind="x", t=2.0, data={})], None)
        done.set()
    threading.Thread(target=writer, daemon=True).start()
    deadline = time.monotonic() + 10
    while s.unavailable() is None:
        assert time.monotonic() < deadline, "a write held by a lock never made the store unavailable"
        time.sleep(0.05)
    assert not done.is_set()
    assert s.events(job) == [] or all(e["kind"] != "x" for e in s.events(job))   # a read still works...
    assert s.unavailable() is not None                                            # ...and clears nothing
    with s.bounded(0.5), pytest.raises(StoreUnavailable) as e:                     # an API call: bounded
        s.update_job(job, state="running")
    assert e.value.status == 503
    lock.execute("ROLLBACK")
    lock.close()
    assert done.wait(10), "the write did not go through once the lock was gone"
    assert s.unavailable() is None
    assert [e["kind"] for e in s.events(job)] == ["x"]
    assert s.retries > 0
    s.close()


def test_a_statement_error_is_not_retried(db):
    s = Store(db[0])
    with pytest.raises(sa.exc.CompileError):         # (no such column)
        s.commit(1, [UpdateRun(seq=1, fields={"nonsense": 1})], None)
    assert s.retries == 0
    s.close()


class FakeMono:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_standby_takes_the_lease_only_after_the_beats_stop_and_the_old_holder_is_fenced(db):
    url, _ = db
    a_store, b_store = Store(url), Store(url)
    lost: list[str] = []
    clk = FakeMono()
    a = Lease(a_store, "a", on_lost=lost.append, takeover_s=3.0, clock=clk)
    b = Lease(b_store, "b", takeover_s=3.0, clock=clk)
    seen: dict = {}
    assert a.try_acquire({}) and a.fence == 1
    a_store.fence = a.check
    assert not b.try_acquire(seen)              # sees the row: starts watching
    for _ in range(5):                           # a beats: the counter moves, b never takes over
        a_store.write(lambda c: c.exec_driver_sql("UPDATE lease SET beat = beat + 1 WHERE name = 'controller-beat'"))
        clk.t += 2.0
        assert not b.try_acquire(seen)
    clk.t += 2.0                                 # silent, but not for long enough
    assert not b.try_acquire(seen)
    clk.t += 1.5
    assert b.try_acquire(seen) and b.fence == 2
    assert b.row()["holder"] == "b"
    job = None
    with pytest.raises(LeaseLost):               # the old holder's next write is refused...
        job = a_store.create_job("late", {}, 1.0)
    assert job is None and lost and "fence 1" in lost[0]
    assert b_store.latest_job() is None          # ...and nothing of it was committed
    b_store.fence = b.check
    assert b_store.create_job("mine", {}, 1.0) == 1
    a_store.close()
    b_store.close()


def test_timers_of_a_decision_that_waited_start_when_its_commands_leave():
    st = S.JobState(job_id=1, created_at=0.0)
    st.pool.next_refill = 110.0          # set by the decision at now=100
    st.pool.next_request = 50.0          # history: before the decision
    st.diag = S.Diagnosis(name="d", checks=[], wait=set(), started=100.0, deadline=160.0)
    moved = S.shift_timers(st, 100.0, 40.0)
    assert (st.pool.next_refill, st.pool.next_request) == (150.0, 50.0)
    assert (st.diag.started, st.diag.deadline) == (140.0, 200.0)
    assert moved == 3


def test_the_steady_clock_ignores_steps_of_the_wall_clock():
    wall, mono = [1000.0], [5.0]
    c = clock.Clock(lambda: wall[0], lambda: mono[0])
    assert c.now() == 1000.0
    mono[0] += 2.0
    wall[0] += 3600.0 + 2.0            # NTP steps the host one hour ahead
    assert c.now() == 1002.0
    wall[0] -= 7200.0
    mono[0] += 1.0
    assert c.now() == 1003.0


def test_a_supervised_thread_that_raises_is_logged_and_started_again(caplog, monkeypatch):
    monkeypatch.setattr(supervise, "FIRST_PAUSE_S", 0.01)
    calls = []

    def target():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("database is locked")
    with caplog.at_level(logging.ERROR, "stalwart.controller"):
        t = supervise.supervised("probe", target)
        t.join(5)
    assert not t.is_alive() and len(calls) == 3
    assert sum("thread probe failed (RuntimeError: database is locked)" in r.getMessage()
               for r in caplog.records) == 2
