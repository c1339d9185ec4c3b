"""The Slurm backend on a real Slurm 22.05 (slurmctld + six `slurmd -N nodeN` on this host, each
node in its own network namespace as root, one GPU GRES each; `slurmkit.py`).

- `stalwart slurm sbatch`: the submitting process exits at once (the user logs out) and the
  controller runs in the allocation; a node is lost mid-job (its agent and its slurmd killed): it is
  drained with stalwart's reason, a standby takes over, the pool is refilled through a single-node
  allocation like the job's, and the job finishes; `status`/`logs --slurm-job` find it; GPUs were
  requested.
- A user's own `#SBATCH` script running `stalwart slurm run`, requeued mid-job (`scontrol
  requeue`, what a preemption with PreemptMode=REQUEUE does): the next run takes the job over and
  it finishes from its newest durable checkpoint, not from step 0.
- Hostlists, jobs and nodes as the backend reads them (`scontrol show hostnames`, `--json`).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from jobrun import events, gpt_spec, wait_for
from slurmkit import SlurmTestCluster, skip_reason

from stalwart.security import auth
from stalwart.backends import slurm_cli
from stalwart.transport.client import Client

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture(scope="module")
def slurm():
    c = SlurmTestCluster(nodes=6, per_switch=3)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def client_of(state_dir) -> Client | None:
    try:
        with open(os.path.join(state_dir, "controller.json")) as f:
            url = json.load(f)["url"]
        with open(os.path.join(state_dir, auth.TOKEN_FILE)) as f:
            token = f.read().strip()
    except (OSError, ValueError, KeyError):
        return None
    return Client(url, timeout=5, token=token)


def agent_nodes(slurm: SlurmTestCluster) -> dict[str, tuple[str, int]]:
    """machine -> (Slurm node, agent pid), from the agents' processes."""
    out = {}
    for p in slurm.processes():
        try:
            cmd = p.cmdline()
            if "agent" in cmd and "--machine-id" in cmd:
                out[cmd[cmd.index("--machine-id") + 1]] = (p.environ().get("SLURMD_NODENAME", "?"), p.pid)
        except Exception:
            pass
    return out


def stalwart_processes(slurm: SlurmTestCluster) -> list[str]:
    out = []
    for p in slurm.processes():
        try:
            if "stalwart" in " ".join(p.cmdline()):
                out.append(" ".join(p.cmdline())[:200])
        except Exception:
            pass
    return out


def report(state_dir) -> dict:
    from stalwart.controller.report.build import build_report
    from stalwart.controller.store.db import Store
    store = Store(f"sqlite:///{state_dir}/stalwart.db")
    try:
        return build_report(store, 1)
    finally:
        store.close()


def steps_done(state_dir) -> int:
    c = client_of(state_dir)
    try:
        return int(c.get("/api/jobs/1")["steps_completed"]) if c else 0
    except Exception:           # not up, or the job not submitted yet
        return 0


def slurm_env(slurm: SlurmTestCluster, tmp_path) -> dict[str, str]:
    """The test cluster's environment, with the registry of submitted jobs in the test's dir."""
    return dict(slurm.env, STALWART_SLURM_JOBS=str(tmp_path / "registry"))


