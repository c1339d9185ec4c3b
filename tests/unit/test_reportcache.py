"""Reports for the API from an incrementally read event log (controller/report/cache.py)."""
import pytest

from stalwart.controller.report.build import build_report
from stalwart.controller.report.cache import EventLog, ReportCache
from stalwart.controller.store.db import Store


def test_the_log_is_read_once_then_only_new_rows_in_time_order(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/s.db")
    try:
        job = store.create_job("j", {"machines": 1, "steps": 10}, 1.0, submitted=True)
        other = store.create_job("k", {"machines": 1, "steps": 10}, 1.0, submitted=True)
        cache = ReportCache(store)
        store.add_event(job, "a", {}, t=3.0)
        store.add_event(other, "x", {}, t=3.5)
        assert [e["kind"] for e in cache.events(job)] == ["job_submitted", "a"]
        store.add_event(job, "late", {}, t=2.0)            # an agent's event arriving late
        store.add_event(job, "c", {}, t=4.5)
        store.add_event(job, "b", {}, t=4.0)               # rows out of time order among the new
        assert [e["kind"] for e in cache.events(job)] == ["job_submitted", "late", "a", "b", "c"]
        store.add_event(job, "e", {}, t=6.0)
        store.add_event(job, "d", {}, t=5.0)               # ...also when all are newer than the log
        assert [e["kind"] for e in cache.events(job)][-2:] == ["d", "e"]
        assert cache.events(job) == store.events(job)
        reads = []
        real = store.events_since
        store.events_since = lambda j, after: reads.append(after) or real(j, after)   # type: ignore
        cache.events(job)
        assert reads == []                                   # nothing new: no row read...
        store.add_event(job, "f", {}, t=7.0)
        assert cache.events(job)[-1]["kind"] == "f"
        assert len(reads) == 1 and reads[0] >= cache._jobs[job].log.top - 1   # ...then the new ones alone
        log = EventLog()
        log.extend(store.events(job))
        log.extend(store.events(job))                          # ...and rows seen twice count once
        assert len(log.events) == 8
    finally:
        store.close()


def test_a_costly_report_is_reused_a_short_one_rebuilt_a_finished_job_always_fresh(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/s.db")
    try:
        job = store.create_job("j", {"machines": 1, "steps": 10}, 1.0, submitted=True)
        never = ReportCache(store, reuse_factor=0.0)
        first = never.report(job, now=5.0)
        assert first == build_report(store, job, now=5.0)
        assert never.report(job, now=6.0)["wall_s"] != first["wall_s"]      # rebuilt
        always = ReportCache(store, reuse_factor=1e9, max_reuse_s=60.0)
        a = always.report(job, now=5.0)
        assert always.report(job, now=6.0)["wall_s"] == a["wall_s"]        # reused
        store.update_job(job, state="succeeded", finished_at=7.0)
        assert always.report(job, now=8.0)["state"] == "succeeded"        # the state changed: rebuilt
        built = always._jobs[job].built_at
        always.report(job, now=9.0)
        assert always._jobs[job].built_at == built                          # ended, same log: kept
        store.add_event(job, "late", {}, t=6.5)
        always.report(job, now=9.0)
        assert always._jobs[job].built_at > built                           # ended, the log grew: rebuilt
        with pytest.raises(LookupError):
            always.report(job + 100)
    finally:
        store.close()


def test_a_row_committed_with_an_id_below_the_newest_seen_is_still_read(tmp_path):
    """A writer may commit ids out of order (a sequence hands ids out before commit): the ids
    behind the newest seen are checked on every read, and only the rows not seen are decoded."""
    import sqlalchemy as sa

    from stalwart.controller.store.db import events
    store = Store(f"sqlite:///{tmp_path}/s.db")
    try:
        job = store.create_job("j", {"machines": 1, "steps": 10}, 1.0, submitted=True)
        store.add_event(job, "a", {}, t=2.0)
        with store.engine.begin() as c:                     # leave a hole at the next id
            c.execute(sa.insert(events).values(id=100, job_id=job, t=3.0, kind="b", data="{}"))
        cache = ReportCache(store)
        assert [e["kind"] for e in cache.events(job)] == ["job_submitted", "a", "b"]
        with store.engine.begin() as c:                     # the hole is filled late
            c.execute(sa.insert(events).values(id=50, job_id=job, t=2.5, kind="late", data="{}"))
        assert [e["kind"] for e in cache.events(job)] == ["job_submitted", "a", "late", "b"]
        assert cache.events(job) == store.events(job)
    finally:
        store.close()
