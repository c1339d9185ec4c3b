"""An agent killed mid-run (its workers untouched) and restarted on its work directory, as a
supervisor would, adopts its running workers and re-registers within the heartbeat limit: the
job goes on in the same run, with no incident. The time from the restart to the re-registration
is printed (`-s`)."""
import os
import re
import time

import pytest

from jobrun import gpt_spec, wait_for
from stalwart.agent import adopt
from stalwart.agent.workers import kill_tree
from test_controller_restart import finish, start, status, why


def machine(cluster, name: str) -> dict:
    return next(m for m in cluster.client(timeout=10).get("/api/machines")["machines"] if m["id"] == name)


def step(cluster, job) -> int:
    return (status(cluster, job).get("live") or {}).get("step", 0)


def training(tmp_path):
    """A two-machine job of 150 steps, past its fifth: (cluster, job, m1's work directory)."""
    spec = gpt_spec(machines=2, gpus=1, dp=2, steps=150, policy={"heartbeat_s": 0.5, "missed_beats": 10})
    cluster, job, _ = start(tmp_path, spec)
    try:
        assert wait_for(lambda: step(cluster, job) >= 5, timeout=120)
    except BaseException:
        cluster.stop()
        raise
    return cluster, job, os.path.join(tmp_path, "machines", "m1")


@pytest.mark.timeout(150)
def test_a_restarted_agent_adopts_its_workers_without_an_incident(tmp_path):
    cluster, job, workdir = training(tmp_path)
    try:
        [rank] = adopt.load(workdir).workers
        before = machine(cluster, "m1")["registered_at"]
        t0 = time.monotonic()
        new = cluster.restart_agent("m1")
        assert wait_for(lambda: machine(cluster, "m1")["registered_at"] != before, timeout=20)
        took = time.monotonic() - t0
        print(f"\nagent restart -> re-registered with its worker adopted: {took:.2f}s")
        at = step(cluster, job)
        assert at < 100, "the job was nearly over before the agent came back: nothing was shown"
        log = tmp_path / "logs" / "agent-m1.log"
        assert re.search(rf"adopting run 1: ranks 1 \(pid {rank.pid}\)", log.read_text()), log.read_text()[-3000:]
        assert wait_for(lambda: f"rank 1 (pid {rank.pid}) linked again" in log.read_text(), timeout=20)
        assert adopt.load(workdir).agent_pid == new.pid
        assert adopt.start_ticks(rank.pid) == rank.start_ticks      # the same process trains on
        rep = finish(cluster, job, timeout=120)
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path, None, job))
        assert rep["incidents"] == [] and len(rep["runs"]) == 1, (rep["incidents"], rep["runs"])
        assert rep["steps_completed"] == 150
    finally:
        cluster.stop()
    assert adopt.start_ticks(rank.pid) is None          # stopped with the cluster


@pytest.mark.timeout(150)
def test_a_restarted_agent_whose_worker_died_reports_it_and_the_run_recovers(tmp_path):
    """One machine, so that nothing but the restarted agent can tell the controller: its report
    of the rank that ended while it was away is what starts the recovery. The run restarts from
    the newest copy left: in memory (what the worker committed before it died) or the durable one
    the killed agent made (reported again by its successor: the first report may have died with
    it), never from the start."""
    spec = gpt_spec(machines=1, gpus=1, steps=60, policy={"heartbeat_s": 0.5, "missed_beats": 10})
    cluster, job, _ = start(tmp_path, spec)
    workdir = os.path.join(tmp_path, "machines", "m0")
    durable = tmp_path / "checkpoints" / f"job{job}" / "rank00000.step000000000004.hdr"
    try:
        assert wait_for(lambda: step(cluster, job) >= 6 and durable.exists(), timeout=120)
        [rank] = adopt.load(workdir).workers
        cluster.agents["m0"].kill()
        cluster.agents["m0"].wait(timeout=10)
        kill_tree(rank.pid)                      # the machine's worker dies with its agent away
        cluster.restart_agent("m0")
        rep = finish(cluster, job, timeout=120)
        log = (tmp_path / "logs" / "agent-m0.log").read_text()
        assert f"adopting no workers: rank 0 (pid {rank.pid}) of run 1 is gone" in log, log[-3000:]
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path, None, job))
        assert len(rep["incidents"]) == 1, rep["incidents"]
        [inc] = rep["incidents"]
        assert len(rep["runs"]) == 2 and rep["steps_completed"] == 60
        assert inc["machines_evicted"] == [], inc        # a crash, not a lost machine
        assert rep["runs"][1]["start_step"] >= 5, rep["runs"]     # from step 4 or newer
    finally:
        cluster.stop()


@pytest.mark.timeout(60)
def test_a_recycled_pid_is_neither_adopted_nor_stopped_and_the_agent_says_why(tmp_path):
    """A state file naming a live process that is not the recorded one (a recycled pid): never
    adopted, never killed; the agent says why in one line."""
    import subprocess
    import sys

    from stalwart.security.auth import create_token_file
    workdir = tmp_path / "w"
    workdir.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        ticks = adopt.start_ticks(other.pid)
        assert ticks is not None
        adopt.save(str(workdir), adopt.AgentState(machine="m0", agent_pid=1, job=1, run=4, workers=(
            adopt.WorkerRecord(pid=other.pid, rank=0, local_rank=0, start_ticks=ticks - 1,
                               out_path="", err_path=""),)))
        create_token_file(str(tmp_path / "token"))
        agent = subprocess.Popen([sys.executable, "-m", "stalwart.cli", "agent", "--controller", "http://127.0.0.1:9",
                                  "--machine-id", "m0", "--workdir", str(workdir), "--token-file",
                                  str(tmp_path / "token"), "--kmsg", "off", "--shared-host"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert wait_for(lambda: adopt.load(str(workdir)).agent_pid == agent.pid, timeout=30)
        finally:
            agent.kill()
            err = agent.communicate(timeout=10)[1]
        assert f"adopting no workers: rank 0's pid {other.pid} is another process now (a recycled pid)" in err, err
        assert other.poll() is None                  # not ours: left alone
        assert adopt.load(str(workdir)).workers == ()
    finally:
        other.kill()
        other.wait()
