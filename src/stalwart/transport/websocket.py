"""WebSocket (RFC 6455) on asyncio and the standard library: the frames, the handshake's key, and
a small client. The agent's channel to the controller uses both ends: the agent (agent/link.py)
and the simulated agents of bench/controller_scale.py the client, the controller
(controller/api/channel.py) the frames.

Why not aiohttp's WebSocket (the controller's HTTP API is aiohttp): on the controller, aiohttp
keeps about 85 objects alive per open WebSocket (the request, its handler's task and coroutines,
the reader's queue...); at 2,048 agents that is 175k objects the cycle collector walks at every
full collection, a 0.1 s stall of every agent's beat each few seconds, and each message wakes a
task. Here a channel is one protocol object whose `data_received` handles its messages at once.
On an agent, aiohttp costs 0.15-0.2 s of CPU to import, as much as the rest of the agent's
start-up. What the channel needs is little: an upgrade with the bearer token, binary messages in
masked (client) and unmasked (server) frames, ping/pong and close.

Why not a sans-I/O library (wsproto): measured with `bench/ws_codec.py` (the controller's side,
a masked client frame read and an unmasked answer written per message, the channel's message
sizes), this codec takes 5.0 us a message and wsproto 14.2-16.4 us (2.85x). At 2,048 agents,
each sending a beat and an event batch a second and reading their acks (about 8,000 messages a
second), wsproto would cost the controller about 0.08 of a core more, some 30% on top of the
0.27 of a core it uses there (docs/testing.md), where the budget for a library was 10%.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import ssl
import struct
import urllib.parse
from collections.abc import Callable

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
CLOSE_PROTOCOL, CLOSE_TOO_BIG = 1002, 1009
MAX_HEAD = 64 << 10             # an upgrade request's or answer's head


class Refused(Exception):
    """The server answered the upgrade with an HTTP status (401 wrong token, 404 no channel...)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class FrameError(Exception):
    """The peer broke the protocol; close with `code`."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


def accept_key(key: bytes | str) -> str:
    """The Sec-WebSocket-Accept answering a Sec-WebSocket-Key."""
    raw = key.encode() if isinstance(key, str) else key
    return base64.b64encode(hashlib.sha1(raw + GUID).digest()).decode()


def mask(key: bytes, data: bytes) -> bytes:
    """`data` XOR the 4-byte `key` repeated (two big-integer operations: C speed, no loop)."""
    n = len(data)
    if not n:
        return b""
    k = int.from_bytes((key * (n // 4 + 1))[:n], "little")
    return (int.from_bytes(data, "little") ^ k).to_bytes(n, "little")


def frame(opcode: int, payload: bytes, masked: bool) -> bytes:
    """One final frame; `masked` (a client's): with a fresh random key, as RFC 6455 asks."""
    n = len(payload)
    bit = 0x80 if masked else 0
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, bit | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, bit | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, bit | 127, n)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + mask(key, payload)


def close_payload(code: int, reason: str = "") -> bytes:
    return struct.pack("!H", code) + reason.encode()[:120]


