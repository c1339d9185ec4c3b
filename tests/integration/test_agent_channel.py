"""The agents' channel (controller/api/channel.py, agent/link.py): one WebSocket per agent.

The token is checked at the upgrade (401, no socket, nothing done); TLS works end to end; a message
that is invalid is answered with an error naming the field and the channel goes on, an oversized
one closes it cleanly (1009) and the controller serves on; commands are pushed only to the agent
they are for; an agent falls back to HTTP where the controller has no channel; and a real agent
delivers every event, in order, across a restart of its controller on another port.

Controllers run in this process with their API server on a free port (aiohttp's client is the
independent WebSocket implementation that talks to them); the restart test runs a real
`stalwart agent` process. Every wait is bounded; everything started is stopped."""
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import msgspec
import pytest

from jobrun import wait_for
from stalwart import protocol
from stalwart.security import auth
from stalwart.agent.link import Link
from stalwart.agent.workers import kill_tree
from stalwart.transport.client import ApiError, Client, ControllerUnreachable
from stalwart.controller.api.server import ApiServer
from stalwart.controller.service import Controller

TOKEN = "channel-test-token"
enc, dec = msgspec.msgpack.encode, msgspec.msgpack.decode


def serve(tmp_path, port: int = 0, tls=None, db: str = "stalwart.db") -> tuple[Controller, ApiServer, str]:
    ctl = Controller(f"sqlite:///{tmp_path}/{db}", str(tmp_path))
    srv = ApiServer(ctl, "127.0.0.1", port, token=TOKEN, tls=tls)
    srv.start()
    return ctl, srv, f"{'https' if tls else 'http'}://127.0.0.1:{srv.port}"


@pytest.fixture
def api(tmp_path):
    ctl, srv, url = serve(tmp_path)
    try:
        yield ctl, srv, url
    finally:
        srv.stop()
        ctl.close()


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


REG = {"address": "127.0.0.1", "gpus": 1}


