"""Typed request bodies (unknown fields and wrong types refused with the field's
name), bounded sizes, a handler bug is a 500, and the OpenAPI document describes every route.
A real controller and API server in this process, spoken to over a real socket."""
import json
import urllib.error
import urllib.request

import pytest
from liveapi import live_api

from stalwart.controller.api.models import MAX_EVENTS, ROUTES

TOKEN = "validation-test-token"


@pytest.fixture
def api(tmp_path):
    with live_api(tmp_path, tmp_path, TOKEN) as out:
        yield out


def call(url: str, method="GET", body=None, token=TOKEN) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


SPEC = {"machines": 1, "gpus_per_machine": 1, "steps": 1, "command": ["python", "-c", "pass"]}


@pytest.mark.timeout(60)
def test_unknown_fields_and_wrong_types_are_refused_with_their_names(api):
    ctl, url = api
    cases = [
        ("POST", "/api/jobs", {"spec": SPEC, "priority": 3}, "priority"),
        ("POST", "/api/jobs", {"spec": dict(SPEC, stepz=5)}, "stepz"),
        ("POST", "/api/jobs", {"spec": dict(SPEC, policy={"heartbeat": 1})}, "heartbeat"),
        ("POST", "/api/jobs", {"spec": [1, 2]}, "spec"),
        ("POST", "/api/jobs", {}, "spec"),
        ("POST", "/api/jobs/1/inject", {"chaos": "crash@machine=0", "when": 1}, "when"),
        ("POST", "/api/jobs/1/inject", {"chaos": 7}, "chaos"),
        ("POST", "/api/jobs/1/versions", {"code": "/x", "window_s": "soon"}, "window_s"),
        ("POST", "/api/jobs/1/versions", {"code": "/x", "mode": "now"}, "mode"),
        ("POST", "/api/jobs/1/cancel", {"reason": "x" * 1001}, "reason"),
        ("POST", "/api/agents/m0/events", {"events": [{}] * (MAX_EVENTS + 1)}, "events"),
        ("POST", "/api/agents/m0/register", {"address": "a", "gpus": "eight"}, "gpus"),
    ]
    for method, path, body, field in cases:
        code, out = call(url + path, method, body)
        assert code == 400 and field in out["error"], (path, body if len(str(body)) < 200 else "...", code, out)
    for raw in (b"{not json", b"[1, 2]", b'"text"'):
        code, out = call(url + "/api/jobs", "POST", raw)
        assert code == 400 and "invalid request body" in out["error"], (raw, out)
    assert ctl.store.latest_job() is None                    # nothing was submitted
    # an agent's registration ignores fields it does not know (a newer agent, a rolling upgrade)
    code, out = call(url + "/api/agents/m0/register", "POST", {"address": "127.0.0.1", "gpus": 1, "nic": "x"})
    assert code == 200 and out["ok"], out
    # a re-registration names its ranks, steps and checkpoint slots: maps keyed by rank (strings in JSON)
    code, out = call(url + "/api/agents/m0/register", "POST", {
        "address": "127.0.0.1", "gpus": 2, "running_run": 1, "job": 1, "ranks": {"0": 100, "1": 101},
        "last_step": {"0": 30, "1": 30}, "inventory": {"own": {"0": [29, 30]}}, "peer": ["127.0.0.1", 9000]})
    assert code == 200 and out["ok"], out


@pytest.mark.timeout(60)
def test_a_handler_bug_is_a_500_not_the_clients_fault(api, monkeypatch):
    ctl, url = api

    def broken():
        raise KeyError("machine_state")
    monkeypatch.setattr(ctl, "machines", broken)
    code, out = call(url + "/api/machines")
    assert code == 500 and "internal error" in out["error"], out
    assert call(url + "/api/health")[0] == 200             # the server goes on


@pytest.mark.timeout(60)
def test_openapi_document_describes_every_route(api):
    _, url = api
    code, doc = call(url + "/api/openapi.json", token=None)    # open: it holds no data
    assert code == 200 and doc["openapi"].startswith("3.")
    for r in ROUTES:
        op = doc["paths"][r.template][r.method.lower()]
        assert "200" in op["responses"]
        assert ("401" in op["responses"]) != r.public, r.template
    submit = doc["paths"]["/api/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = submit["$ref"].rsplit("/", 1)[1]
    schema = doc["components"]["schemas"][name]
    assert schema["required"] == ["spec"] and schema.get("additionalProperties") is False
    update = doc["components"]["schemas"]["UpdateCode"]
    assert update["properties"]["mode"]["enum"] == ["lazy", "urgent", "window"]
    assert doc["paths"]["/api/jobs/{job}/incidents/{incident}"]["get"]["parameters"][1]["schema"] == \
        {"type": "integer", "minimum": 0}


@pytest.mark.timeout(60)
def test_an_agents_nan_loss_reaches_the_controller(api):
    """Python's JSON writes a NaN loss as `NaN`: the agents' routes take it (a NaN detector that
    never hears the NaN detects nothing)."""
    ctl, url = api
    assert call(url + "/api/agents/m0/register", "POST", {"address": "127.0.0.1", "gpus": 1})[0] == 200
    body = json.dumps({"events": [{"type": "step", "run": 1, "rank": 0, "step": 3, "loss": float("nan"),
                                   "t": 1.0}]}).encode()
    assert b"NaN" in body
    code, out = call(url + "/api/agents/m0/events", "POST", body)
    assert code == 200, out
    code, out = call(url + "/api/jobs", "POST", b'{"spec": {"steps": NaN}}')
    assert code == 400                                   # operators' bodies are strict JSON
