"""Bounds at the edge: every query parameter bounded (and in the OpenAPI document, so the fuzzer
tries it), machine ids of a documented ASCII set, numeric spec fields bounded, JSON nesting
bounded, request text escaped in logs, a submit sent twice with one key made once."""
from __future__ import annotations

import asyncio
import os
import json
import logging
import urllib.error
import urllib.request

import aiohttp
import pytest
from liveapi import live_api

from stalwart.transport.client import ApiError, Client

TOKEN = "bounds-test-token"
REG = {"address": "127.0.0.1", "gpus": 1}


@pytest.fixture
def api(tmp_path, monkeypatch):
    (tmp_path / "code").mkdir()
    monkeypatch.chdir(tmp_path / "code")
    with live_api(tmp_path, tmp_path / "state", TOKEN) as out:
        yield out


def _raw(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


SPEC = {"name": "b", "machines": 1, "gpus_per_machine": 1, "steps": 5, "command": ["python", "-c", "pass"]}


@pytest.mark.timeout(60)
def test_query_parameters_are_bounded_and_documented(api):
    _, url = api
    job = Client(url, token=TOKEN).post("/api/jobs", {"spec": SPEC})["job"]
    for q in ("points=1000000000", "points=0", "since=-1", "since=99999999999999999999999", "points=x"):
        code, out = _raw(f"{url}/api/jobs/{job}/series?{q}")
        assert code == 400, (q, out)
    assert _raw(f"{url}/api/jobs/{job}/series?points=50")[0] == 200
    for q in ("wait=1e9", "wait=-1", "wait=nan"):
        assert _raw(f"{url}/api/agents/m0/commands?{q}")[0] == 400, q
    doc = _raw(f"{url}/api/openapi.json")[1]
    params = {p["name"]: p["schema"] for p in doc["paths"]["/api/jobs/{job}/series"]["get"]["parameters"]}
    assert params["points"]["maximum"] == 2000 and params["since"]["minimum"] == 0
    wait = doc["paths"]["/api/agents/{machine}/commands"]["get"]["parameters"]
    assert any(p["name"] == "wait" and p["schema"]["maximum"] == 60 for p in wait)


@pytest.mark.timeout(60)
def test_a_machine_id_outside_the_ascii_set_is_refused_at_the_edge(api):
    ctl, url = api
    for machine in ("m1%C2%B2", "m%0A1", "..", "-m"):
        code, out = _raw(f"{url}/api/agents/{machine}/register", "POST", json.dumps(REG).encode())
        assert code in (400, 404) and "internal" not in json.dumps(out), (machine, code, out)
    assert _raw(f"{url}/api/agents/m1%C2%B2/register", "POST", json.dumps(REG).encode())[0] == 400

    async def channel():
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await s.ws_connect(url + "/api/agents/m1%C2%B2/channel", headers={"Authorization": f"Bearer {TOKEN}"})
            return e.value.status
    assert asyncio.run(asyncio.wait_for(channel(), 30)) == 400
    assert ctl.machines() == []
    # the views that order machines still answer
    assert _raw(f"{url}/api/machines")[0] == 200
    assert urllib.request.urlopen(urllib.request.Request(
        f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}), timeout=20).status == 200


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field,value", [("steps", 10**30), ("machines", 10**9), ("ckpt_every", 2**60),
                                         ("policy", {"heartbeat_s": 10**400}), ("policy", {"missed_beats": 10**20})])
def test_numeric_spec_fields_are_bounded(api, field, value):
    _, url = api
    with pytest.raises(ApiError) as e:
        Client(url, token=TOKEN).post("/api/jobs", {"spec": dict(SPEC, **{field: value})})
    assert e.value.status == 400 and field.split(".")[0] in str(e.value)


