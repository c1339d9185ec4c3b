"""Issue 4: hot update (urgent, lazy, windowed) in place from the in-memory checkpoint, and the
automatic rollback of a version that fails with a user-code error."""
import shutil
import sys
import textwrap

import pytest

from jobrun import gpt_spec, run_job

GOOD = '''
import sys
from stalwart.examples import gpt
if __name__ == "__main__":
    print("code version {tag}", file=sys.stderr, flush=True)
    sys.exit(gpt.main())
'''
BAD = '''
import sys
from stalwart.examples import gpt

def fused_allreduce(params, group, size):        # a new "fused kernel" with a bug
    raise IndexError("fused all-reduce: bucket index out of range")

if __name__ == "__main__":
    gpt.allreduce_mean = fused_allreduce
    sys.exit(gpt.main())
'''


def code(tmp_path, tag, text=GOOD):
    d = tmp_path / f"code-{tag}"
    d.mkdir()
    (d / "train.py").write_text(textwrap.dedent(text.format(tag=tag)))
    return str(d)


def spec(tmp_path, steps, **kw):
    s = gpt_spec(machines=2, gpus=1, steps=steps, **kw)
    s["command"] = [sys.executable, "train.py", "--layers", "2", "--log-every", "0"]
    s["code_dir"] = code(tmp_path, "v1")
    return s


class Script:
    """Registers versions when the job reaches given steps (called on every status poll)."""

    def __init__(self, plan):
        self.plan = sorted(plan, key=lambda p: p[0])
        self.done = []

    def __call__(self, client, job, st):
        step = (st.get("live") or {}).get("step", 0)
        run_state = (st.get("live") or {}).get("state")
        while self.plan and step >= self.plan[0][0] and run_state == "running":
            at, body = self.plan.pop(0)
            self.done.append(client.post(f"/api/jobs/{job}/versions", body))


def statuses(state_dir):
    from stalwart.controller.store import Store
    from stalwart.controller.versions import Versions
    store = Store(f"sqlite:///{state_dir}/stalwart.db")
    try:
        return [(v["id"], v["status"]) for v in Versions(store).list(1)]
    finally:
        store.close()


@pytest.mark.timeout(400)
def test_urgent_update_then_rollback_of_a_bad_version(tmp_path):
    s = spec(tmp_path, 400)
    script = Script([(30, {"code": code(tmp_path, "v2"), "mode": "urgent"}),
                     (120, {"code": code(tmp_path, "bad", BAD), "mode": "urgent"})])
    rep = run_job(tmp_path / "state", s, during=script)
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["steps_completed"] == 400
    mech = [i["mechanism"] for i in rep["incidents"]]
    assert mech.count("hot_update") == 2 and "rollback" in mech
    rb = next(i for i in rep["incidents"] if i["mechanism"] == "rollback")
    assert "IndexError" in rb["cause"] and "user-code error after version 3" in rb["cause"]
    assert statuses(tmp_path / "state") == [(1, "stable"), (2, "stable"), (3, "rolled-back")]
    hot = [r for r, i in zip(rep["runs"][1:], rep["incidents"]) if i["mechanism"] == "hot_update"]
    for run in hot:                    # in place, from the in-memory checkpoint of each rank
        assert set(run["restore"]["tiers"].values()) == {"own"}, run["restore"]
        assert run["machines"] == rep["runs"][0]["machines"]
    assert rep["unproductive_s"]["hot_update"] > 0


@pytest.mark.timeout(400)
def test_lazy_update_rides_on_the_next_failure_and_window_expires(tmp_path):
    s = spec(tmp_path, 500, chaos=["crash@step=150,machine=1"])
    script = Script([(20, {"code": code(tmp_path, "v2"), "mode": "lazy"}),
                     (250, {"code": code(tmp_path, "v3"), "mode": "window", "window_s": 1.0})])
    rep = run_job(tmp_path / "state", s, during=script)
    assert rep["state"] == "succeeded", rep.get("reason")
    mech = [(i["symptom"], i["mechanism"]) for i in rep["incidents"]]
    assert mech == [("worker_crash", "reattempt"), ("hot_update", "hot_update")], mech
    st = dict(statuses(tmp_path / "state"))
    assert st[1] == "stable" and st[2] == "stable" and st[3] in ("applied", "stable")
    # version 2 was applied only at the crash's restart, not when it was registered
    crash = rep["incidents"][0]
    assert rep["runs"][1]["start_step"] >= 140 and crash["resumed_at"] > crash["detected_at"]
