"""An agent on a real host watches the host's interfaces and kernel log.

Each test starts a controller and one agent the way the README's "Several real machines" section
does (no `--shared-host`, no network namespace), gives it a job, and acts on this host for real: a
veth pair is created and the end the agent watches (`--nic`) is taken down with `ip link`; a line with
an Xid is written to /dev/kmsg. Needs root (veth, writing /dev/kmsg): skipped otherwise, with the
reason. Everything created is removed even when a test fails.
"""
import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

import pytest

from jobrun import gpt_spec, wait_for
from stalwart.agent.workers import die_with_parent
from stalwart.backends.local import LocalCluster
from stalwart.controller.store.db import Store

SLEEPER = [sys.executable, "-c", "import time\nwhile True:\n    time.sleep(0.2)"]


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def veth():
    """A veth pair on this host, both ends up; yields the end the agent watches."""
    if os.geteuid() != 0:
        pytest.skip("creating a veth pair needs root")
    name = "swt" + uuid.uuid4().hex[:6]
    a, b = name + "a", name + "b"
    made = ip("link", "add", a, "type", "veth", "peer", "name", b)
    if made.returncode != 0:
        pytest.skip(f"cannot create a veth pair here: {made.stderr.strip()}")
    try:
        assert ip("link", "set", a, "up").returncode == 0 and ip("link", "set", b, "up").returncode == 0
        assert wait_for(lambda: open(f"/sys/class/net/{a}/operstate").read().strip() == "up", timeout=10)
        yield a
    finally:
        ip("link", "del", a)          # takes its peer with it
    assert not os.path.exists(f"/sys/class/net/{a}") and not os.path.exists(f"/sys/class/net/{b}")


def health(state_dir, job: int, kind: str) -> list[dict]:
    store = Store(f"sqlite:///{state_dir}/stalwart.db")
    try:
        return [dict(e["data"], t=e["t"]) for e in store.events(job, ["health"]) if e["data"].get("kind") == kind]
    finally:
        store.close()


@contextmanager
def host_agent(tmp_path, *agent_args: str):
    """A controller, one agent `h0` started by hand with `agent_args`, and a job running on it."""
    cluster = LocalCluster(str(tmp_path), 0, 1, heartbeat_s=0.5, missed_beats=4, network="host")
    try:
        cluster.start()
        argv = [sys.executable, "-m", "stalwart.cli", "agent", "--controller", cluster.url, "--machine-id", "h0",
                "--token-file", cluster.token_file, "--workdir", str(tmp_path / "h0"), "--heartbeat", "0.5",
                *agent_args]
        os.makedirs(tmp_path / "logs", exist_ok=True)
        with open(tmp_path / "logs" / "agent-h0.log", "ab") as log:
            cluster.agents["h0"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                                    preexec_fn=die_with_parent)
        cluster.wait_registered(60)
        client = cluster.client()
        job = client.post("/api/jobs", {"spec": gpt_spec(machines=1, gpus=1, command=SLEEPER)})["job"]
        store = Store(f"sqlite:///{tmp_path}/stalwart.db")
        try:
            assert wait_for(lambda: store.events(job, ["workers_started"]), timeout=60), "the job did not start"
        finally:
            store.close()
        yield client, job
    finally:
        cluster.stop()


@pytest.mark.root
@pytest.mark.timeout(120)
def test_taking_a_watched_interface_down_raises_a_nic_alert_within_2s(tmp_path, veth):
    with host_agent(tmp_path, "--nic", veth) as (client, job):
        assert health(tmp_path, job, "nic_down") == []
        t0 = time.time()
        assert ip("link", "set", veth, "down").returncode == 0
        assert wait_for(lambda: health(tmp_path, job, "nic_down"), timeout=20, every=0.1), \
            "no nic_down alert reached the controller"
        seen = time.time() - t0
        alert = health(tmp_path, job, "nic_down")[0]
    assert alert["machine"] == "h0" and alert["severity"] == "warn"
    assert alert["t"] - t0 < 2.0, f"the agent saw it {alert['t'] - t0:.2f} s after `ip link set down`"
    print(f"nic_down seen by the agent {alert['t'] - t0:.2f} s after the link went down, "
          f"recorded by the controller within {seen:.2f} s")


def _kmsg_writable() -> str | None:
    if os.geteuid() != 0:
        return "writing to /dev/kmsg needs root"
    if not os.access("/dev/kmsg", os.W_OK | os.R_OK):
        return "/dev/kmsg is not readable and writable here"
    return None


@pytest.mark.root
@pytest.mark.timeout(120)
@pytest.mark.skipif(_kmsg_writable() is not None, reason=str(_kmsg_writable()))
def test_an_xid_line_in_dev_kmsg_raises_a_gpu_alert(tmp_path):
    with host_agent(tmp_path, "--nic", "lo") as (client, job):
        bus = uuid.uuid4().hex[:2]
        line = (f"<3>NVRM: Xid (PCI:0000:{bus}:00): 79, pid={os.getpid()}, name=stalwart-test, "
                f"GPU has fallen off the bus.\n")
        t0 = time.time()
        with open("/dev/kmsg", "w") as f:
            f.write(line)
        assert wait_for(lambda: health(tmp_path, job, "gpu_xid"), timeout=20, every=0.1), \
            "no gpu_xid alert reached the controller"
        seen = time.time() - t0
        alert = health(tmp_path, job, "gpu_xid")[0]
        assert wait_for(lambda: client.get(f"/api/jobs/{job}")["incidents"], timeout=20)
        inc = client.get(f"/api/jobs/{job}")["incidents"][0]
    assert alert["machine"] == "h0" and alert["severity"] == "fatal"
    assert inc["symptom"] == "gpu_xid" and inc["category"] != "implicit"
    print(f"gpu_xid recorded {seen:.2f} s after the line was written to /dev/kmsg")
