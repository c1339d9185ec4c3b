"""Issue 2: an agent reconnects when its controller restarts (same address)."""
import socket
import subprocess
import sys

import pytest

from jobrun import wait_for
from stalwart.agent.workers import kill_tree
from stalwart.client import Client, ControllerUnreachable


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def controller(tmp_path, port):
    return subprocess.Popen([sys.executable, "-m", "stalwart.cli", "controller", "--db",
                             f"sqlite:///{tmp_path}/stalwart.db", "--listen", f"127.0.0.1:{port}",
                             "--state-dir", str(tmp_path), "--heartbeat", "0.3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def alive_machines(client):
    try:
        return {m["id"] for m in client.get("/api/machines")["machines"] if m.get("alive")}
    except ControllerUnreachable:
        return set()


@pytest.mark.timeout(120)
def test_agent_reregisters_after_controller_restart(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [controller(tmp_path, port)]
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "stalwart.cli", "agent", "--controller", url,
                                       "--machine-id", "m0", "--workdir", str(tmp_path / "m0"),
                                       "--heartbeat", "0.3"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        client = Client(url, timeout=2)
        assert wait_for(lambda: alive_machines(client) == {"m0"})
        kill_tree(procs[0].pid)
        procs[0].wait(timeout=10)
        assert not alive_machines(client)
        procs[0] = controller(tmp_path, port)          # same address, same store
        assert wait_for(lambda: alive_machines(client) == {"m0"}), "agent did not come back"
        assert procs[1].poll() is None                 # the agent never died
    finally:
        for p in procs:
            kill_tree(p.pid)
