"""`stalwart whatif`: the what-if straggler analysis (`stalwart.analyzer.whatif`) of a job, asked of
its controller (`GET /api/jobs/{job}/whatif`) or, with `--db` or no controller, read from the store."""
from __future__ import annotations

import argparse
from typing import Any

from stalwart.analyzer.whatif import analyze, render

__all__ = ["add_parser", "analyze", "from_store", "main", "render"]


def add_parser(sub: Any) -> None:
    from stalwart.cli.common import state_options
    w = sub.add_parser("whatif", help="how much faster a finished job would have been without its slowest "
                                      "rank / machine / pipeline stage")
    state_options(w)
    w.add_argument("--db", help="read this store (SQLAlchemy URL) instead of asking a controller")
    w.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (pipeline model)")
    w.add_argument("--json", action="store_true", help="print the analysis as JSON on stdout")
    w.set_defaults(fn=main)


def from_store(url: str, job: str, microbatches: int) -> tuple[int, dict[str, Any]]:
    from stalwart.controller.store import Store
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


def main(a: argparse.Namespace) -> int:
    from stalwart.cli.common import UserError, api_client, print_json, state_store_url
    from stalwart.client import ControllerUnreachable
    if a.microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1 (got {a.microbatches})")
    url = a.db
    if url is None:
        try:
            res = api_client(a, 60).get(f"/api/jobs/{a.job}/whatif?microbatches={a.microbatches}")
            job_id = res.pop("job_id")
        except (UserError, ControllerUnreachable):
            if a.controller:
                raise
            url = state_store_url(a)
    if url is not None:
        job_id, res = from_store(url, str(a.job), a.microbatches)
    if a.json:
        print_json({"job_id": job_id, **res})
    else:
        print(render(job_id, res))
    return 0