def cli(env: dict[str, str], *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stalwart.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def allocations(state_dir) -> list[str]:
    """The Slurm jobs the backend made or took as its own (the main allocation first)."""
    try:
        return json.load(open(os.path.join(state_dir, "slurm", "state.json")))["allocations"]
    except (OSError, ValueError, KeyError):
        return []


def job_of(slurm: SlurmTestCluster, job: str) -> slurm_cli.JobInfo:
    """Slurm job `job` as the backend reads it (22.05's `squeue --json` lists every job it holds)."""
    jobs = json.loads(slurm.run("squeue", "--json", "--states=all", f"--jobs={job}"))["jobs"]
    return slurm_cli.JobInfo.from_json(next(j for j in jobs if str(j["job_id"]) == job))


def wait_allocation_gone(slurm: SlurmTestCluster, job: str, timeout: float) -> str:
    """Wait until Slurm job `job` ends; its final state."""
    final = {}

    def ended() -> bool:
        info = job_of(slurm, job)
        final["state"] = info.state
        return info.state not in slurm_cli.LIVE_STATES and info.state != "COMPLETING"
    assert wait_for(ended, timeout, 0.5), f"Slurm job {job} still {final}"
    return final["state"]


def test_hostlists_jobs_and_nodes_as_slurm_gives_them(slurm):
    env_conf = {"SLURM_CONF": slurm.env["SLURM_CONF"]}
    old = {k: os.environ.get(k) for k in env_conf}
    os.environ.update(env_conf)
    try:
        assert slurm_cli.hostnames("n[1-3,5],gpu[08-09]-ib[0-1]") == [
            "n1", "n2", "n3", "n5", "gpu08-ib0", "gpu08-ib1", "gpu09-ib0", "gpu09-ib1"]
        node = slurm_cli.node_info("n2")
        assert node is not None and node.address == slurm.node_addr["n2"] and node.features == "rack1"
        assert slurm_cli.node_labels("n5") == {"slurm.node": "n5", "switch": slurm.switch_of("n5")}
        assert slurm_cli.job_info("999999") is None
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.timeout(300)
def test_sbatch_then_log_out_a_node_is_lost_and_the_job_finishes(slurm, tmp_path):
    t0 = time.monotonic()
    slurm.wait_idle_count(4, 60)
    env = slurm_env(slurm, tmp_path)
    slow = tmp_path / "slow"          # steps last 1 s while it exists: the fault happens mid-job
    slow.touch()
    spec = gpt_spec(machines=2, gpus=1, steps=40, standby=1)
    spec["command"] += ["--slow-while", str(slow)]
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(spec))
    sub = cli(env, "slurm", "sbatch", "--config", str(cfg), "--state-dir", str(tmp_path), "--log-level", "INFO",
              "--agent-arg=--shared-host", timeout=30)       # six nodes, one host: one kernel log
    # the submitting process is gone: the job runs in the allocation
    assert sub.returncode == 0, sub.stderr
    job = re.search(r"Slurm job (\d+) submitted", sub.stdout).group(1)
    print(f"sbatch returned after {time.monotonic() - t0:.1f}s")
    try:
        assert wait_for(lambda: steps_done(tmp_path) >= 3, 120, 0.5), slurm.run("squeue")
        info = job_of(slurm, job)
        assert info.gres == "gpu:1" and info.restarts == 0          # the GPUs were asked for
        nodes = agent_nodes(slurm)
        assert nodes["m0"][0] == info.batch_host                    # the controller's node holds m0
        lost_node, lost_agent = nodes["m1"]
        client_of(tmp_path).post("/api/jobs/1/inject", {"chaos": "machine-down@machine=1"})
        assert wait_for(lambda: not os.path.exists(f"/proc/{lost_agent}"), 30), "machine-down did not kill the agent"
        slurm.kill_node(lost_node)
        # its standby takes over; the pool is refilled through Slurm: a single-node allocation
        # like the job's (its agent registers as m3)
        assert wait_for(lambda: len(allocations(tmp_path)) >= 2, 120, 0.5), allocations(tmp_path)
        refill = allocations(tmp_path)[1]
        assert job_of(slurm, refill).gres == "gpu:1"
        print(f"refill asked for after {time.monotonic() - t0:.1f}s")
        slow.unlink()
        assert wait_allocation_gone(slurm, job, 120) == "COMPLETED"
    finally:
        slurm.run("scancel", job, check=False)
    rep = report(tmp_path)
    assert rep["state"] == "succeeded" and rep["steps_completed"] == 40, rep["state"]
    incs = rep["incidents"]
    assert [i["machines_evicted"] for i in incs] == [["m1"]] and incs[0]["symptom"] == "machine_lost", incs
    node = slurm.node(lost_node)
    assert "DRAIN" in node["State"] and node["Reason"].startswith("stalwart: incident 1: "), node
    asked = [m for e in events(tmp_path, "machines_requested") for m in e["machines"]]
    assert asked[:1] == ["m3"], asked
    assert "NumNodes=1 " in slurm.run("scontrol", "-o", "show", "job", refill)
    # found from the Slurm job's id alone
    st = cli(env, "status", "--slurm-job", job)
    assert st.returncode == 0 and "succeeded" in st.stdout, st.stdout + st.stderr
    logs = cli(env, "logs", "--slurm-job", job, "--controller-log", "-n", "200")
    assert logs.returncode == 0 and "stalwart: job 1 submitted" in logs.stdout, logs.stdout[-2000:]
    assert wait_for(lambda: not stalwart_processes(slurm), 30), f"left running: {stalwart_processes(slurm)}"
    print(f"sbatch job with a lost node: {time.monotonic() - t0:.1f}s")


USER_SCRIPT = """#!/bin/sh
#SBATCH --nodes=2
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}
exec {python} -m stalwart.cli slurm run --config {cfg} --state-dir {state} --log-level INFO --agent-arg=--shared-host
"""


@pytest.mark.timeout(300)
def test_a_requeued_allocation_resumes_the_job_from_its_durable_checkpoint(slurm, tmp_path):
    t0 = time.monotonic()
    slurm.wait_idle_count(2, 60)
    env = slurm_env(slurm, tmp_path)
    slow = tmp_path / "slow"
    slow.touch()
    spec = gpt_spec(machines=2, gpus=1, steps=20)          # durable checkpoints every 5 steps
    spec["command"] += ["--slow-while", str(slow)]
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(spec))
    script = tmp_path / "train.sbatch"                      # the user's own batch script
    script.write_text(USER_SCRIPT.format(out=tmp_path / "slurm-%j.out", python=sys.executable, cfg=cfg,
                                         state=tmp_path))
    job = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        assert wait_for(lambda: steps_done(tmp_path) >= 7, 150, 0.5), slurm.run("squeue")
        slurm.run("scontrol", "requeue", job)
        slow.unlink()
        # Slurm holds a requeued job back a while (BeginTime): let it run as soon as it can
        assert wait_for(lambda: "PENDING" in slurm.run("squeue", "-h", "-j", job, "-o", "%T"), 60, 0.5)
        slurm.run("scontrol", "update", f"jobid={job}", "starttime=now")
        assert wait_allocation_gone(slurm, job, 180) == "COMPLETED"
    finally:
        slurm.run("scancel", job, check=False)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert "requeued allocation" in out and "job 1 taken over" in out, out[-3000:]
    rep = report(tmp_path)
    assert rep["state"] == "succeeded" and rep["steps_completed"] == 20, (rep["state"], out[-3000:])
    # every rank restored from the durable tier (the new nodes' memory is empty), at the newest
    # durable step before the requeue (every 5 steps: at least step index 4 of 7 done)
    restores = events(tmp_path, "restore_source")
    assert len(restores) == 2 and {(r["tier"], r["step"]) for r in restores} == {("durable", restores[0]["step"])}
    assert restores[0]["step"] >= 4, restores
    assert wait_for(lambda: not stalwart_processes(slurm), 30), f"left running: {stalwart_processes(slurm)}"
    print(f"requeued and resumed: {time.monotonic() - t0:.1f}s")
