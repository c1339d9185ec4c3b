"""Hot update (urgent, lazy, windowed) in place from the in-memory checkpoint, and the
automatic rollback of a version that fails with a user-code error."""
import sys
import textwrap

import pytest

from jobrun import events, gpt_spec, run_job

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
    """Registers versions when the job reaches given steps (called on every status poll); an entry
    (step, body, run) also waits for run number `run` (an earlier version applied)."""

    def __init__(self, plan):
        self.plan = [p if len(p) == 3 else (*p, 1) for p in sorted(plan, key=lambda p: p[0])]
        self.done = []

    def __call__(self, client, job, st):
        live = st.get("live") or {}
        step, run = live.get("step", 0), live.get("run", 0)
        while self.plan and step >= self.plan[0][0] and run >= self.plan[0][2] \
                and live.get("state") == "running":
            at, body, _ = self.plan.pop(0)
            self.done.append(client.post(f"/api/jobs/{job}/versions", body))


def statuses(state_dir):
    from stalwart.controller.store.db import Store
    from stalwart.controller.code.versions import Versions
    store = Store(f"sqlite:///{state_dir}/stalwart.db")
    try:
        return [(v["id"], v["status"]) for v in Versions(store).list(1)]
    finally:
        store.close()


@pytest.mark.timeout(400)
def test_urgent_update_then_rollback_of_a_bad_version(tmp_path):
    s = spec(tmp_path, 1000)     # long enough for spares to warm up twice beside training
    script = Script([(30, {"code": code(tmp_path, "v2"), "mode": "urgent"}),
                     (120, {"code": code(tmp_path, "bad", BAD), "mode": "urgent"}, 2)])
    rep = run_job(tmp_path / "state", s, during=script, timeout=360)
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["steps_completed"] == 1000
    mech = [i["mechanism"] for i in rep["incidents"]]
    assert mech.count("hot_update") == 2 and "rollback" in mech
    rb = next(i for i in rep["incidents"] if i["mechanism"] == "rollback")
    assert "IndexError" in rb["cause"] and "user-code error after version 3" in rb["cause"]
    assert statuses(tmp_path / "state") == [(1, "stable"), (2, "stable"), (3, "rolled-back")]
    hot = [r for r, i in zip(rep["runs"][1:], rep["incidents"]) if i["mechanism"] == "hot_update"]
    for run in hot:                    # in place, from the in-memory checkpoint of each rank
        assert set(run["restore"]["tiers"].values()) == {"own"}, run["restore"]
        assert run["machines"] == rep["runs"][0]["machines"]
    # spares warmed up on each new version while training went on: the restarts were warm
    warmed = [e["version"] for e in events(tmp_path / "state", "version_prewarmed")]
    assert warmed == [2, 3], warmed
    started = events(tmp_path / "state", "workers_started")
    for run in hot:
        assert [e["warm"] for e in started if e["run"] == run["id"]] == [True, True], started
    assert rep["unproductive_s"]["hot_update"] > 0


@pytest.mark.timeout(400)
def test_lazy_update_rides_on_the_next_failure_and_window_expires(tmp_path):
    s = spec(tmp_path, 500, chaos=["crash@step=150,machine=1"])
    # a due update waits for spares on the new code at most this long (then restarts cold)
    s["policy"]["hot_update_prewarm_s"] = 3.0
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


@pytest.mark.timeout(400)
def test_standby_follows_the_version_and_takes_over_warm(tmp_path):
    """The standby's warm workers are started on the job's code version (they once held the code
    dir, not its snapshot, and every takeover of a versioned job was cold) and are started again on
    each version applied; a machine lost after an update is replaced by warm workers on it."""
    s = spec(tmp_path, 1000, standby=1)
    script = Script([(20, {"code": code(tmp_path, "v2"), "mode": "urgent"})])
    lost = []

    def during(client, job, st):
        script(client, job, st)
        live = st.get("live") or {}
        if not lost and live.get("run", 0) >= 2 and live.get("step", 0) >= 20 and live.get("state") == "running":
            lost.append(client.post(f"/api/jobs/{job}/inject", {"chaos": "machine-down@machine=1"}))

    rep = run_job(tmp_path / "state", s, during=during, timeout=360)
    assert rep["state"] == "succeeded", rep.get("reason")
    mech = [(i["symptom"], i["mechanism"]) for i in rep["incidents"]]
    assert mech[0] == ("hot_update", "hot_update") and mech[1][1] == "evict_restart", mech
    takeover = rep["runs"][2]
    standby = (set(takeover["machines"].values()) - set(rep["runs"][1]["machines"].values())).pop()
    started = [e for e in events(tmp_path / "state", "workers_started") if e["run"] == takeover["id"]]
    assert {e["machine"]: e["warm"] for e in started}[standby] is True, started
    assert dict(statuses(tmp_path / "state"))[2] == "stable"
