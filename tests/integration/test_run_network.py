"""`stalwart run` and the network: by default the workers use the host's network, as without
stalwart (run as root, as in a container, they still reach a service on the host's loopback and
resolve names); `--isolate-network` (root) gives each machine a namespace of its own, which a
service on the host's loopback is out of reach from; a network fault on the host's network is
refused, by the controller for `stalwart inject`."""
from __future__ import annotations

import os
import shutil
import signal
import socketserver
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.geteuid() == 0
ISOLATABLE = ROOT and shutil.which("ip") is not None

# Rank 0 asks a TCP service on the host's 127.0.0.1 for a word and resolves `localhost`, then waits
# (bounded) for the test's go-ahead file so the test can try an injection while it runs.
SCRIPT = """
import os, socket, sys, time
port, go = int(sys.argv[1]), sys.argv[2]
try:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        print("reached", s.recv(64).decode().strip(), flush=True)
except OSError as e:
    print("unreachable", type(e).__name__, flush=True)
print("resolved", socket.getaddrinfo("localhost", port)[0][4][0], flush=True)
open(go + ".running", "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.1)
"""


class _Word(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"host-service\n")


@pytest.fixture
def service():
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Word)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


def _cli(*args: str, cwd, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stalwart.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _run(tmp_path, port: int, *extra: str, while_running=None) -> str:
    """`stalwart run` the script on one machine; `while_running(state_dir)` once it waits; its output."""
    script = tmp_path / "net.py"
    script.write_text(SCRIPT)
    go, state = tmp_path / "go", tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "stalwart.cli", "run", "--state-dir", str(state), "--fresh",
                             "--machines", "1", "--gpus-per-machine", "1", *extra, "--",
                             sys.executable, str(script), str(port), str(go)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(str(go) + ".running"):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the script did not start"
            time.sleep(0.1)
        if while_running is not None:
            while_running(state)
        go.touch()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
        return out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)     # `stalwart run` stops what it started on Ctrl-C
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _cli("cleanup", "--state-dir", str(tmp_path / "state"), cwd=tmp_path)


@pytest.mark.timeout(300)
def test_workers_use_the_host_s_network_and_network_faults_are_refused_there(tmp_path, service):
    refused: list[subprocess.CompletedProcess] = []

    def inject(state) -> None:
        refused.append(_cli("inject", "nic-down", "--machine", "0", "--state-dir", str(state), cwd=tmp_path))

    out = _run(tmp_path, service, while_running=inject)
    assert "[rank0]:reached host-service" in out, out[-3000:]
    assert "[rank0]:resolved 127.0.0.1" in out or "[rank0]:resolved ::1" in out, out[-3000:]
    got = refused[0]
    assert got.returncode != 0, got.stdout
    assert "chaos nic-down needs machines with their own network" in got.stderr, got.stderr
    assert "--isolate-network" in got.stderr and "Traceback" not in got.stderr


@pytest.mark.timeout(300)
@pytest.mark.skipif(not ISOLATABLE, reason="network namespaces need root and iproute2")
def test_isolated_machines_do_not_reach_the_host_s_loopback(tmp_path, service):
    out = _run(tmp_path, service, "--isolate-network")
    assert "[rank0]:unreachable" in out and "reached host-service" not in out, out[-3000:]
