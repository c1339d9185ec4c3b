"""Hangs of jobs without the SDK, on a fake clock: collective counts calibrate the
hang timer, activity outside a collective is progress, step-less ranks are judged together; the
flight recorder's summaries (worker/frhook.py) name the rank that never entered the stuck collective,
for plain scripts and SDK jobs alike."""
import importlib.util
import os

import pytest

from corekit import Harness, of, records
from stalwart import protocol as p
from stalwart.agent.progress import FR_BUFFER, hook_dir, hook_env
from stalwart.controller.rules import hangstacks as implicit
from stalwart.analyzer.activity import ActivitySample, progressed
from stalwart.controller.rules.hangwatch import HangWatch
from stalwart.controller.job import actions as a
from stalwart.controller.job.state import JobPhase
from stalwart.spec import Policy
from stalwart.topology import Topology
from test_jobcore import started

FRHOOK = os.path.join(os.path.dirname(hook_dir()), "frhook.py")


def load_frhook():
    spec = importlib.util.spec_from_file_location("frhook_under_test", FRHOOK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- the hang timer -------------------------------------------------------------------------------

def test_collectives_calibrate_the_timeout_of_ranks_without_steps():
    hw = HangWatch(Policy(hang_timeout_floor_s=1.0, hang_warmup_steps=3), ranks=[0, 1], started_at=0.0)
    assert hw.timeout() == 10.0                              # warm-up: 10 x the floor
    for k in range(1, 8):                                    # a collective every 2 s
        for r in (0, 1):
            hw.on_collectives(r, k, 3.0 + 2 * k)
    assert hw.calibrated and hw.timeout() == 10.0            # 5 x 2 s
    hw.on_collectives(0, 7, 40.0)                            # a count that did not grow: no progress
    assert hw.check(17.0 + 10.0) is None and hw.check(17.0 + 10.1) is not None
    v = hw.check(30.0)
    assert v.calibrated and v.stalled == {0: 17.0, 1: 17.0} and "no rank entered a new collective" in v.reason
    with pytest.raises(ValueError):
        hw.on_collectives(0, -1, 31.0)


def test_step_less_ranks_are_judged_together_and_activity_always_counts():
    hw = HangWatch(Policy(hang_timeout_floor_s=1.0, hang_warmup_steps=0), ranks=[0, 1], started_at=0.0)
    for k in range(1, 4):
        hw.on_collectives(0, k, float(k))
        hw.on_collectives(1, k, float(k))
    assert hw.calibrated and hw.timeout() == 5.0
    # rank 0 evaluates for 30 s (CPU outside a collective); rank 1 waits for it inside the all-reduce
    for t in range(4, 34):
        hw.on_activity(0, float(t))
        assert hw.check(float(t) + 0.5) is None, t
    assert hw.check(33.0 + 5.1) is not None                  # then nobody moves: a hang


def test_collective_counts_of_a_rank_that_reports_steps_are_ignored():
    hw = HangWatch(Policy(hang_timeout_floor_s=1.0, hang_warmup_steps=0), ranks=[0], started_at=0.0)
    hw.on_step(0, 0, 1.0)
    hw.on_step(0, 1, 2.0)
    for k in range(1, 50):
        hw.on_collectives(0, k, 2.0 + k)                     # its SDK steps are its progress
    assert hw.check(2.0 + 5.1) is not None


def test_progress_inside_a_collective_needs_a_new_collective():
    a = ActivitySample(cpu_s=1.0, log_bytes=10, collectives=5, in_collective=False)
    inside = ActivitySample(cpu_s=9.0, log_bytes=99, collectives=5, in_collective=True)
    assert not progressed(a, inside)                         # spinning and printing inside: no progress
    assert progressed(a, ActivitySample(1.0, 10, collectives=6, in_collective=True))
    assert progressed(a, ActivitySample(1.2, 10, collectives=5))      # computing between collectives
    assert progressed(ActivitySample(1.0, 10), ActivitySample(1.0, 10, collectives=0))   # recorder appears


# -- the flight-recorder hook's summaries ------------------------------------------------------------

def entry(rid, seq, retired=True, group="0", op="gloo:all_reduce", p2p=0):
    return {"pg_id": 0, "process_group": [group, "default_pg"], "collective_seq_id": seq, "p2p_seq_id": p2p,
            "is_p2p": bool(p2p), "profiling_name": op, "retired": retired, "record_id": rid, "state": "scheduled",
            "time_created_ns": rid, "input_sizes": [[4]], "frames": ["dropped"]}


def test_recorder_keeps_every_groups_last_entries_and_counts_what_was_entered():
    hook = load_frhook()
    rec = hook.Recorder(keep=2)
    s = rec.update([entry(0, 1), entry(1, 2), entry(2, 1, group="h1"), entry(3, 3, retired=False)])
    assert s["entered"] == 3 + 1 and s["in_collective"]
    assert [(e["process_group"][0], e["collective_seq_id"]) for e in s["entries"]] == [("0", 2), ("h1", 1), ("0", 3)]
    assert "frames" not in s["entries"][0]
    # the ring moved on: group h1's entry left the buffer, the stuck one finished, a new one started
    s = rec.update([entry(3, 3), entry(4, 4)])
    assert s["entered"] == 4 + 1 and not s["in_collective"]
    assert ("h1", 1) in [(e["process_group"][0], e["collective_seq_id"]) for e in s["entries"]]
    assert hook.group_key({"pg_id": 2, "process_group": ["", "x"]}) == "2"


def test_hook_env_names_and_worker_environment():
    hook = load_frhook()
    assert (hook.DIR_ENV, hook.PERIOD_ENV, hook.RUN_ENV) == (p.Env.FR_DIR, p.Env.FR_PERIOD, p.Env.RUN)
    env = hook_env({"PYTHONPATH": "/code"}, "/w/fr", 0.5)
    assert env["PYTHONPATH"] == f"{hook_dir()}:/code" and env[p.Env.FR_DIR] == "/w/fr"
    assert env[p.Env.FR_PERIOD] == "0.5" and env["TORCH_FR_BUFFER_SIZE"] == str(FR_BUFFER)
    assert hook_env({"TORCH_FR_BUFFER_SIZE": "0"}, "/w/fr", 1.0)["TORCH_FR_BUFFER_SIZE"] == "0"   # the job's choice
    assert os.path.isfile(os.path.join(hook_dir(), "sitecustomize.py"))


# -- evidence and localization -------------------------------------------------------------------

def summary(entries, t=100.0):
    return {"entries": entries, "t": t}


def test_flightrec_evidence_names_the_laggard_and_ignores_disagreement_without_waiters():
    topo = Topology(2, 2, tp=2, dp=2)
    dumps = {0: summary([entry(0, 7, group="w"), entry(1, 3, group="dpA"), entry(2, 8, retired=False, group="w")]),
             1: summary([entry(0, 7, group="w"), entry(1, 3, group="dpB"), entry(2, 8, retired=False, group="w")]),
             2: summary([entry(0, 7, group="w"), entry(1, 2, group="dpA")], t=90.0),       # stopped earlier
             3: summary([entry(0, 7, group="w"), entry(1, 3, group="dpB"), entry(2, 8, retired=False, group="w")])}
    ev = implicit.flightrec_evidence(dumps, topo, now=101.0)
    # dpA disagrees (rank 2 saw one collective less) but nobody waits in it: no evidence there
    assert [g["group"] for g in ev["groups"]] == ["the world group"]
    assert ev["laggards"] == [2] and ev["silent_s"] == {"2": 11.0}
    assert ev["groups"][0] | {} == {"group": "the world group", "pg": "w", "op": "gloo:all_reduce", "seq": 8,
                                    "waiting": [0, 1, 3], "laggards": [2], "laggard_last_seq": {"2": 7}}
    assert "ranks [2] never entered gloo:all_reduce #8 of the world group" in ev["summary"]
    assert implicit.describe_group([1, 3], topo) == "dp group [1, 3]"
    assert implicit.describe_group([0, 3], topo) == "ranks [0, 3]"
    assert implicit.flightrec_evidence({0: summary([entry(0, 1)])}, topo, 0.0) is None


def plain_job():
    return started(Harness(machines=2, gpus=1, standby=1, policy={"hang_timeout_floor_s": 1.0,
                                                                   "hang_warmup_steps": 2}))


def test_a_plain_job_that_makes_progress_outlives_the_warm_up_timeout_then_its_hang_is_localized():
    h = plain_job()
    for k in range(1, 60):              # 60 s of collectives every second, no step report ever
        h.now += 1.0
        assert h.agent("m0", p.Activity(run=1, collectives={0: k}, t=h.now)) == []
        h.agent("m1", p.Activity(run=1, ranks=[1], collectives={1: k}, t=h.now))
        assert not of(h.tick(0.0), a.TraceStacks), k
    acts = h.advance(6.0)               # then nothing moves: 5 x 1 s calibrated
    assert of(acts, a.TraceStacks) and h.st.phase == JobPhase.TRACING
    assert h.st.incident.data["hang"]["calibrated"] and h.st.incident.data["hang"]["timeout_s"] == 5.0
    # identical stacks and no stopped process: the flight recorder decides
    worker = {"role": "worker", "threads": [], "status": "sleeping"}
    waiting = summary([entry(0, 59), entry(1, 60, retired=False)], t=h.now)
    behind = summary([entry(0, 59)], t=h.now - 6)
    h.agent("m0", p.Stacks(run=1, records=[dict(worker, rank=0, flight_recorder=waiting)]))
    acts = h.agent("m1", p.Stacks(run=1, records=[dict(worker, rank=1, flight_recorder=behind)]))
    assert records(acts, "incident_traced") == [{"incident": 1, "machines": ["m1"]}]
    inc = h.st.incident
    assert inc.data["flight_recorder"]["laggards"] == [1] and "flight recorder" in inc.reason
    assert "ranks [1] never entered gloo:all_reduce #60" in inc.reason


def test_activity_of_another_run_or_outside_the_world_is_ignored():
    h = plain_job()
    h.agent("m0", p.Activity(run=7, ranks=[0], collectives={0: 3}, t=h.now + 1))
    h.agent("m0", p.Activity(run=1, ranks=[9], collectives={9: 3}, t=h.now + 1))
    assert h.st.run.hang.ranks == (0, 1)


def test_an_sdk_jobs_hang_is_localized_by_the_flight_recorder_when_the_stacks_cannot_tell():
    h = started(Harness(policy={"hang_timeout_floor_s": 2.0}))       # 2 machines x 2, SDK steps
    h.steps(10)
    acts = h.advance(3.0)
    assert of(acts, a.TraceStacks)
    worker = {"role": "worker", "threads": [], "status": "sleeping"}
    waiting = summary([entry(0, 10, group="w"), entry(1, 11, retired=False, group="w")], t=h.now)
    behind = summary([entry(0, 10, group="w")], t=h.now - 3)
    h.agent("m0", p.Stacks(run=1, records=[dict(worker, rank=r, flight_recorder=waiting) for r in (0, 1)]))
    acts = h.agent("m1", p.Stacks(run=1, records=[dict(worker, rank=2, flight_recorder=waiting),
                                                  dict(worker, rank=3, flight_recorder=behind)]))
    assert records(acts, "incident_traced") == [{"incident": 1, "machines": ["m1"]}]
    fr = h.st.incident.data["flight_recorder"]
    assert fr["groups"][0]["waiting"] == [0, 1, 2] and fr["laggards"] == [3]
    assert "flight recorder: ranks [3] never entered gloo:all_reduce #11 of the world group" in h.st.incident.reason
