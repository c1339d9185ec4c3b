"""The store's typed operations: every one the job core can decide has a writer, and each writes
the row it stands for (SQLite in a temporary file, no process)."""
from typing import get_args

import pytest
import sqlalchemy as sa

from stalwart.controller.cluster.roles import Role
from stalwart.controller.code import versions
from stalwart.controller.job import actions as a
from stalwart.controller.store import ops
from stalwart.controller.store.db import Store, _row

# One operation of each type, and the row it must leave (the columns named, of the row it names)
SAMPLES: dict[type, tuple[ops.StoreOp, str, dict]] = {
    ops.Record: (ops.Record(kind="step", data={"run": 1, "step": 4}, t=5.0),
                 "events", {"kind": "step", "data": {"run": 1, "step": 4}, "t": 5.0}),
    ops.OpenIncident: (ops.OpenIncident(seq=1, run=2, symptom="gpu_xid", category="explicit", detected_at=6.0),
                       "incidents", {"id": 1, "run_seq": 2, "symptom": "gpu_xid", "category": "explicit",
                                     "detected_at": 6.0, "suspects": [], "evicted": [], "data": {}}),
    ops.UpdateIncident: (ops.UpdateIncident(seq=1, fields={"mechanism": "evict_restart", "evicted": ["m1"]}),
                         "incidents", {"id": 1, "symptom": "gpu_xid", "mechanism": "evict_restart",
                                       "evicted": ["m1"]}),
    ops.CreateRun: (ops.CreateRun(seq=2, start_step=3, started_at=7.0, machines=["m0", "m2"], restore_step=3),
                    "runs", {"seq": 2, "start_step": 3, "started_at": 7.0, "machines": {"0": "m0", "1": "m2"},
                             "restore": {"step": 3}}),
    ops.UpdateRun: (ops.UpdateRun(seq=2, fields={"end_step": 9, "stopped_at": 8.0, "reason": "done"}),
                    "runs", {"seq": 2, "start_step": 3, "end_step": 9, "stopped_at": 8.0, "reason": "done"}),
    ops.SaveVersion: (ops.SaveVersion(row={"id": 1, "status": "applied", "applied_at": 9.0, "applied_step": 4}),
                      "code_versions", {"id": 1, "status": "applied", "applied_at": 9.0, "applied_step": 4}),
    ops.AddCheckpoint: (ops.AddCheckpoint(step=4, rank=1, tier="durable", location="/ck/4/1", checksum="ab",
                                          t=10.0),
                        "checkpoints", {"step": 4, "rank": 1, "tier": "durable", "location": "/ck/4/1",
                                        "checksum": "ab", "created_at": 10.0}),
    ops.AssignMachine: (ops.AssignMachine(machine="m1", state=Role.EVICTED, reason="xid 79", incident=1),
                        "machines", {"id": "m1", "state": "evicted", "reason": "xid 79", "job_id": "JOB"}),
    ops.FinishJob: (ops.FinishJob(state="failed", reason="no machines", machines=["m0"], t=11.0),
                    "jobs", {"state": "failed", "reason": "no machines", "finished_at": 11.0}),
    ops.StartJob: (ops.StartJob(), "jobs", {"state": "running", "finished_at": None}),
}
ORDER = [ops.StartJob, ops.Record, ops.OpenIncident, ops.UpdateIncident, ops.CreateRun, ops.UpdateRun,
         ops.SaveVersion, ops.AddCheckpoint, ops.AssignMachine, ops.FinishJob]   # (an update after its insert)


def test_every_store_operation_has_a_sample_and_the_isinstance_tuple_matches_the_union():
    members = set(get_args(ops.StoreOp))
    assert set(ops.OPS) == members and len(ops.OPS) == len(members)
    assert set(SAMPLES) == members and set(ORDER) == members
    assert set(ops.ROWS_ONLY) <= members


def test_every_store_operation_the_executor_can_produce_is_a_store_operation():
    """The executor hands the store each action that is an `ops.OPS` instance: those of the job
    core's `Action` union are the store's types themselves, and the row-only ones are never sent."""
    actions = set(get_args(a.Action))
    produced = actions & set(ops.OPS)
    assert produced == set(ops.OPS) - {ops.StartJob}        # (the controller's, when a job starts)
    assert set(a.STORE_ACTIONS) == set(ops.ROWS_ONLY) and set(ops.ROWS_ONLY) < produced
    assert a.Record is ops.Record and a.AssignMachine is ops.AssignMachine


@pytest.fixture
def store(tmp_path):
    assert versions.code_versions is not None       # (its table on the store's metadata)
    s = Store(f"sqlite:///{tmp_path}/s.db")
    yield s
    s.close()


def _rows(store: Store, table: str) -> list[dict]:
    t = sa.Table(table, sa.MetaData(), autoload_with=store.engine)
    return store.read(lambda c: [_row(r) for r in c.execute(sa.select(t))])


def test_a_commit_of_each_operation_writes_its_row(store):
    job = store.create_job("j", {"machines": 2}, 1.0)
    store.write(lambda c: c.execute(versions.code_versions.insert().values(
        id=1, job_id=job, hash="h", path="/v/1", source="/code", status="pending", mode="lazy", created_at=1.0)))
    for kind in ORDER:
        op, table, want = SAMPLES[kind]
        store.commit(job, [op], None)
        want = {k: job if v == "JOB" else v for k, v in want.items()}
        rows = _rows(store, table)
        assert any(all(r.get(k) == v for k, v in want.items()) for r in rows), (kind.__name__, rows)
    # an idle machine belongs to no job; a role is written as its string
    store.commit(job, [ops.AssignMachine(machine="m1", state=Role.IDLE)], None)
    assert [(m["id"], m["state"], m["job_id"]) for m in store.machines()] == [("m1", "idle", None)]


def test_what_is_not_an_operation_fails_the_whole_transaction(store):
    job = store.create_job("j", {}, 1.0)
    with pytest.raises(TypeError, match="not a store operation"):
        store.commit(job, [ops.Record(kind="a", data={}, t=2.0), ("event", {"kind": "b"})], b"{}")  # type: ignore[list-item]
    assert store.events(job) == [] and store.load_state(job) is None