class FrameReader:
    """Frames from a byte stream, as whole messages: `feed` returns (opcode, payload) for each
    message completed (data messages reassembled from their fragments, control frames as they
    come). A message over `max_message` (1009: the frame's header says so, before its payload is
    read; the payload is passed over) or a broken frame (1002; `masked`: the peer must mask, as
    clients do, or must not, as servers do) sets `error`, a FrameError: the messages before it
    are returned, the caller closes."""

    __slots__ = ("max_message", "masked", "buf", "parts", "size", "skip", "error")

    def __init__(self, max_message: int, masked: bool):
        self.max_message, self.masked = max_message, masked
        self.buf = bytearray()
        self.parts: list[bytes] = []        # a fragmented message so far
        self.size = 0
        self.skip = 0                       # bytes of an oversized frame still to pass over
        self.error: FrameError | None = None

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.error = None
        out: list[tuple[int, bytes]] = []
        try:
            self._feed(data, out)
        except FrameError as e:
            self.error = e
        return out

    def _feed(self, data: bytes, out: list[tuple[int, bytes]]) -> None:
        if self.skip:
            passed = min(self.skip, len(data))
            self.skip -= passed
            data = data[passed:]
        buf = self.buf
        buf += data
        while len(buf) >= 2:
            b0, b1 = buf[0], buf[1]
            n, at = b1 & 0x7F, 2
            if n == 126:
                if len(buf) < 4:
                    break
                n, at = struct.unpack_from("!H", buf, 2)[0], 4
            elif n == 127:
                if len(buf) < 10:
                    break
                n, at = struct.unpack_from("!Q", buf, 2)[0], 10
            opcode, fin = b0 & 0x0F, b0 & 0x80
            if b0 & 0x70:
                raise FrameError(CLOSE_PROTOCOL, "reserved bits set (no extension was agreed)")
            if bool(b1 & 0x80) != self.masked:
                raise FrameError(CLOSE_PROTOCOL, "a client must mask its frames" if self.masked
                                 else "a server must not mask its frames")
            if opcode >= 0x8 and (n > 125 or not fin):
                raise FrameError(CLOSE_PROTOCOL, "a control frame must be whole and at most 125 bytes")
            if opcode not in (OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG):
                raise FrameError(CLOSE_PROTOCOL, f"unknown opcode {opcode}")
            if opcode < 0x8 and self.size + n > self.max_message:
                # its payload is passed over unread (the peer may read the close and answer it)
                whole = at + (4 if self.masked else 0) + n
                self.skip = max(0, whole - len(buf))
                del buf[:whole]
                self.parts, self.size = [], 0
                raise FrameError(CLOSE_TOO_BIG, f"message over {self.max_message} bytes")
            key = b""
            if self.masked:
                key, at = bytes(buf[at:at + 4]), at + 4
            if len(buf) < at + n:
                break
            payload = bytes(buf[at:at + n])
            del buf[:at + n]
            if key:
                payload = mask(key, payload)
            if opcode >= 0x8:
                out.append((opcode, payload))
                continue
            if (opcode == OP_CONT) != bool(self.parts):
                raise FrameError(CLOSE_PROTOCOL, "a continuation frame without its start, or a new "
                                 "message inside a fragmented one")
            if not fin:
                self.parts.append(payload if opcode == OP_CONT else bytes([opcode]) + payload)
                self.size += n
                continue
            if self.parts:
                first = self.parts[0]
                opcode, payload = first[0], b"".join([first[1:], *self.parts[1:], payload])
                self.parts, self.size = [], 0
            out.append((opcode, payload))


# -- the client ----------------------------------------------------------------------------------------

def upgrade_request(url: str, path: str, token: str | None) -> tuple[bytes, bytes]:
    """The HTTP/1.1 upgrade request for `path` under `url`, and the Sec-WebSocket-Accept the
    server must answer with."""
    parts = urllib.parse.urlsplit(url)
    key = base64.b64encode(os.urandom(16))
    head = [f"GET {parts.path.rstrip('/')}{path} HTTP/1.1", f"Host: {parts.netloc}", "Upgrade: websocket",
            "Connection: Upgrade", f"Sec-WebSocket-Key: {key.decode()}", "Sec-WebSocket-Version: 13"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(head) + "\r\n\r\n").encode(), accept_key(key).encode()


