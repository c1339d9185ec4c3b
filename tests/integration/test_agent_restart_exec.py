"""An agent restart with workers that are not `python` (a shell loop here): the machine's exec
server (agent/forkserver.py, "Exec mode") is their parent, so they outlive the killed agent, and
the agent started on the same work directory adopts them like forked ones, or, for one that ended
while no agent ran, reports the exit code the exec server noted."""
import os
import re
import signal

import pytest

from jobrun import wait_for
from stalwart.agent import adopt
from test_agent_restart import machine
from test_controller_restart import finish, start, why

# prints a line every 50 ms until the test says `go` (exit 0) or `fail` (exit 3), bounded (exit 9)
LOOP = """i=0; echo "started $$"
while [ ! -e "$D/go" ]; do
  if [ -e "$D/fail" ]; then rm -f "$D/fail"; echo failing; exit 3; fi
  i=$((i+1)); echo "step $i"; sleep 0.05
  [ $i -lt 1200 ] || exit 9
done
echo done"""


def shell_spec(d) -> dict:
    return {"name": "sh", "machines": 1, "gpus_per_machine": 1, "steps": 10,
            "command": ["bash", "-c", LOOP.replace("$D", str(d))],
            "policy": {"heartbeat_s": 0.5, "missed_beats": 10}}


def out_lines(rank: adopt.WorkerRecord) -> int:
    with open(rank.out_path) as f:
        return f.read().count("step ")


@pytest.mark.timeout(90)
def test_a_restarted_agent_adopts_a_shell_worker_without_an_incident(tmp_path):
    cluster, job, _ = start(tmp_path, shell_spec(tmp_path))
    workdir = os.path.join(tmp_path, "machines", "m0")
    try:
        assert wait_for(lambda: (s := adopt.load(workdir)) is not None and len(s.workers) == 1, timeout=60)
        [rank] = adopt.load(workdir).workers
        assert rank.forked                                   # its parent is the exec server, not the agent
        before = machine(cluster, "m0")["registered_at"]
        cluster.restart_agent("m0")                          # SIGKILL, then a new agent on the work directory
        assert wait_for(lambda: machine(cluster, "m0")["registered_at"] != before, timeout=20)
        log = tmp_path / "logs" / "agent-m0.log"
        assert re.search(rf"adopting run 1: ranks 0 \(pid {rank.pid}\)", log.read_text()), log.read_text()[-3000:]
        assert adopt.start_ticks(rank.pid) == rank.start_ticks      # the same process runs on
        printed = out_lines(rank)
        assert wait_for(lambda: out_lines(rank) > printed + 5, timeout=10)
        (tmp_path / "go").touch()
        rep = finish(cluster, job, timeout=30)
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path, None, job))
        assert rep["incidents"] == [] and len(rep["runs"]) == 1, (rep["incidents"], rep["runs"])
    finally:
        (tmp_path / "go").touch()
        cluster.stop()
    assert adopt.start_ticks(rank.pid) is None


@pytest.mark.timeout(90)
def test_a_shell_worker_that_failed_while_no_agent_ran_is_reported_with_its_code(tmp_path):
    cluster, job, _ = start(tmp_path, shell_spec(tmp_path))
    workdir = os.path.join(tmp_path, "machines", "m0")
    exits = os.path.join(workdir, "logs", "exits")
    try:
        assert wait_for(lambda: (s := adopt.load(workdir)) is not None and len(s.workers) == 1, timeout=60)
        [rank] = adopt.load(workdir).workers
        agent = cluster.agents["m0"]
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        (tmp_path / "fail").touch()                           # the worker exits 3 with no agent to see it
        assert wait_for(lambda: os.path.exists(os.path.join(exits, str(rank.pid))), timeout=10)
        with open(os.path.join(exits, str(rank.pid))) as f:
            assert f.read() == "3"                            # noted by the exec server, its parent
        (tmp_path / "go").touch()                             # (the next run ends at once, with 0)
        cluster.restart_agent("m0")
        rep = finish(cluster, job, timeout=60)
        log = (tmp_path / "logs" / "agent-m0.log").read_text()
        assert f"adopting no workers: rank 0 (pid {rank.pid}) of run 1 is gone" in log, log[-3000:]
        assert rep["state"] == "succeeded", (rep.get("reason"), why(tmp_path, None, job))
        assert len(rep["incidents"]) == 1 and len(rep["runs"]) == 2, (rep["incidents"], rep["runs"])
        [inc] = rep["incidents"]
        assert "rank 0 on m0 exit code 3" in inc["cause"], inc          # its real code, not "killed"
        assert inc["machines_evicted"] == [], inc
    finally:
        (tmp_path / "go").touch()
        cluster.stop()
