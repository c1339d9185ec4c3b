"""The controller keeps its state in a real PostgreSQL server and a job runs to completion."""
import pytest

from jobrun import gpt_spec, run_job


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_job_runs_on_postgresql(tmp_path, pg_url):
    from stalwart.controller.store.db import Store
    rep = run_job(tmp_path, gpt_spec(tp=2, dp=1, machines=1, steps=15,
                                     chaos=["crash@step=8,machine=0"]), db_url=pg_url)
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["steps_completed"] == 15
    assert [i["mechanism"] for i in rep["incidents"]] == ["reattempt"]
    store = Store(pg_url)  # the state really is in PostgreSQL
    try:
        assert store.engine.dialect.name == "postgresql"
        job = store.latest_job()
        assert job["state"] == "succeeded"
        assert len(store.runs(job["id"])) == 2
        assert len([e for e in store.events(job["id"], ["step"])]) >= 15
        assert store.checkpoints(job["id"])
    finally:
        store.close()
