"""A controller and its HTTP API in this process, on a free loopback port, for tests that talk to
the API itself."""
from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any, Iterator

import aiohttp
import msgspec

from stalwart.controller.api.server import ApiServer
from stalwart.controller.service import Controller
from stalwart.transport.client import ApiError


@contextlib.contextmanager
def live_api(db_dir, state_dir, token: str, tls: ssl.SSLContext | None = None) -> Iterator[tuple[Controller, str]]:
    """(controller, base URL) of a controller on SQLite in `db_dir` (HTTPS with `tls`); stopped
    at the end."""
    ctl = Controller(f"sqlite:///{db_dir}/stalwart.db", str(state_dir))
    srv = ApiServer(ctl, "127.0.0.1", 0, token=token, tls=tls)
    srv.start()
    try:
        yield ctl, f"{'https' if tls else 'http'}://127.0.0.1:{srv.port}"
    finally:
        srv.stop()
        ctl.close()


def channel_refuses_other_machine(url: str, mine: str, other: str, reg: dict, **ws: Any) -> tuple[int, dict]:
    """Open the agents' channel with one credential (`ws`: aiohttp `ws_connect` arguments) for
    `other` (the handshake's refusal status) and for `mine` (the answer to a registration)."""
    async def main() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s:
            try:
                await s.ws_connect(f"{url}/api/agents/{other}/channel", **ws)
            except aiohttp.WSServerHandshakeError as e:
                refused = e.status
            else:
                raise AssertionError(f"the channel of {other} accepted the credential of {mine}")
            async with s.ws_connect(f"{url}/api/agents/{mine}/channel", **ws) as conn:
                await conn.send_bytes(msgspec.msgpack.encode({"type": "register", "seq": 1, "reg": reg}))
                answer = msgspec.msgpack.decode(await conn.receive_bytes(timeout=10))
        return refused, answer
    return asyncio.run(asyncio.wait_for(main(), 30))


def status_of(client: Any, method: str, path: str, body: dict | None = None) -> int:
    """The HTTP status a request gets (200 for any success)."""
    try:
        client.request(method, path, body)
        return 200
    except ApiError as e:
        return e.status