@pytest.mark.timeout(60)
def test_deeply_nested_json_on_an_agent_route_is_a_400(api):
    _, url = api
    deep = b'{"events": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    code, out = _raw(f"{url}/api/agents/m0/events", "POST", deep)
    assert code == 400 and "nested" in out["error"]
    code, out = _raw(f"{url}/api/jobs", "POST", b'{"spec": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert code == 400


@pytest.mark.timeout(60)
def test_request_text_cannot_forge_a_log_line(api, caplog):
    _, url = api
    caplog.set_level(logging.WARNING, logger="stalwart.api")
    req = urllib.request.Request(f"{url}/api/jobs/1%0AFORGED%20line")       # no token: refused and logged
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(req, timeout=20)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines and all("\n" not in m for m in lines), lines


@pytest.mark.timeout(60)
def test_a_submit_sent_again_with_its_key_makes_one_job(api):
    ctl, url = api
    client = Client(url, token=TOKEN)
    body = {"spec": SPEC, "idempotency_key": "retry-key-0001"}
    first, again = client.post("/api/jobs", body), client.post("/api/jobs", body)
    assert first["job"] == again["job"] and again.get("repeated")
    assert client.post("/api/jobs", dict(body, idempotency_key="retry-key-0002"))["job"] != first["job"]


# -- hot update: what a code version may take -------------------------------------------------------

def _code(tmp_path, name="code"):
    d = tmp_path / name
    d.mkdir()
    (d / "train.py").write_text("print('hi')\n")
    return d


@pytest.mark.timeout(30)
def test_a_code_version_keeps_permissions_and_refuses_links_out_of_its_tree(tmp_path):
    import os
    import stat

    from stalwart.controller.code import tree as snapshot
    code = _code(tmp_path)
    (code / "secret.cfg").write_text("k=v\n")
    os.chmod(code / "secret.cfg", 0o600)
    os.symlink("train.py", code / "inside.py")
    _, path, _ = snapshot.snapshot(str(code), str(tmp_path / "state"))
    assert stat.S_IMODE(os.stat(os.path.join(path, "secret.cfg")).st_mode) == 0o400      # never widened
    assert os.readlink(os.path.join(path, "inside.py")) == "train.py"
    for target in ("/etc/passwd", "../outside.py"):
        link = code / "link.py"
        os.symlink(target, link)
        with pytest.raises(ValueError, match="outside the code directory"):
            snapshot.snapshot(str(code), str(tmp_path / "state"))
        assert "outside it" in (snapshot.versionable(str(code), str(tmp_path / "state")) or "")   # hot update off
        link.unlink()


@pytest.mark.timeout(30)
def test_a_code_version_is_bounded_in_files_and_bytes(tmp_path, monkeypatch):
    from stalwart.controller.code import tree as snapshot
    code = _code(tmp_path)
    (code / "data.bin").write_bytes(b"x" * 4096)
    monkeypatch.setattr(snapshot, "MAX_BYTES", 1024)
    with pytest.raises(ValueError, match="more than"):
        snapshot.snapshot(str(code), str(tmp_path / "state"))
    monkeypatch.setattr(snapshot, "MAX_BYTES", 1 << 20)
    monkeypatch.setattr(snapshot, "MAX_FILES", 1)
    with pytest.raises(ValueError, match="files"):
        snapshot.snapshot(str(code), str(tmp_path / "state"))
    assert not [n for n in os.listdir(tmp_path / "state" / "versions") if not n.startswith(".")]


@pytest.mark.timeout(30)
def test_old_code_versions_are_collected(tmp_path):
    import time

    from stalwart.controller.store.db import Store
    from stalwart.controller.code.versions import Versions
    store = Store(f"sqlite:///{tmp_path}/v.db")
    versions = Versions(store)
    job = store.create_job("j", {}, time.time(), submitted=True)
    code, state = _code(tmp_path), str(tmp_path / "state")
    first = versions.register(job, str(code), state, "lazy", None, time.time())
    (code / "train.py").write_text("print('v2')\n")
    second = versions.register(job, str(code), state, "lazy", None, time.time())
    versions.apply(second["id"], time.time(), 10)
    versions.mark(second["id"], "stable", "healthy", time.time())
    (code / "train.py").write_text("print('v3')\n")
    third = versions.register(job, str(code), state, "urgent", None, time.time())
    versions.apply(third["id"], time.time(), 20)
    versions.collect(state)
    assert not os.path.exists(first["path"])          # superseded long ago: gone
    assert os.path.isdir(second["path"]) and os.path.isdir(third["path"])   # last stable, running


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sent", [b"", b"POST /api/jobs HTTP/1.1\r\nHost: x\r\nX-Slow: "], ids=["silent", "slow-head"])
def test_a_connection_without_a_complete_request_head_is_closed(api, monkeypatch, sent):
    import socket
    import time

    from stalwart.controller.api import channel
    _, url = api
    monkeypatch.setattr(channel, "HEAD_TIMEOUT_S", 0.5)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(sent)
        t0 = time.monotonic()
        assert s.recv(100) == b""                       # closed by the controller, no answer
        assert time.monotonic() - t0 < 5
    assert Client(url, token=TOKEN).get("/api/health") == {"ok": True}


@pytest.mark.timeout(30)
def test_a_silent_channel_is_closed(api, monkeypatch):
    from stalwart.controller.api import channel
    _, url = api
    monkeypatch.setattr(channel, "CHANNEL_IDLE_S", 0.5)

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(url + "/api/agents/m0/channel",
                                    headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
                msg = await ws.receive(timeout=10)          # says nothing: the controller closes it
                return msg.type, ws.close_code
    kind, code = asyncio.run(asyncio.wait_for(main(), 20))
    assert kind in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) and code == 1001
