"""Mutual TLS: a client certificate signed by the controller's --tls-client-ca is a credential
of one scope (a machine's agent, an operator, a reader), checked as the matching token is; a
certificate from another CA, or none where one is required, gets no TLS connection at all.

The certificates are made with the openssl commands docs/security.md gives (EC keys: fast)."""
from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.request

import pytest
from jobrun import wait_for
from liveapi import channel_refuses_other_machine, live_api, status_of

from stalwart.agent.workers import kill_tree
from stalwart.security import auth
from stalwart.transport.client import ApiError, Client, ControllerUnreachable

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="openssl's CLI is needed to make the certificates")

TOKEN = "operator-test-token"
TRUST = "spiffe://stalwart.test"
REG = {"address": "127.0.0.1", "gpus": 1}
SPEC = {"name": "m", "machines": 1, "gpus_per_machine": 1, "steps": 5, "command": ["python", "-c", "pass"]}
CLI = [sys.executable, "-m", "stalwart.cli"]


def _openssl(d, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


def _ca(d, name: str) -> None:
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}")


def _leaf(d, name: str, ca: str, cn: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """name -> (cert, key) paths; "ca" is the controller's client CA (and its server cert's)."""
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue")
    _leaf(d, "srv", "ca", "127.0.0.1", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    client = "extendedKeyUsage=clientAuth"
    _leaf(d, "m1", "ca", "m1", f"subjectAltName=URI:{TRUST}/machine/m1\n{client}")
    _leaf(d, "m2", "ca", "stalwart:machine:m2", client)                    # named by its CN
    _leaf(d, "operator", "ca", "alice", f"subjectAltName=URI:{TRUST}/operator\n{client}")
    _leaf(d, "reader", "ca", "prometheus", f"subjectAltName=URI:{TRUST}/reader\n{client}")
    _leaf(d, "host", "ca", "host.example", f"subjectAltName=DNS:host.example\n{client}")  # names nobody
    _leaf(d, "rogue-m1", "rogue", "m1", f"subjectAltName=URI:{TRUST}/machine/m1\n{client}")
    return {n: (str(d / f"{n}.pem"), str(d / f"{n}.key")) for n in
            ("ca", "srv", "m1", "m2", "operator", "reader", "host", "rogue-m1")}


def _serve(tmp_path, pki, require: bool = False):
    tls = auth.server_tls(*pki["srv"], client_ca=pki["ca"][0], require_client_cert=require)
    return live_api(tmp_path, tmp_path, TOKEN, tls=tls)


def _client(url: str, pki, who: str | None, token: str = "") -> Client:
    cert, key = pki[who] if who else (None, None)
    return Client(url, timeout=10, token=token, ca=pki["ca"][0], cert=cert, key=key)


@pytest.mark.timeout(60)
def test_a_machine_certificate_speaks_for_its_machine_alone(tmp_path, pki):
    with _serve(tmp_path, pki) as (ctl, url):
        m1 = _client(url, pki, "m1")
        assert m1.post("/api/agents/m1/register", REG)["ok"]
        assert m1.post("/api/agents/m1/heartbeat", {}).get("ok")
        assert "m1" in ctl.verified                     # a verified identity: drain/cordon may act on it
        for path, body in (("/api/agents/m2/register", REG), ("/api/agents/m2/heartbeat", {}),
                           ("/api/agents/m2/enroll", {})):
            assert status_of(m1, "POST", path, body) == 403
        assert status_of(m1, "GET", "/api/machines") == 403         # nor an operator's or a reader's
        assert status_of(m1, "POST", "/api/jobs", {"spec": SPEC}) == 403
        # a CN names a machine too; a certificate naming nobody needs a token
        assert _client(url, pki, "m2").post("/api/agents/m2/register", REG)["ok"]
        with pytest.raises(ApiError, match="names no stalwart identity") as e:
            _client(url, pki, "host").post("/api/agents/m1/register", REG)
        assert e.value.status == 401
        # a token, when sent, is what is checked
        assert status_of(_client(url, pki, "m1", token="wrong"), "POST", "/api/agents/m1/heartbeat", {}) == 401
        assert _client(url, pki, "host", token=TOKEN).get("/api/machines")["machines"]
        # no certificate: tokens work as without mutual TLS
        assert _client(url, pki, None, token=TOKEN).get("/api/machines")["machines"]
        assert status_of(_client(url, pki, None), "GET", "/api/machines") == 401
        assert {m["id"] for m in ctl.machines()} == {"m1", "m2"}


@pytest.mark.timeout(60)
def test_the_channel_takes_a_machine_certificate_for_its_machine_only(tmp_path, pki):
    with _serve(tmp_path, pki) as (ctl, url):
        ctx = auth.client_tls(pki["ca"][0], *pki["m1"])
        refused, answer = channel_refuses_other_machine(url, "m1", "m2", REG, ssl=ctx)
        assert refused == 403 and answer["type"] == "registered"
        assert "m1" in ctl.verified and "m2" not in ctl.verified


@pytest.mark.timeout(60)
def test_an_operator_certificate_submits_and_cancels_a_reader_certificate_only_reads(tmp_path, pki):
    with _serve(tmp_path, pki) as (ctl, url):
        op, reader = _client(url, pki, "operator"), _client(url, pki, "reader")
        job = op.post("/api/jobs", {"spec": SPEC})["job"]
        assert reader.get(f"/api/jobs/{job}")["job_id"] == job
        assert isinstance(reader.get("/api/machines")["machines"], list)
        assert status_of(reader, "POST", "/api/jobs", {"spec": SPEC}) == 403
        assert status_of(reader, "POST", f"/api/jobs/{job}/cancel", {"reason": "no"}) == 403
        assert status_of(reader, "POST", "/api/join-tokens", {}) == 403
        assert status_of(reader, "POST", "/api/agents/m1/register", REG) == 403
        assert op.post(f"/api/jobs/{job}/cancel", {"reason": "operator's certificate"})["ok"]
        assert wait_for(lambda: reader.get(f"/api/jobs/{job}")["state"] == "cancelled", timeout=20)
        assert ctl.store.latest_job()["id"] == job                        # the reader made none


@pytest.mark.timeout(60)
def test_a_certificate_from_another_ca_gets_no_connection(tmp_path, pki):
    with _serve(tmp_path, pki) as (ctl, url):
        with pytest.raises(ControllerUnreachable):
            _client(url, pki, "rogue-m1").post("/api/agents/m1/register", REG)
        with pytest.raises(ControllerUnreachable):       # not with the operator's token either
            _client(url, pki, "rogue-m1", token=TOKEN).get("/api/machines")
        assert ctl.machines() == [] and "m1" not in ctl.verified


@pytest.mark.timeout(60)
def test_a_controller_that_requires_certificates_refuses_the_handshake_without_one(tmp_path, pki):
    with _serve(tmp_path, pki, require=True) as (ctl, url):
        for token in ("", TOKEN):
            with pytest.raises(ControllerUnreachable):
                _client(url, pki, None, token=token).get("/api/health")
        assert _client(url, pki, "m1").post("/api/agents/m1/register", REG)["ok"]
        assert _client(url, pki, "reader").get("/api/health")["ok"]
        # a raw TLS handshake without a certificate: the controller closes it with an alert
        ctx = auth.client_tls(pki["ca"][0])
        with pytest.raises((ssl.SSLError, ConnectionError)):
            host, port = url.removeprefix("https://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as raw, \
                    ctx.wrap_socket(raw, server_hostname=host) as s:
                s.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n")
                if not s.recv(1024):
                    raise ConnectionError("closed")


@pytest.mark.timeout(90)
def test_an_agent_and_the_cli_with_certificates_and_no_token(tmp_path, pki):
    """`stalwart agent --tls-cert/--tls-key` registers and beats over its channel with no token;
    the CLI takes its certificate (a reader's here) from $STALWART_TLS_CERT/KEY."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
    with _serve(tmp_path, pki) as (ctl, url):
        cert, key = pki["m1"]
        agent = subprocess.Popen(CLI + ["agent", "--controller", url, "--machine-id", "m1", "--workdir",
                                        str(tmp_path / "m1"), "--heartbeat", "0.3", "--tls-ca", pki["ca"][0],
                                        "--tls-cert", cert, "--tls-key", key, "--kmsg", "off"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            def alive() -> bool:
                return any(m["id"] == "m1" and m.get("alive") for m in ctl.machines())
            assert wait_for(alive, timeout=60), "the agent did not register with its certificate"
            assert "m1" in ctl.verified
            beat = ctl.machines()[0]["last_beat"]
            assert wait_for(lambda: ctl.machines()[0]["last_beat"] != beat, timeout=10), "no heartbeat"
            assert agent.poll() is None and not (tmp_path / "m1" / "machine.credential").exists()
            # its beats came over its channel; Prometheus scrapes with a reader's certificate
            scrape = auth.client_tls(pki["ca"][0], *pki["reader"])
            with urllib.request.urlopen(url + "/metrics", timeout=10, context=scrape) as r:
                assert 'route="agent_channel_beat"' in r.read().decode()
            cli_env = dict(env, STALWART_TLS_CERT=pki["reader"][0], STALWART_TLS_KEY=pki["reader"][1])
            out = subprocess.run(CLI + ["machines", "--controller", url, "--tls-ca", pki["ca"][0],
                                        "--state-dir", str(tmp_path / "none")],
                                 capture_output=True, text=True, timeout=60, env=cli_env)
            assert out.returncode == 0 and "m1" in out.stdout, out.stderr
        finally:
            kill_tree(agent.pid)
            agent.wait(10)


def _crl(d, out: str, revoke: str | None = None) -> None:
    """The CA's revocation list at `out` (written whole, then renamed in), `revoke` added first."""
    if not (d / "ca.cnf").exists():
        (d / "ca.cnf").write_text("[ca]\ndefault_ca=d\n[d]\ndatabase=index.txt\ncrlnumber=crlnumber\n"
                                  "default_md=sha256\ndefault_crl_days=1\n")
        (d / "index.txt").write_text("")
        (d / "crlnumber").write_text("01\n")
    ca = ("-config", "ca.cnf", "-keyfile", "ca.key", "-cert", "ca.pem")
    if revoke:
        _openssl(d, "ca", *ca, "-revoke", f"{revoke}.pem")
    _openssl(d, "ca", *ca, "-gencrl", "-out", "crl.tmp")
    os.replace(d / "crl.tmp", out)


@pytest.mark.timeout(60)
def test_a_revoked_certificate_gets_no_connection_once_the_list_names_it_without_a_restart(tmp_path, pki):
    d = tmp_path / "ca"
    d.mkdir()
    for f in ("ca.pem", "ca.key", "m1.pem", "m2.pem"):
        shutil.copy(os.path.join(os.path.dirname(pki["ca"][0]), f), d / f)
    crl = tmp_path / "crl.pem"
    _crl(d, str(crl))
    tls = auth.ServerTls(*pki["srv"], client_ca=pki["ca"][0], crl=str(crl))
    with live_api(tmp_path, tmp_path, TOKEN, tls=tls.context) as (ctl, url):
        assert _client(url, pki, "m2").post("/api/agents/m2/register", REG)["ok"]
        _crl(d, str(crl), revoke="m2")
        with pytest.raises(ControllerUnreachable):
            _client(url, pki, "m2").post("/api/agents/m2/heartbeat", {})
        assert tls.reloads == 1
        assert _client(url, pki, "m1").post("/api/agents/m1/register", REG)["ok"]
        # a list that does not load (half-written, wrong) keeps the last good one
        crl.write_text("not a revocation list\n")
        assert _client(url, pki, "m1").post("/api/agents/m1/heartbeat", {}).get("ok")
        assert tls.failed and "revocation list" in tls.failed
        with pytest.raises(ControllerUnreachable):
            _client(url, pki, "m2").post("/api/agents/m2/heartbeat", {})


def test_a_revocation_list_without_a_client_ca_is_refused_with_the_reason(pki):
    with pytest.raises(auth.AuthConfigError, match="--tls-client-ca"):
        auth.server_tls(*pki["srv"], crl=pki["ca"][0])
