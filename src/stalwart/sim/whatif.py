"""The what-if straggler analysis (`stalwart.analyzer.whatif`) of a job read from a store: the
answer `stalwart whatif --db` prints (the command itself, which otherwise asks the controller's
`GET /api/jobs/{job}/whatif`, is the CLI's `views.cmd_whatif`)."""
from __future__ import annotations

from typing import Any

from stalwart.analyzer.whatif import analyze, render

__all__ = ["analyze", "from_store", "render"]


def from_store(url: str, job: str, microbatches: int) -> tuple[int, dict[str, Any]]:
    from stalwart.controller.store.db import Store
    from stalwart.spec import JobSpec
    store = Store(url)
    try:
        if job == "latest":
            row = store.latest_job()
        elif job.isdigit():
            row = store.job(int(job))
        else:
            raise ValueError(f"--job must be a job id or latest (got {job!r})")
        if row is None:
            raise ValueError(f"no job {job} in the store")
        records = [e["data"] for e in store.events(row["id"], kinds=["rank_times"])]
    finally:
        store.close()
    spec = JobSpec.from_dict(row["spec"])
    return row["id"], analyze(records, spec.topology(), microbatches)
