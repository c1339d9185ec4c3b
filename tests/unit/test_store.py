"""The store: one decision in one transaction, the job's state saved with it, and a clear refusal
of a database made by another version of stalwart."""
import sqlite3

import pytest

from stalwart.controller.store.db import Store, StoreSchemaError
from stalwart.controller.store.ops import OpenIncident, Record


def test_a_decision_is_written_all_or_nothing(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/s.db")
    try:
        job = store.create_job("j", {"machines": 1}, 1.0)
        store.commit(job, [Record(kind="a", data={}, t=2.0),
                           OpenIncident(seq=1, run=1, symptom="x", category="explicit", detected_at=2.0)],
                     b'{"phase":"running"}')
        with pytest.raises(TypeError, match="not a store operation"):
            store.commit(job, [Record(kind="b", data={}, t=3.0), ("event", {})], b"{}")  # type: ignore[list-item]
        assert [e["kind"] for e in store.events(job)] == ["a"]          # "b" rolled back
        assert store.load_state(job) == b'{"phase":"running"}'
        assert [i["id"] for i in store.incidents(job)] == [1]
        other = store.create_job("k", {"machines": 1}, 1.0)               # incident ids are per job
        store.commit(other, [OpenIncident(seq=1, run=1, symptom="y", category="explicit", detected_at=2.0)], None)
        assert [i["symptom"] for i in store.incidents(other)] == ["y"]
    finally:
        store.close()


def test_a_submitted_job_has_its_report_from_the_moment_its_id_exists(tmp_path):
    from stalwart.controller.report.build import build_report
    store = Store(f"sqlite:///{tmp_path}/s.db")
    try:
        job = store.create_job("j", {"machines": 1, "steps": 10}, 1.0, submitted=True)
        assert [e["kind"] for e in store.events(job)] == ["job_submitted"]
        assert build_report(store, job, now=2.0)["job_id"] == job      # (was a 500 before the first commit)
    finally:
        store.close()


def test_a_database_of_an_older_stalwart_is_refused_with_one_line(tmp_path):
    db = tmp_path / "old.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, name TEXT)")
    con.commit()
    con.close()
    with pytest.raises(StoreSchemaError, match="made by another version of stalwart"):
        Store(f"sqlite:///{db}")
