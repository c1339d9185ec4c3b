"""The API needs the controller's token (401 otherwise, logged, nothing done),
bodies are bounded (413), and TLS works end to end: a controller on HTTPS with a certificate this
test makes, an agent that verifies it with --tls-ca and registers."""
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from jobrun import wait_for
from stalwart.agent.workers import kill_tree
from stalwart.transport.client import ApiError, Client, ControllerUnreachable

CLI = [sys.executable, "-m", "stalwart.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_controller(state, port: int, extra=()) -> subprocess.Popen:
    state.mkdir(exist_ok=True)
    log = open(state / "controller.log", "ab")
    try:
        return subprocess.Popen(CLI + ["controller", "--db", f"sqlite:///{state}/stalwart.db", "--listen",
                                       f"127.0.0.1:{port}", "--state-dir", str(state), "--port-file",
                                       str(state / "port"), "--log-level", "INFO", *extra],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def wait_listening(proc, state) -> None:
    assert wait_for(lambda: (state / "port").exists() or proc.poll() is not None, timeout=60)
    assert proc.poll() is None, (state / "controller.log").read_text()


def raw(url: str, method="GET", body: bytes | None = None, headers=None, context=None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.timeout(120)
def test_requests_without_the_right_token_are_refused_and_change_nothing(tmp_path):
    state, port = tmp_path / "state", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_controller(state, port)
    try:
        wait_listening(proc, state)
        token_file = state / "token"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = token_file.read_text().strip()
        spec = {"spec": {"machines": 1, "gpus_per_machine": 1, "steps": 1, "command": ["touch", "/tmp/x"]}}
        body = json.dumps(spec).encode()
        for headers, why in (({}, "no token"), ({"Authorization": "Bearer nope"}, "wrong token"),
                             ({"Authorization": f"Basic {token}"}, "not a bearer token")):
            code, out = raw(url + "/api/jobs", "POST", body, dict(headers, **{"Content-Type": "application/json"}))
            assert code == 401 and why in out["error"], (code, out)
            for path in ("/api/machines", "/api/jobs/latest", "/metrics", "/api/agents/m0/commands"):
                assert raw(url + path, headers=headers)[0] == 401, path
        # an agent without the token cannot register either
        assert raw(url + "/api/agents/m9/register", "POST", b'{"address": "x", "gpus": 1}')[0] == 401
        # nothing was done: no job, no machine
        good = Client(url, token=token)
        assert good.get("/api/machines")["machines"] == []
        with pytest.raises(ApiError) as e:
            good.get("/api/jobs/latest")
        assert e.value.status == 404
        # refusals are logged with the peer's address
        log = (state / "controller.log").read_text()
        assert "refused POST /api/jobs from 127.0.0.1: no token" in log
        assert "refused POST /api/jobs from 127.0.0.1: wrong token" in log
        # open: the liveness probe and the page shell (no data)
        assert raw(url + "/api/health")[0] == 200
        with urllib.request.urlopen(url + "/", timeout=10) as r:
            assert r.status == 200
        # a 10 MB body is refused from its header, before a byte of it is read
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(f"POST /api/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {10 << 20}\r\n\r\n".encode()
                      + b"x" * 65536)
            answer = s.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 413"), answer
        # the CLI finds the token in the state dir; a wrong --token-file is one clear line
        (state / "controller.json").write_text(json.dumps({"url": url}))
        ok = subprocess.run(CLI + ["machines", "--state-dir", str(state)], capture_output=True, text=True,
                            timeout=60, env=dict(os.environ, STALWART_TOKEN=""))
        assert ok.returncode == 0, ok.stderr
        (tmp_path / "bad").write_text("nope\n")
        bad = subprocess.run(CLI + ["machines", "--state-dir", str(state), "--token-file", str(tmp_path / "bad")],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "unauthorized (wrong token)" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr
        # an agent with no token anywhere says so and exits
        agent = subprocess.run(CLI + ["agent", "--controller", url, "--machine-id", "m0", "--workdir",
                                      str(tmp_path / "m0")], capture_output=True, text=True, timeout=60,
                               env={k: v for k, v in os.environ.items() if k != "STALWART_TOKEN"})
        assert agent.returncode == 2 and "needs a credential" in agent.stderr, agent.stderr
    finally:
        kill_tree(proc.pid)


def make_certs(d) -> tuple[str, str, str]:
    """A CA and a certificate for 127.0.0.1 signed by it (openssl's CLI)."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=stalwart-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "srv.pem", "-days", "1", "-extfile", "ext")
    return str(d / "ca.pem"), str(d / "srv.pem"), str(d / "srv.key")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl's CLI is needed to make the certificates")
@pytest.mark.timeout(120)
def test_tls_end_to_end_an_agent_verifies_the_controller_and_registers(tmp_path):
    ca, cert, key = make_certs(tmp_path)
    state, port = tmp_path / "state", free_port()
    url = f"https://127.0.0.1:{port}"
    (tmp_path / "token").write_text("tls-test-token\n")
    os.chmod(tmp_path / "token", 0o600)
    proc = start_controller(state, port, ["--tls-cert", cert, "--tls-key", key,
                                          "--token-file", str(tmp_path / "token"), "--heartbeat", "0.3"])
    procs = [proc]
    try:
        wait_listening(proc, state)
        assert not (state / "token").exists()          # --token-file given: no second token made
        procs.append(subprocess.Popen(CLI + ["agent", "--controller", url, "--machine-id", "m0", "--workdir",
                                             str(tmp_path / "m0"), "--heartbeat", "0.3", "--tls-ca", ca,
                                             "--token-file", str(tmp_path / "token")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        client = Client(url, timeout=5, token="tls-test-token", ca=ca)

        def alive():
            try:
                return {m["id"] for m in client.get("/api/machines")["machines"] if m.get("alive")}
            except ControllerUnreachable:
                return set()
        assert wait_for(lambda: alive() == {"m0"}, timeout=60), "the agent did not register over TLS"
        # without the CA the certificate is not trusted; plain HTTP gets no answer
        with pytest.raises(ControllerUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            Client(url, timeout=5, token="tls-test-token").get("/api/machines")
        with pytest.raises(ControllerUnreachable):
            Client(f"http://127.0.0.1:{port}", timeout=5, token="tls-test-token").get("/api/machines")
        # the token is still needed on TLS
        with pytest.raises(ApiError) as e:
            Client(url, timeout=5, token="wrong", ca=ca).get("/api/machines")
        assert e.value.status == 401
        assert procs[1].poll() is None and alive() == {"m0"}
    finally:
        for p in procs:
            kill_tree(p.pid)
