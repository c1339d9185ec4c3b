"""One identity per machine, scoped credentials: an agent's credential speaks for its machine
alone (HTTP routes and channel), a join token enrolls once, a reader token only reads, and a
machine that did not prove its identity is never drained or cordoned by the controller."""
from __future__ import annotations

import argparse
import json
import os
import urllib.request

import pytest
from liveapi import channel_refuses_other_machine, live_api, status_of

from stalwart.security import identity
from stalwart.transport.client import ApiError, Client

TOKEN = "operator-test-token"
REG = {"address": "127.0.0.1", "gpus": 1}


@pytest.fixture
def api(tmp_path):
    with live_api(tmp_path, tmp_path, TOKEN) as out:
        yield out


def _enroll(url: str, machine: str, join: str) -> str:
    return Client(url, token=join).post(f"/api/agents/{machine}/enroll", {})["credential"]


@pytest.mark.timeout(60)
def test_an_agent_speaking_for_another_machine_is_refused(api):
    ctl, url = api
    op = Client(url, token=TOKEN)
    cred = _enroll(url, "m1", op.post("/api/join-tokens", {"machine": "m1"})["token"])
    m1 = Client(url, token=cred)
    assert m1.post("/api/agents/m1/register", REG)["ok"]
    assert "m1" in ctl.verified
    for path, body in (("/api/agents/m2/register", REG), ("/api/agents/m2/heartbeat", {}),
                       ("/api/agents/m2/events", {"events": []})):
        assert status_of(m1, "POST", path, body) == 403
    assert status_of(m1, "GET", "/api/agents/m2/commands") == 403
    assert "m2" not in {m["id"] for m in op.get("/api/machines")["machines"]}
    # nor is a machine's credential an operator's or a reader's
    assert status_of(m1, "GET", "/api/machines") == 403
    assert status_of(m1, "POST", "/api/jobs", {"spec": {}}) == 403
    # a forged credential (the machine id changed, the MAC kept) proves nothing
    forged = "sm1." + identity._b64("m2") + "." + cred.rsplit(".", 1)[1]
    assert status_of(Client(url, token=forged), "POST", "/api/agents/m2/register", REG) == 401


@pytest.mark.timeout(60)
def test_the_channel_refuses_another_machines_credential(api):
    ctl, url = api
    cred = _enroll(url, "m1", Client(url, token=TOKEN).post("/api/join-tokens", {"machine": "m1"})["token"])

    refused, answer = channel_refuses_other_machine(url, "m1", "m2", REG,
                                                    headers={"Authorization": f"Bearer {cred}"})
    assert refused == 403 and answer["type"] == "registered"
    assert "m1" in ctl.verified and "m2" not in ctl.verified


@pytest.mark.timeout(60)
def test_a_join_token_enrolls_once_and_never_takes_over_an_enrolled_machine(api):
    ctl, url = api
    op = Client(url, token=TOKEN)
    any_join = op.post("/api/join-tokens", {})["token"]
    _enroll(url, "m5", any_join)
    with pytest.raises(ApiError) as e:                  # used once already
        _enroll(url, "m6", any_join)
    assert e.value.status == 409
    other = op.post("/api/join-tokens", {})["token"]
    with pytest.raises(ApiError) as e:                  # m5 is enrolled: a token for any id cannot take it
        _enroll(url, "m5", other)
    assert e.value.status == 409
    bound = op.post("/api/join-tokens", {"machine": "m7"})["token"]
    with pytest.raises(ApiError) as e:
        _enroll(url, "m8", bound)
    assert e.value.status == 403
    # a join token is good for nothing else
    assert status_of(Client(url, token=other), "POST", "/api/agents/m9/register", REG) == 403
    assert status_of(Client(url, token=other), "GET", "/api/machines") == 403
    expired = identity.join_token(ctl.secret, "m9", ttl_s=-1)
    assert status_of(Client(url, token=expired), "POST", "/api/agents/m9/enroll", {}) == 401


