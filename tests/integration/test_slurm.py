"""The Slurm backend on a real Slurm 22.05 (slurmctld + six `slurmd -N nodeN` on this host, each
node in its own network namespace as root; `slurmkit.py`), driven through `stalwart slurm submit`.

- A job with a GPU Xid on one node and a lost node (its agent and its slurmd killed) on another
  completes; both nodes are drained with stalwart's reason; the standby pool was refilled through
  Slurm (single-node allocations whose agents became standbys).
- A preempted allocation and a cancelled one (`scancel`) end the job, recorded with Slurm's
  reason, and leave nothing running.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from jobrun import events, gpt_spec, wait_for
from slurmkit import SlurmTestCluster, skip_reason

from stalwart import auth
from stalwart.client import Client, ControllerUnreachable

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture(scope="module")
def slurm():
    c = SlurmTestCluster(nodes=6, per_switch=3)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def submit(slurm: SlurmTestCluster, state_dir, spec: dict, *extra: str) -> subprocess.Popen:
    """`stalwart slurm submit` for `spec` (a YAML config) in the background."""
    os.makedirs(state_dir, exist_ok=True)
    cfg = os.path.join(state_dir, "job.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump(spec, f)
    argv = [sys.executable, "-m", "stalwart.cli", "slurm", "submit", "--config", cfg, "--state-dir", str(state_dir),
            "--advertise", slurm.ctl_addr, "--log-level", "INFO",
            "--agent-arg=--shared-host", *extra]       # six nodes, one host: one kernel log, one memory
    return subprocess.Popen(argv, env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def client_of(state_dir) -> Client | None:
    try:
        with open(os.path.join(state_dir, "controller.json")) as f:
            url = json.load(f)["url"]
        with open(os.path.join(state_dir, auth.TOKEN_FILE)) as f:
            token = f.read().strip()
    except (OSError, ValueError, KeyError):
        return None
    return Client(url, timeout=5, token=token)


def machines(state_dir) -> dict[str, dict]:
    c = client_of(state_dir)
    try:
        return {m["id"]: m for m in c.get("/api/machines")["machines"]} if c else {}
    except ControllerUnreachable:
        return {}


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


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"stalwart slurm submit did not end within {timeout}s:\n{out[-4000:]}")
    return out


def report(state_dir) -> dict:
    from stalwart.controller.report import build_report
    from stalwart.controller.store import Store
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


@pytest.mark.timeout(420)
def test_gpu_xid_and_lost_node_drained_and_pool_refilled_through_slurm(slurm, tmp_path):
    t0 = time.monotonic()
    slow = tmp_path / "slow"          # steps last 1 s while it exists: the faults happen mid-job
    slow.touch()
    spec = gpt_spec(machines=2, gpus=1, steps=200, standby=1, chaos=["gpu-xid@step=3,machine=0"])
    spec["command"] += ["--slow-while", str(slow)]
    proc = submit(slurm, tmp_path, spec)
    try:
        # the first refill (after the Xid) is a standby: now m1's node is lost (agent, workers, slurmd)
        assert wait_for(lambda: machines(tmp_path).get("m3", {}).get("state") == "standby"
                        or proc.poll() is not None, 240, 0.2), "the pool was not refilled through Slurm"
        assert proc.poll() is None, finish(proc, 5)
        print(f"first refill a standby after {time.monotonic() - t0:.1f}s")
        nodes = agent_nodes(slurm)
        lost_node, lost_agent = nodes["m1"]
        client_of(tmp_path).post("/api/jobs/1/inject", {"chaos": "machine-down@machine=1"})
        assert wait_for(lambda: not os.path.exists(f"/proc/{lost_agent}"), 30), "machine-down did not kill the agent"
        slurm.kill_node(lost_node)
        # its standby took over and the pool refilled again: let the job finish at full speed
        assert wait_for(lambda: machines(tmp_path).get("m4", {}).get("state") == "standby"
                        or proc.poll() is not None, 240, 0.2), "the pool was not refilled a second time"
        print(f"second refill a standby after {time.monotonic() - t0:.1f}s")
        slow.unlink()
        out = finish(proc, 300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    rep = report(tmp_path)
    assert rep["state"] == "succeeded" and rep["steps_completed"] == 200
    incs = rep["incidents"]
    assert [i["machines_evicted"] for i in incs] == [["m0"], ["m1"]], incs
    assert incs[0]["symptom"] == "gpu_xid" and incs[1]["symptom"] == "machine_lost", incs
    # both nodes drained with stalwart's reason (the lost one is also down: its slurmd is dead)
    xid_node = nodes["m0"][0]
    for node, n in ((xid_node, 1), (lost_node, 2)):
        info = slurm.node(node)
        assert "DRAIN" in info["State"], info
        assert info["Reason"].startswith(f"stalwart: incident {n}: "), info
    sinfo = slurm.run("sinfo", "-h", "-R", "-o", "%N|%E")
    assert f"{xid_node}|stalwart: incident 1: gpu_xid" in sinfo, sinfo
    # the pool refilled twice through Slurm: single-node allocations whose agents became standbys
    asked = [m for e in events(tmp_path, "machines_requested") for m in e["machines"]]
    added = [e["machine"] for e in events(tmp_path, "standby_added")]
    assert asked[:2] == ["m3", "m4"] and {"m3", "m4"} <= set(added), (asked, added)
    state = json.load(open(tmp_path / "slurm" / "state.json"))
    refills = state["allocations"][1:]
    assert len(refills) >= 2
    for job in refills[:2]:
        assert "NumNodes=1 " in slurm.run("scontrol", "-o", "show", "job", job)
    # each agent registered with its node's switch (topology/tree) and node name
    from stalwart.controller.store import Store
    store = Store(f"sqlite:///{tmp_path}/stalwart.db")
    try:
        labels = {m["id"]: (m["info"] or {}).get("labels", {}) for m in store.machines()}
    finally:
        store.close()
    for m in ("m0", "m1"):
        node = nodes[m][0]
        assert labels[m]["slurm.node"] == node and labels[m]["switch"] == slurm.switch_of(node), labels
    assert wait_for(lambda: not stalwart_processes(slurm), 30), f"left running: {stalwart_processes(slurm)}"
    print(f"slurm job with two faults: {time.monotonic() - t0:.1f}s")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["preempt", "scancel"])
def test_allocation_preempted_or_cancelled_ends_the_job(slurm, tmp_path, how):
    t0 = time.monotonic()
    slurm.wait_idle_count(2, 60)
    spec = gpt_spec(machines=2, gpus=1, steps=100000)
    proc = submit(slurm, tmp_path, spec)
    try:
        assert wait_for(lambda: steps_done(tmp_path) >= 3 or proc.poll() is not None, 180, 0.5)
        assert proc.poll() is None, finish(proc, 5)
        main = json.load(open(tmp_path / "slurm" / "state.json"))["main"]
        if how == "preempt":
            node = agent_nodes(slurm)["m0"][0]
            slurm.run("sbatch", "--partition=urgent", f"--nodelist={node}", "--nodes=1",
                      f"--output={tmp_path}/urgent.out", "--wrap", "sleep 1")
        else:
            slurm.run("scancel", main)
        out = finish(proc, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-4000:]
    rep = report(tmp_path)
    want = {"preempt": "was preempted (PREEMPTED)", "scancel": "was cancelled ("}[how]
    assert rep["state"] == "cancelled" and rep["reason"].startswith(f"the Slurm allocation {main} {want}"), \
        (rep["state"], rep["reason"], out[-3000:])
    assert wait_for(lambda: not stalwart_processes(slurm), 30), f"left running: {stalwart_processes(slurm)}"
    print(f"{how}: {time.monotonic() - t0:.1f}s")