@pytest.mark.timeout(60)
def test_the_token_is_checked_at_the_upgrade(api, caplog):
    ctl, _, url = api

    async def main():
        out = []
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer nope"}):
                with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                    await s.ws_connect(url + "/api/agents/m9/channel", headers=headers)
                out.append(e.value.status)
            # with the token: a channel, and a registration over it
            async with s.ws_connect(url + "/api/agents/m0/channel",
                                    headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
                await ws.send_bytes(enc({"type": "register", "seq": 1, "reg": REG}))
                out.append(dec(await ws.receive_bytes(timeout=10)))
        return out

    caplog.set_level("WARNING", logger="stalwart.api")
    no_token, wrong, registered = run(main())
    assert no_token == 401 and wrong == 401
    assert registered["type"] == "registered" and registered["seq"] == 1, registered
    # nothing of the refused upgrades was done: only m0 is known
    assert [m["id"] for m in ctl.machines()] == ["m0"]
    assert "refused GET /api/agents/m9/channel from 127.0.0.1: no token" in caplog.text
    assert "wrong token" in caplog.text
    # without the upgrade the route is a plain 400 (the CLI's and fuzzer's view), never a 5xx
    with pytest.raises(ApiError) as e:
        Client(url, token=TOKEN).get("/api/agents/m0/channel")
    assert e.value.status == 400 and "WebSocket" in str(e.value)


@pytest.mark.timeout(60)
def test_invalid_messages_are_answered_and_an_oversized_one_closes_cleanly(api):
    _, _, url = api

    async def main():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
            async with s.ws_connect(url + "/api/agents/m0/channel") as ws:
                async def ask(payload):
                    await (ws.send_str(payload) if isinstance(payload, str) else ws.send_bytes(payload))
                    return dec(await ws.receive_bytes(timeout=10))
                replies = [
                    await ask(b"\xc1 not msgpack"),
                    await ask(enc({"type": "beat", "seq": "one"})),
                    await ask(enc({"type": "launch", "seq": 2})),
                    await ask("a text frame"),
                    await ask(enc({"type": "register", "seq": 3, "reg": {"address": "a", "gpus": "eight"}})),
                    await ask(enc({"type": "events", "seq": 4, "events": [{}] * (protocol.MAX_EVENTS + 1)})),
                    # a batch with one event that does not fit its kind: taken without it
                    await ask(enc({"type": "events", "seq": 5, "events": [
                        {"type": "metrics", "values": {"cpu": 1.0}}, {"type": "step", "rank": "x", "step": 1},
                        {"type": "from_a_newer_agent", "x": 1}]})),
                    # still usable: a registration and a beat
                    await ask(enc({"type": "register", "seq": 6, "reg": REG})),
                    await ask(enc({"type": "beat", "seq": 7, "t": time.time()})),
                ]
            # a message over the bound closes the channel with 1009, before it is read whole
            async with s.ws_connect(url + "/api/agents/m0/channel", max_msg_size=0) as ws:
                await ws.send_bytes(enc({"type": "events", "seq": 8, "events": [{"type": "metrics",
                                                                                  "values": {"x": "y" * (9 << 20)}}]}))
                closing = await ws.receive(timeout=10)
            return replies, closing, ws.close_code

    replies, closing, code = run(main())
    errors = replies[:6]
    assert all(r["type"] == "error" for r in errors), errors
    assert "malformed" in errors[0]["error"]
    assert "$.seq" in errors[1]["error"]
    assert "launch" in errors[2]["error"]
    assert "binary" in errors[3]["error"]
    assert "$.reg.gpus" in errors[4]["error"] and errors[4].get("seq") == 3
    assert "$.events" in errors[5]["error"] and errors[5].get("seq") == 4
    assert replies[6]["type"] == "ack" and replies[6]["seq"] == 5 and "$.rank" in replies[6]["ignored"], replies[6]
    assert "from_a_newer_agent" not in replies[6]["ignored"]          # unknown kinds: skipped quietly
    assert replies[7]["type"] == "registered" and replies[8] == {"type": "ack", "seq": 7}
    assert closing.type == aiohttp.WSMsgType.CLOSE and code == 1009, (closing, code)
    # the controller serves on: HTTP and a fresh channel
    assert Client(url, token=TOKEN).get("/api/health") == {"ok": True}
    link = Link(Client(url, token=TOKEN), "m1")
    try:
        assert link.register(REG)["type"] == "registered" and link.over_channel
        assert link.beat({"t": time.time()}, timeout=5)["type"] == "ack"
    finally:
        link.close()


@pytest.mark.timeout(60)
def test_an_agents_batch_over_the_bound_goes_in_halves_and_a_single_huge_event_is_refused(api):
    ctl, _, url = api
    heard: list[int] = []
    taken = ctl.agent_events_typed

    def recording(machine, events):
        heard.extend(int(e.values["i"]) for e in events if isinstance(e, protocol.Metrics))
        return taken(machine, events)
    ctl.agent_events_typed = recording              # type: ignore[method-assign]
    link = Link(Client(url, token=TOKEN), "m0")
    try:
        link.register(REG)
        blob = "x" * (3 << 20)
        reply = link.events([{"type": "metrics", "values": {"i": i, "blob": blob}} for i in range(4)])
        assert reply["type"] == "ack" and heard == [0, 1, 2, 3]          # every one, in order
        with pytest.raises(ApiError) as e:
            link.events([{"type": "stacks", "records": [{"x": "y" * (9 << 20)}]}])
        assert e.value.status == 413 and "stacks" in str(e.value)
        assert link.beat({"t": time.time()}, timeout=5)["type"] == "ack"    # the channel stayed up
    finally:
        link.close()


@pytest.mark.timeout(60)
def test_commands_are_pushed_only_to_their_agent(api):
    ctl, srv, url = api
    links = {m: Link(Client(url, token=TOKEN), m) for m in ("m0", "m1")}
    try:
        for link in links.values():
            assert link.register(REG)["type"] == "registered" and link.over_channel
        t0 = time.monotonic()
        ctl.command_queues.send("m0", protocol.Stop(run=7, grace_s=1.0))
        got = links["m0"].commands(10.0)
        assert [c["type"] for c in got] == ["stop"] and got[0]["run"] == 7 and time.monotonic() - t0 < 5
        assert links["m1"].commands(1.0) == []
        # nothing waits in m1's queue for a long poll either
        assert ctl.command_queues.pending("m1") == 0 and ctl.command_queues.pending("m0") == 0
        # commands queued while an agent has no channel wait (nothing is pushed into its closed
        # socket, nothing spins) and are pushed when it opens one
        links["m1"].close()
        assert wait_for(lambda: "m1" not in srv.channels.open, timeout=10)
        assert "m1" not in ctl.command_queues._pushers
        ctl.command_queues.send("m1", protocol.Trace(run=7, timeout_s=1.0))
        assert ctl.command_queues.pending("m1") == 1
        again = Link(Client(url, token=TOKEN), "m1")
        links["m1"] = again
        again.register(REG)
        assert [c["type"] for c in again.commands(10.0)] == ["trace"]
    finally:
        for link in links.values():
            link.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl's CLI is needed to make the certificates")
@pytest.mark.timeout(120)
def test_tls_end_to_end_over_the_channel(tmp_path):
    from test_api_auth import make_certs
    ca, cert, key = make_certs(tmp_path)
    ctl, srv, url = serve(tmp_path, tls=auth.server_tls(cert, key))
    link = Link(Client(url, token=TOKEN, ca=ca), "m0")
    try:
        assert link.register(REG)["type"] == "registered" and link.over_channel
        assert link.beat({"t": time.time()}, timeout=5) == {"type": "ack", "seq": 2}
        assert link.events([{"type": "metrics", "values": {"cpu": 0.5}, "t": time.time()}])["type"] == "ack"
        ctl.command_queues.send("m0", protocol.Stop(run=None, grace_s=0.5))
        assert [c["type"] for c in link.commands(10.0)] == ["stop"]
        # without the CA the controller's certificate is not trusted: no channel, no HTTP either
        stranger = Link(Client(url, token=TOKEN), "m1")
        with pytest.raises(ControllerUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            stranger.register(REG)
        stranger.close()
        # the token is still checked on TLS
        with pytest.raises(ApiError) as e:
            Link(Client(url, token="wrong", ca=ca), "m2").register(REG)
        assert e.value.status == 401
        assert [m["id"] for m in ctl.machines()] == ["m0"]
    finally:
        link.close()
        srv.stop()
        ctl.close()


@pytest.mark.timeout(60)
def test_an_agent_falls_back_to_http_where_the_controller_has_no_channel():
    """A controller from before the channel: 404 for the upgrade, the old routes otherwise."""
    seen: list[str] = []

    class Old(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            seen.append(f"GET {self.path.split('?')[0]}")
            if self.path.startswith("/api/agents/m0/commands"):
                return self._answer(200, {"commands": [{"type": "stop", "run": 1, "grace_s": 1.0}]})
            return self._answer(404, {"error": f"no route GET {self.path}"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(f"POST {self.path}")
            return self._answer(200, {"ok": True, "heartbeat_s": 1.0, "missed_beats": 3, "role": "idle"})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    link = Link(Client(f"http://127.0.0.1:{httpd.server_address[1]}", token=TOKEN), "m0")
    try:
        assert link.register(REG)["ok"] and not link.over_channel
        assert link.beat({"t": time.time()}, timeout=5)["ok"]
        assert link.events([{"type": "metrics", "values": {}}])["ok"]
        assert [c["type"] for c in link.commands(1.0)] == ["stop"]
        assert seen == ["GET /api/agents/m0/channel", "POST /api/agents/m0/register",
                        "POST /api/agents/m0/heartbeat", "POST /api/agents/m0/events",
                        "GET /api/agents/m0/commands"], seen
    finally:
        link.close()
        httpd.shutdown()
        httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_a_real_agent_loses_no_event_across_a_controller_restart_on_another_port(tmp_path):
    """A worker of a real `stalwart agent` reports steps 0..N-1 through the agent's socket while
    the controller is stopped and a new one starts on another port (published in the controller
    file the agent follows): the controllers together hear every step, in order."""
    heard: list[tuple[int, int]] = []           # (controller generation, step) as taken
    losses: dict[int, float] = {}
    lock = threading.Lock()

    def start(generation: int, port: int) -> tuple[Controller, ApiServer]:
        ctl, srv, url = serve(tmp_path, port=port)
        taken = ctl.agent_events_typed

        def recording(machine, events):
            out = taken(machine, events)
            if machine == "m0" and out.taken:
                with lock:
                    for e in events:
                        if isinstance(e, protocol.Step):
                            heard.append((generation, e.step))
                            losses[e.step] = e.loss
            return out
        ctl.agent_events_typed = recording          # type: ignore[method-assign]
        (tmp_path / "controller.json").write_text(json.dumps({"url": url}))
        return ctl, srv

    ctl, srv = start(1, free_port())
    workdir = tmp_path / "m0"
    agent = subprocess.Popen([sys.executable, "-m", "stalwart.cli", "agent", "--controller",
                              json.loads((tmp_path / "controller.json").read_text())["url"], "--machine-id", "m0",
                              "--workdir", str(workdir), "--heartbeat", "0.3", "--shared-host", "--kmsg", "off",
                              "--controller-file", str(tmp_path / "controller.json"), "--log-level", "INFO"],
                             env=dict(os.environ, STALWART_TOKEN=TOKEN), stdout=open(tmp_path / "agent.log", "wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    worker = None
    try:
        assert wait_for(lambda: ctl.registry.alive("m0"), timeout=60), (tmp_path / "agent.log").read_text()
        assert wait_for(lambda: (workdir / "agent.sock").exists(), timeout=30)
        worker = socket.socket(socket.AF_UNIX)
        worker.connect(str(workdir / "agent.sock"))
        n, restart_at = 120, 40

        def report(step: int) -> None:
            worker.sendall((json.dumps({"type": "step", "rank": 0, "step": step, "t": time.time(), "dur": 0.01,
                                        "loss": float("nan") if step == 7 else 1.0}) + "\n").encode())

        for step in range(restart_at):
            report(step)
            time.sleep(0.01)
        assert wait_for(lambda: len(heard) >= 10, timeout=30)
        srv.stop()                              # the controller goes away mid-stream...
        ctl.close()
        for step in range(restart_at, n):       # ...the worker keeps training meanwhile
            report(step)
            time.sleep(0.01)
        ctl, srv = start(2, free_port())        # ...and comes back elsewhere
        assert wait_for(lambda: len({s for _, s in heard}) >= n, timeout=60), \
            (sorted({s for _, s in heard}), (tmp_path / "agent.log").read_text()[-3000:])
        steps = [s for _, s in heard]
        first = sorted(set(steps), key=steps.index)
        assert first == list(range(n)), first                  # every step, in order
        assert {g for g, _ in heard} == {1, 2}                 # both controllers heard some
        assert losses[7] != losses[7] and losses[8] == 1.0      # a NaN loss arrives as a NaN
        assert "over its channel" in (tmp_path / "agent.log").read_text()
    finally:
        if worker is not None:
            worker.close()
        kill_tree(agent.pid)
        srv.stop()
        ctl.close()
