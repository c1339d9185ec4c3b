"""A plain torch.distributed script (no SDK) under stalwart. Its progress comes
from the workers themselves (CPU time outside a collective, and the collectives each rank's flight
recorder saw: agent/progress.py, worker/frhook.py), so a long pause is not a hang; a SIGSTOPped rank
still is, and the flight recorder names it.

Both tests run on a time scale of 1/10. The issue's case is ten minutes of steps with pauses between
collectives longer than the hang timeout's floor, under the default policy (floor 10 s, so a warm-up
timeout of 100 s and a calibrated one of 5 x the longest recent interval). Here the floor is 1 s and
every duration of the job is a tenth of that case's: steps of 1 s (10 s), an evaluation of 8 s (80 s)
on rank 0 while the other rank waits inside the all-reduce, 60 s of training (10 minutes). Every
threshold of the hang timer is the floor, a multiple of it, or a multiple of observed intervals, so
scaling every duration by the same factor leaves every verdict unchanged; what is not scaled is the
agents' sampling period (0.5 s here, i.e. 5 s at full scale: coarser, so harder) and the host's
scheduling noise (larger relative to the scaled durations: harder too).
"""
import os
import sys
import time

import pytest

from jobrun import events, gpt_spec, run_job, wait_for
from stalwart.backends.local import LocalCluster
from stalwart.spec import JobSpec

PLAIN = os.path.join(os.path.dirname(__file__), "plainjob.py")
SCALE = 0.1          # of the full-size case (see the module docstring)


def plain_spec(standby: int = 0, steps: int = 40) -> dict:
    # 40 steps of 1 s and two evaluations of 8 s on rank 0 (after steps 15 and 30): about 60 s
    cmd = [sys.executable, PLAIN, "--steps", str(steps), "--step-s", str(10 * SCALE),
           "--eval-every", "15", "--eval-s", str(80 * SCALE)]
    return gpt_spec(machines=2, gpus=1, steps=steps, standby=standby, command=cmd,
                    policy={"heartbeat_s": 0.5, "missed_beats": 4, "hang_timeout_floor_s": 10 * SCALE})


@pytest.mark.timeout(240)
def test_plain_script_with_long_pauses_is_not_declared_hung(tmp_path):
    """Without progress from the workers this job is declared hung at the warm-up timeout (10 s
    here, 100 s at full scale); it runs six times that, with evaluations longer than the timeout
    calibrated from its step intervals, and ends without an incident."""
    t0 = time.monotonic()
    rep = run_job(tmp_path, plain_spec(), timeout=200)
    wall = time.monotonic() - t0
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["incidents"] == [], [(i["symptom"], i["cause"]) for i in rep["incidents"]]
    assert rep["wall_s"] > 5 * 10 * (10 * SCALE), rep["wall_s"]       # well past the warm-up timeout
    print(f"plain job: {rep['wall_s']:.1f} s of job, {wall:.1f} s in all")


def _log_lines(state_dir, machine: str) -> int:
    path = os.path.join(state_dir, "machines", machine, "logs", "run1_rank0.out")
    try:
        with open(path) as f:
            return sum(1 for line in f if line.startswith("step "))
    except OSError:
        return 0


@pytest.mark.timeout(240)
def test_sigstopped_rank_of_a_plain_script_is_found_and_named_by_the_flight_recorder(tmp_path):
    spec = JobSpec.from_dict(plain_spec(standby=1))
    cluster = LocalCluster(str(tmp_path), 3, 1, heartbeat_s=0.5, missed_beats=4)
    try:
        cluster.start()
        client = cluster.client()
        job = client.post("/api/jobs", {"spec": spec.to_dict()})["job"]
        # past the hang timer's calibration (3 warm-up marks) and before the first evaluation
        assert wait_for(lambda: _log_lines(tmp_path, "m0") >= 8, timeout=90), "the job did not start"
        client.post(f"/api/jobs/{job}/inject", {"chaos": "sigstop@machine=1,rank=1"})

        def evicted():
            incs = client.get(f"/api/jobs/{job}")["incidents"]
            return bool(incs) and bool(incs[0].get("machines_evicted"))
        assert wait_for(evicted, timeout=90, every=0.5), client.get(f"/api/jobs/{job}")["incidents"]
        rep = client.get(f"/api/jobs/{job}")
        client.post(f"/api/jobs/{job}/cancel", {"reason": "test over"})
    finally:
        cluster.stop()
    [inc] = rep["incidents"]
    assert inc["symptom"] == "hang" and inc["machines_evicted"] == ["m1"], inc["cause"]
    hang, fr = inc["hang"], inc["flight_recorder"]
    assert hang["calibrated"], hang
    # found (detected and localized) within 20 s past the calibrated timeout
    found = inc["localized_at"] - inc["injected_at"]
    assert found - hang["timeout_s"] < 20.0, (found, hang)
    # the flight recorder names the stopped rank, and the collective rank 0 waits in
    assert fr["laggards"] == [1], fr
    [group] = fr["groups"]
    assert group["op"] == "gloo:all_reduce" and group["waiting"] == [0] and group["laggards"] == [1], group
    assert "never entered gloo:all_reduce" in inc["cause"]
    print(f"timeout {hang['timeout_s']:.1f} s, found after {found:.1f} s: {inc['cause']}")


@pytest.mark.timeout(240)
def test_a_rank_that_never_exits_after_the_training_ends_the_job_as_succeeded(tmp_path):
    """Rank 1 trains to the end, leaves its process group and then never exits (as a worker
    deadlocked in torch's teardown); rank 0 exits 0. The job ends as succeeded at the hang timeout,
    without an incident or a restart, and rank 1's worker is stopped."""
    cmd = [sys.executable, PLAIN, "--steps", "12", "--step-s", "0.2", "--eval-every", "0", "--stuck-at-exit", "1"]
    spec = gpt_spec(machines=2, gpus=1, steps=12, command=cmd,
                    policy={"heartbeat_s": 0.5, "missed_beats": 4, "hang_timeout_floor_s": 1.0})
    rep = run_job(tmp_path, spec, timeout=200)
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["incidents"] == [], [(i["symptom"], i["cause"]) for i in rep["incidents"]]
    assert "rank(s) [1] on m1 stuck" in (rep.get("reason") or ""), rep.get("reason")
    (ev,) = events(tmp_path, "exit_hang")
    assert ev["ranks"] == [1] and ev["done"] == [0]
    with open(os.path.join(tmp_path, "machines", "m1", "logs", "run1_rank1.out")) as f:
        assert "rank 1 stuck at exit" in f.read()