@pytest.mark.timeout(60)
def test_the_reader_token_only_reads(api):
    ctl, url = api
    reader = Client(url, token=identity.reader_token(ctl.secret))
    assert isinstance(reader.get("/api/machines")["machines"], list)
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {reader.token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and b"stalwart" in r.read()
    assert status_of(reader, "POST", "/api/jobs", {"spec": {}}) == 403
    assert status_of(reader, "POST", "/api/join-tokens", {}) == 403
    assert status_of(reader, "POST", "/api/agents/m1/register", REG) == 403
    assert status_of(reader, "GET", "/api/agents/m1/commands") == 403


@pytest.mark.timeout(60)
def test_only_a_verified_machine_is_drained(api):
    ctl, url = api
    asked: list[str] = []

    class Backend:
        def evict(self, machine, reason, labels):
            asked.append(machine)
    ctl.supply.backend = Backend()
    op = Client(url, token=TOKEN)
    op.post("/api/agents/fake/register", dict(REG, labels={"kubernetes.node": "node-a"}))   # operator's token
    cred = _enroll(url, "real", op.post("/api/join-tokens", {"machine": "real"})["token"])
    Client(url, token=cred).post("/api/agents/real/register", REG)
    ctl.supply.evict("fake", "test", None)
    ctl.supply.evict("real", "test", None)
    assert asked == ["real"]


@pytest.mark.timeout(60)
def test_no_operator_token_reaches_an_agent_pod_nor_a_worker(tmp_path, monkeypatch):
    from stalwart.backends.k8s_manifests import render
    from stalwart.backends.kubernetes import K8sConfig
    spec = {"name": "llm", "machines": 2, "gpus_per_machine": 1, "steps": 10, "command": ["python", "train.py"]}
    objs = render(spec, K8sConfig(tag="sec", namespace="training"), token="operator-token-" + "x" * 32)
    secret = next(o for o in objs if o["kind"] == "Secret")["stringData"]["secret"].encode()
    pods = [o for o in objs if o["kind"] == "Pod"]
    assert len(pods) >= 2
    for pod in pods:
        machine = pod["metadata"]["labels"]["stalwart.io/machine"]
        env = {e["name"]: e for c in pod["spec"]["containers"] for e in c.get("env", [])}
        assert "STALWART_TOKEN" not in env and "secretKeyRef" not in json.dumps(env)
        ident, _ = identity.identify(env["STALWART_JOIN_TOKEN"]["value"], None, secret)
        assert ident is not None and ident.scope is identity.Scope.JOIN and ident.machine == machine
    # the agent drops what credentials its own environment had before it starts anything
    from stalwart.cli import services
    monkeypatch.setenv("STALWART_TOKEN", "operator")
    monkeypatch.setenv("STALWART_JOIN_TOKEN", "join")
    monkeypatch.setenv("STALWART_TLS_CERT", "m0.pem")
    monkeypatch.setenv("STALWART_TLS_KEY", "m0.key")
    started = {}

    class Stop(Exception):
        pass

    def fake_agent(*args, **kw):
        started.update(os.environ)
        raise Stop
    monkeypatch.setattr("stalwart.agent.daemon.Agent", fake_agent)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / services.CREDENTIAL_FILE).write_text("sm1.x.y\n")
    args = argparse.Namespace(log_level="WARNING", workdir=str(tmp_path / "w"), machine_id="m0", join_token_file=None,
                              token_file=None, controller="http://127.0.0.1:9", tls_ca=None, tls_cert=None,
                              tls_key=None, address="127.0.0.1",
                              gpus=1, heartbeat=1.0, network_file=None, kmsg=None, controller_file=None, label=[],
                              nic=[], shared_host=True)
    with pytest.raises(Stop):
        services.cmd_agent(args)
    assert "STALWART_TOKEN" not in started and "STALWART_JOIN_TOKEN" not in started and started
    assert "STALWART_TLS_CERT" not in started and "STALWART_TLS_KEY" not in started


@pytest.mark.timeout(30)
def test_a_slurm_agent_enrolls_with_a_token_for_its_machine(tmp_path):
    from stalwart.security import auth
    from stalwart.backends.slurm import SlurmConfig
    from stalwart.backends.slurm_agent import agent_argv, join_token_file
    secret = auth.controller_secret(str(tmp_path))
    cfg = SlurmConfig(state_dir=str(tmp_path), tag="t", token_file=str(tmp_path / "token"))
    path = join_token_file(cfg, "m3", str(tmp_path / "w"))
    assert path is not None and oct(os.stat(path).st_mode & 0o777) == "0o600"
    ident, _ = identity.identify(open(path).read().strip(), None, secret)
    assert ident is not None and ident.scope is identity.Scope.JOIN and ident.machine == "m3"
    argv = agent_argv(cfg, 3, {"SLURMD_NODENAME": "localhost", "SLURM_NODEID": "0"}, path)
    assert "--join-token-file" in argv and "--token-file" not in argv