class WsClient(asyncio.Protocol):
    """One client WebSocket. `on_message(bytes)` gets every data message (binary or text, as bytes)
    on the event loop; `on_close()` once when the connection is gone. `send` writes a binary
    message (from the loop's thread)."""

    def __init__(self, request: bytes, accept: bytes, on_message: Callable[[bytes], None],
                 on_close: Callable[[], None] | None = None, max_message: int = 64 << 20):
        self._request, self._accept = request, accept
        self.on_message, self.on_close = on_message, on_close
        self.transport: asyncio.Transport | None = None
        self.opened: asyncio.Future = asyncio.get_running_loop().create_future()
        self.closed = False
        self._head = bytearray()
        self._status: int | None = None         # the upgrade answer's status, once read
        self._frames: FrameReader | None = None
        self._max = max_message

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self._request)

    def connection_lost(self, exc) -> None:
        self.transport = None
        if not self.opened.done():
            if self._status is not None:        # an HTTP answer without a length, ended by the close
                end = self._head.find(b"\r\n\r\n")
                body = bytes(self._head[end + 4:end + 204]).decode("latin-1")
                self.opened.set_exception(Refused(self._status, body or f"HTTP {self._status}"))
            else:
                self.opened.set_exception(ConnectionError(f"the server closed the connection ({exc or 'EOF'})"))
        if not self.closed:
            self.closed = True
            if self.on_close is not None:
                self.on_close()

    def data_received(self, data: bytes) -> None:
        if self._frames is None:
            self._head += data
            data = self._read_head()
            if self._frames is None or not data:
                return
        messages = self._frames.feed(data)
        for opcode, payload in messages:
            if opcode == OP_PING:
                self._write(OP_PONG, payload)
            elif opcode == OP_CLOSE:
                if self.transport is not None:
                    self._write(OP_CLOSE, payload[:2])
                    self.transport.close()
                return
            elif opcode in (OP_TEXT, OP_BINARY):
                self.on_message(payload)
        if self._frames.error is not None:
            self.close(self._frames.error.code, self._frames.error.reason)

    def _read_head(self) -> bytes:
        """Read the upgrade's answer; returns the bytes after it (frames already)."""
        buf = self._head
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                self._fail(ConnectionError("the server's answer has no end of headers"))
            return b""
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            self._fail(ConnectionError(f"not an HTTP answer: {lines[0][:80]!r}"))
            return b""
        self._status = status
        if status != 101:
            given = headers.get("content-length", "")
            length = int(given) if given.isdigit() else 0
            if not given.isdigit() or len(buf) < end + 4 + min(length, MAX_HEAD):
                return b""            # the error's body is still coming
            body = bytes(buf[end + 4:end + 4 + length])
            try:
                message = str(json.loads(body).get("error") or body[:200])
            except (ValueError, AttributeError):
                message = body[:200].decode("latin-1") or lines[0]
            self._fail(Refused(status, message))
            return b""
        if headers.get("sec-websocket-accept", "").encode() != self._accept:
            self._fail(ConnectionError("the server answered the upgrade with a wrong Sec-WebSocket-Accept"))
            return b""
        self._frames = FrameReader(self._max, masked=False)
        self.opened.set_result(None)
        return bytes(buf[end + 4:])

    def _fail(self, exc: Exception) -> None:
        if not self.opened.done():
            self.opened.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def _write(self, opcode: int, payload: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(opcode, payload, masked=True))

    # -- the caller's side ------------------------------------------------------------------------------
    def send(self, payload: bytes) -> bool:
        """Write one binary message; False when the connection is gone."""
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(frame(OP_BINARY, payload, masked=True))
        return True

    def close(self, code: int = 1000, reason: str = "") -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._write(OP_CLOSE, close_payload(code, reason))
            self.transport.close()


async def connect(url: str, path: str, token: str | None, tls: ssl.SSLContext | None,
                  on_message: Callable[[bytes], None], on_close: Callable[[], None] | None = None,
                  timeout: float = 10.0) -> WsClient:
    """An open WebSocket to `path` under the controller's `url` (http:// or https://, TLS with
    `tls`, the system's authorities when None). Raises Refused (an HTTP answer instead of the
    upgrade: 401, 404...), OSError or ConnectionError (nobody there), TimeoutError."""
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if https else 80)
    request, accept = upgrade_request(url, path, token)
    loop = asyncio.get_running_loop()
    client: WsClient | None = None

    def factory() -> WsClient:
        nonlocal client
        client = WsClient(request, accept, on_message, on_close)
        return client

    async def open_() -> WsClient:
        await loop.create_connection(factory, host, port,
                                     ssl=(tls or ssl.create_default_context()) if https else None)
        assert client is not None
        await client.opened
        return client

    try:
        return await asyncio.wait_for(open_(), timeout)
    except BaseException:
        if client is not None and client.transport is not None:
            client.transport.close()
        raise
