"""The agent's keeper (agent/keeper.py), which the Kubernetes agent pods and Slurm's agent steps
run the agent under: a dead agent is started again at once and adopts its workers, so a crash
costs the job nothing; a stop, a usage error or a lost machine ends the keeper; the orphans a dead
agent leaves are reaped, never left as zombies."""
import os
import signal
import subprocess
import sys
import time

import pytest

from jobrun import wait_for
from stalwart.agent import adopt, keeper
from stalwart.agent.workers import kill_tree
from test_agent_restart import machine, step, training
from test_controller_restart import finish, why

KEEPER = [sys.executable, "-m", "stalwart.agent.keeper", "--"]

# a stand-in agent: its first life leaves a child behind and dies by SIGKILL; its second writes
# "ready" and waits for SIGTERM, which ends it with code 0
AGENT = """
import os, signal, subprocess, sys, time
d = sys.argv[1]
lives = len([n for n in os.listdir(d) if n.startswith("life")]) if os.path.isdir(d) else 0
os.makedirs(d, exist_ok=True)
open(os.path.join(d, f"life{lives}"), "w").write(str(os.getpid()))
if lives == 0:
    orphan = subprocess.Popen(["sleep", "60"])
    open(os.path.join(d, "orphan"), "w").write(str(orphan.pid))
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
open(os.path.join(d, "ready"), "w").write("1")
while True:
    time.sleep(1)
"""


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.timeout(60)
def test_a_dead_agent_is_started_again_its_orphans_reaped_and_a_stop_passed_on(tmp_path):
    d = tmp_path / "lives"
    p = subprocess.Popen(KEEPER + [sys.executable, "-c", AGENT, str(d)], stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert wait_for(lambda: (d / "ready").exists(), timeout=30)
        orphan = int((d / "orphan").read_text())
        assert int(open(f"/proc/{orphan}/stat").read().rsplit(")", 1)[1].split()[1]) == p.pid  # its reaper now
        os.kill(orphan, signal.SIGKILL)
        assert wait_for(lambda: _state(orphan) is None, timeout=10), f"left as {_state(orphan)}"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        kill_tree(p.pid)
    err = p.stderr.read()
    assert "the agent killed by signal 9 after" in err and "starting it again in 0.5s" in err, err
    assert sorted(os.listdir(d)) == ["life0", "life1", "orphan", "ready"]


@pytest.mark.parametrize("code", [0, 2, keeper.MACHINE_DOWN_CODE])
def test_a_stop_a_usage_error_or_a_lost_machine_ends_the_keeper(code):
    out = subprocess.run(KEEPER + [sys.executable, "-c", f"import sys; sys.exit({code})"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == code and "starting it again" not in out.stderr


def test_the_pause_doubles_while_the_agent_keeps_dying_and_resets_after_a_healthy_life():
    assert keeper.next_pause(0.0, 1.0) == keeper.FIRST_PAUSE_S          # the first death
    assert keeper.next_pause(0.5, 1.0) == 1.0
    assert keeper.next_pause(8.0, 1.0) == keeper.MAX_PAUSE_S
    assert keeper.next_pause(8.0, keeper.HEALTHY_S) == keeper.FIRST_PAUSE_S


@pytest.mark.timeout(150)
def test_an_agent_killed_under_its_keeper_comes_back_and_adopts_its_worker_without_an_incident(tmp_path):
    cluster, job, workdir = training(tmp_path)
    try:
        # m1's agent goes under a keeper (as in an agent pod): its first agent adopts the worker ...
        old = cluster.agents["m1"]
        argv = list(old.args)
        os.kill(old.pid, signal.SIGKILL)
        old.wait(timeout=10)
        cluster.agents["m1"] = cluster._spawn(KEEPER + argv, "agent-m1.log")
        [rank] = adopt.load(workdir).workers
        assert wait_for(lambda: adopt.load(workdir).agent_pid not in (old.pid, rank.pid), timeout=30)
        # ... and when that agent is killed, the keeper starts the next, which adopts it again
        first = adopt.load(workdir).agent_pid
        before = machine(cluster, "m1")["registered_at"]
        os.kill(first, signal.SIGKILL)
        t0 = time.monotonic()
        assert wait_for(lambda: machine(cluster, "m1")["registered_at"] != before, timeout=20)
        print(f"\nagent killed under its keeper -> re-registered: {time.monotonic() - t0:.2f}s")
        assert step(cluster, job) < 120, "the job was nearly over before the agent came back"
        assert wait_for(lambda: adopt.load(workdir).agent_pid not in (first, old.pid), timeout=20)
        assert adopt.start_ticks(rank.pid) == rank.start_ticks      # the same worker trains on
        log = (tmp_path / "logs" / "agent-m1.log").read_text()
        assert "the agent killed by signal 9" in log and log.count(f"adopting run 1: ranks 1 (pid {rank.pid})") == 2
        rep = finish(cluster, job, timeout=120)
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path, None, job))
        assert rep["incidents"] == [] and len(rep["runs"]) == 1, (rep["incidents"], rep["runs"])
    finally:
        cluster.stop()
    assert adopt.start_ticks(rank.pid) is None
