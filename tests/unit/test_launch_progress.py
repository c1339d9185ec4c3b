"""`stalwart run`'s progress loop (backends/launch.py): a cheap live poll each refresh, the job's
report only every REPORT_EVERY refreshes or when the run or its phase changed, the summary from
the ended job's report."""
from __future__ import annotations

import io
import sys

from stalwart.backends import launch


class _Client:
    def __init__(self, script: list[dict], report: dict):
        self.script, self.report, self.gets = script, report, []

    def get(self, path: str) -> dict:
        self.gets.append(path)
        if path.endswith("/live"):
            return self.script.pop(0)
        return dict(self.report, live=self.script[0]["live"] if self.script else {})

    def post(self, path: str, body: dict) -> dict:
        return {"job": 7}


class _Cluster:
    url, token, on_controller_restart = "http://x", "t", None

    def __init__(self, client: _Client):
        self._client, self.stopped = client, False

    def client(self, timeout: float = 10.0) -> _Client:
        return self._client

    def stop(self) -> None:
        self.stopped = True


class _Spec:
    command = ["python", "train.py"]

    def to_dict(self) -> dict:
        return {}


def _live(step: int, run: int = 1, phase: str = "running") -> dict:
    return {"job": 7, "state": "running", "steps_target": 20,
            "live": {"step": step, "run": run, "state": phase, "loss": 1.0, "steps_per_s": 5.0}}


def test_the_report_is_asked_for_rarely_and_at_once_when_the_run_changes(monkeypatch):
    monkeypatch.setattr(launch, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(launch, "REPORT_EVERY", 3)
    ended = {"job": 7, "job_id": 7, "state": "succeeded", "reason": None, "steps_target": 20,
             "steps_completed": 20, "final_loss": 0.5, "wall_s": 9.0, "productive_s": 8.0, "ettr": 0.9,
             "unproductive_s": {"failover": 1.0}, "incidents": [], "steps_lost": 0}
    script = [_live(s) for s in range(0, 5)] + [_live(5, phase="recovering"), _live(6, run=2), _live(7, run=2)]
    script.append(dict(ended, live={}))
    report = dict(ended, state="running", ettr=0.95, incidents=[])
    client = _Client(script, report)
    cluster = _Cluster(client)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert launch.run_job(cluster, _Spec(), lambda: None) == 0
    assert cluster.stopped
    kinds = ["live" if p.endswith("/live") else "report" for p in client.gets]
    # polls 0..4 running (report at 0 and 3), 5 recovering (phase changed), 6 run 2 (run changed),
    # 7 (nothing new, not the 3rd since), then the ended job's answer is its report: no second ask
    assert kinds == ["live", "report", "live", "live", "live", "report", "live",
                     "live", "report", "live", "report", "live", "live"], kinds
    assert "job 7: succeeded" in out.getvalue() and "ETTR 0.900" in out.getvalue()
