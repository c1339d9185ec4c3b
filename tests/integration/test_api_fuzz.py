"""Schemathesis generates requests from the OpenAPI document of a live controller
(its own `GET /api/openapi.json`) and sends them over a real socket: whatever the body, path or
query, the answer is never a 5xx, no request hangs, and the controller still answers afterwards.

The controller runs in this process with its API server (aiohttp) on a free port; requests carry
the bearer token (without it every route but the open ones is a 401, which fuzzes nothing)."""
import os

import pytest
from liveapi import live_api
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error


TOKEN = "fuzz-test-token"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    code = root / "code"            # what a submitted job's code_dir defaults to (the cwd)
    code.mkdir()
    here = os.getcwd()
    os.chdir(code)
    try:
        with live_api(root, root / "state", TOKEN) as out:
            yield out
    finally:
        os.chdir(here)


def _fuzz(op, url: str) -> None:
    @given(case=op.as_strategy())
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    def one(case) -> None:
        case.call_and_validate(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=35,
                               checks=[not_a_server_error])
    one()


@pytest.mark.timeout(600)
def test_no_generated_request_is_a_server_error(live):
    # the operations come from the live controller's own document; each is fuzzed in turn (the
    # schemathesis pytest plugin's lazy fixtures do not run on this pytest, so hypothesis drives
    # the operations' strategies directly)
    _, url = live
    schema = schemathesis.openapi.from_url(f"{url}/api/openapi.json", wait_for_schema=10)
    ops = [res.ok() for res in schema.get_all_operations()]
    assert len(ops) >= 10, [op.label for op in ops]
    failed = []
    for op in ops:
        try:
            _fuzz(op, url)
        except Exception as e:          # every operation is fuzzed; all failures are reported
            failed.append(f"{op.label}: {e}")
    assert not failed, "\n".join(failed)


@pytest.mark.timeout(60)
def test_the_controller_still_answers_after_the_fuzzing(live):
    from stalwart.transport.client import Client
    _, url = live
    client = Client(url, token=TOKEN)
    assert client.get("/api/health") == {"ok": True}
    assert isinstance(client.get("/api/machines")["machines"], list)
