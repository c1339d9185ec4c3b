"""Agents' channels: one WebSocket per agent carries its registration, beats and event batches in,
and its commands out (one controller holds thousands of agents).

Why a socket and not HTTP requests: at 1,024 agents a profile of the controller showed most of
its API's CPU in the per-request machinery (parsing a request's head, routing, the token check, a
response object and its headers written back), not in the agents' data. A channel pays for that
once, at the upgrade, where the token is checked (a wrong one is a 401 and no socket); after it,
an agent's message is a binary frame of MessagePack decoded straight into the typed messages of
`stalwart.protocol` (every event a typed struct, no dict in between; a NaN loss stays a NaN) and
answered with a small frame. Commands are pushed to the one agent they are for, replacing the
long poll.

Every connection to the API starts at a `FrontDoor`: the upgrade request of a channel
(`GET /api/agents/{machine}/channel`, `Upgrade: websocket`) is answered here and the connection
becomes a `ChannelConn`; anything else is handed to aiohttp as it came. A channel is one protocol
object handling its messages in `data_received`, one after the other, in order (a batch of
events is in its job's inbox before the next message is read; a registration, which writes the
store on a thread, holds the messages behind it). No task, no request object: see
`stalwart.transport.websocket` for why not aiohttp's WebSocket.

A message that is not valid gets a `ChannelError` naming the field and the channel stays open; a
batch with an event that does not fit its kind is taken without that event, and its `Ack` says
what was left out (as the HTTP route, which logs and skips it); a frame over the size bound
closes the channel with 1009 (message too big) before its payload is read: the agent opens a new
one and sends its batch again (it keeps every batch until it is acked).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
import resource
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from stalwart import protocol
from stalwart.controller.service import Controller
from stalwart.errors import StalwartError
from stalwart.security import auth, identity
from stalwart.security.logtext import loggable
from stalwart.transport import websocket as ws

log = logging.getLogger("stalwart.api")
Observe = Callable[[str, str, int, float], None]      # (route, method, code, seconds)
PATH = re.compile("^" + re.escape(protocol.CHANNEL_PATH).replace(r"\{machine\}", "([^/?]+)") + r"(\?.*)?$")
HEAD_TIMEOUT_S = 10.0      # a connection's first request head must be complete within this
CHANNEL_IDLE_S = 300.0     # an agent's channel that carries nothing this long is closed
MAX_HEAD = 16 << 10
CLOSE_WAIT_S = 10.0         # how long a closing channel waits for the agent's close


class Channels:
    """Every agent's open channel, served on the API's event loop."""

    def __init__(self, ctl: Controller, pool: ThreadPoolExecutor, token: str | None, max_message: int,
                 observe: Observe):
        self.ctl, self.pool, self.token, self.max_message = ctl, pool, token, max_message
        self.observe = observe
        self._typed = msgspec.msgpack.Decoder(protocol.AgentMessage)     # type: ignore[arg-type]
        self._loose = msgspec.msgpack.Decoder(protocol.LooseBatch)
        self.encode = msgspec.msgpack.Encoder().encode
        self.open: dict[str, ChannelConn] = {}

    def _identify(self, header: str | None, peercert: dict | None) -> tuple[identity.Identity | None, str]:
        return identity.from_request(header, peercert, self.token, self.ctl.secret)

    # -- the upgrade --------------------------------------------------------------------------------
    def upgrade(self, transport: asyncio.Transport, head: bytes, rest: bytes) -> None:
        """Answer a channel's upgrade request (`head`, through its blank line): 101 and a channel,
        or an HTTP error and a close. `rest`: what came after the head (frames already)."""
        t0 = time.perf_counter()
        lines = head.decode("latin-1").split("\r\n")
        m = PATH.match(lines[0].split(" ")[1]) if lines[0].count(" ") == 2 else None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        peer = transport.get_extra_info("peername")
        remote = peer[0] if isinstance(peer, tuple) else str(peer)
        verified = False
        if self.token is not None:
            ident, why = self._identify(headers.get("authorization"), transport.get_extra_info("peercert"))
            if ident is None:          # before anything else: nothing of the request is looked at
                log.warning("refused GET %s from %s: %s", loggable(lines[0].split(" ")[1]), remote, why)
                self._refuse(transport, 401, f"unauthorized ({why}): give the controller's token "
                             f"(--token-file or ${auth.TOKEN_ENV})", t0,
                             b'WWW-Authenticate: Bearer realm="stalwart"\r\n')
                return
            named = urllib.parse.unquote(m.group(1)) if m is not None else None
            denied = identity.permits(ident, "GET", "/api/agents/channel", named)
            if denied is not None:
                log.warning("refused a channel from %s: %s", remote, loggable(denied))
                self._refuse(transport, 403, f"forbidden: {denied}", t0)
                return
            verified = ident.scope is identity.Scope.AGENT
        key = headers.get("sec-websocket-key", "")
        bad = ("not a channel's path" if m is None else
               protocol.MACHINE_ID_RULE if not protocol.MACHINE_ID_RE.match(urllib.parse.unquote(m.group(1))) else
               "Sec-WebSocket-Version must be 13" if headers.get("sec-websocket-version") != "13" else
               "Connection must include upgrade" if "upgrade" not in headers.get("connection", "").lower() else
               "Sec-WebSocket-Key must be 16 bytes in base64" if not _key_ok(key) else None)
        if bad is not None:
            self._refuse(transport, 400, f"invalid channel upgrade: {bad}", t0)
            return
        assert m is not None
        machine = urllib.parse.unquote(m.group(1))
        if verified:
            self.ctl.verified.add(machine)
        transport.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                        b"Sec-WebSocket-Accept: %s\r\n\r\n" % ws.accept_key(key).encode())
        conn = ChannelConn(self, machine, transport, remote)
        transport.set_protocol(conn)
        old, self.open[machine] = self.open.get(machine), conn
        if old is not None:         # the agent reconnected before its old socket was seen gone
            old.close(1000, "replaced by a newer channel of this machine")
        self.ctl.command_queues.attach(machine, asyncio.get_running_loop(), conn.push)
        self.observe("agent_channel", "GET", 101, time.perf_counter() - t0)
        if rest:
            conn.data_received(rest)

    def _refuse(self, transport: asyncio.Transport, status: int, error: str, t0: float, extra: bytes = b"") -> None:
        body = msgspec.json.encode({"error": error})
        reason = {400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden"}[status]
        transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                        b"Connection: close\r\n%s\r\n%s" % (status, reason, len(body), extra, body))
        transport.close()
        self.observe("agent_channel", "GET", status, time.perf_counter() - t0)

    def gone(self, conn: "ChannelConn") -> None:
        self.ctl.command_queues.detach(conn.machine, conn.push)
        if self.open.get(conn.machine) is conn:
            del self.open[conn.machine]

    def close_all(self) -> None:
        for conn in list(self.open.values()):
            conn.close(1001, "the controller stops")

    # -- one message ----------------------------------------------------------------------------------
    def message(self, conn: "ChannelConn", data: bytes) -> bytes | Future | None:
        """The answer to one message from `conn`'s agent, encoded; or a future of it (a
        registration: the store is written on a thread)."""
        t0 = time.perf_counter()
        code, route = 200, "agent_channel_events"
        reply: msgspec.Struct
        try:
            msg: Any = self._typed.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            reply = self._unusual(conn.machine, data, e)
            code = 400 if isinstance(reply, protocol.ChannelError) else 200
        else:
            seq, kind = msg.seq, type(msg)
            try:
                if kind is protocol.Beat:
                    route = "agent_channel_beat"
                    reply = protocol.Ack(seq=seq, reregister=self.ctl.heartbeat(conn.machine).reregister)
                elif kind is protocol.EventBatch:
                    ack = self.ctl.agent_events_typed(conn.machine, msg.events)
                    reply = protocol.Ack(seq=seq, reregister=ack.reregister, taken=ack.taken)
                else:
                    return self._register(conn.machine, msg, t0)
            except StalwartError as e:
                if e.status == 500:
                    log.error("channel of %s: a %s message failed: %s: %s", conn.machine, kind.__name__,
                              type(e).__name__, e)
                code, reply = e.status, protocol.ChannelError(seq=seq, error=str(e).strip("'\""), status=e.status)
            except Exception as e:          # a bug: logged, answered; the channel goes on
                log.exception("channel of %s: a %s message failed", conn.machine, kind.__name__)
                code, reply = 500, protocol.ChannelError(seq=seq, error=f"internal error: {e}", status=500)
        self.observe(route, "WS", code, time.perf_counter() - t0)
        return self.encode(reply)

    def _register(self, machine: str, msg: protocol.Register, t0: float) -> Future:
        done: Future = Future()

        def register() -> None:
            try:
                out = self.ctl.register(machine, msg.reg)
                reply: msgspec.Struct = protocol.Registered(
                    seq=msg.seq, heartbeat_s=out["heartbeat_s"], missed_beats=out["missed_beats"],
                    role=out["role"], steps_batch=bool(out.get("steps_batch")))
                code = 200
            except StalwartError as e:
                if e.status == 500:
                    log.error("channel of %s: a registration failed: %s: %s", machine, type(e).__name__, e)
                code, reply = e.status, protocol.ChannelError(seq=msg.seq, error=str(e), status=e.status)
            except Exception as e:
                log.exception("channel of %s: a registration failed", machine)
                code, reply = 500, protocol.ChannelError(seq=msg.seq, error=f"internal error: {e}", status=500)
            self.observe("agent_channel_register", "WS", code, time.perf_counter() - t0)
            done.set_result(self.encode(reply))

        self.pool.submit(register)
        return done

    def _unusual(self, machine: str, data: bytes, err: Exception) -> msgspec.Struct:
        """A message that is not a valid typed message: a batch holding an event of a kind this
        controller does not know (a newer agent) or one that does not fit its kind is taken
        event by event; anything else is answered with the error, which names the field."""
        try:
            batch = self._loose.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return protocol.ChannelError(seq=_seq_of(data), error=f"invalid message: {err}")
        typed: list[protocol.Event] = []
        ignored: list[str] = []
        for i, raw in enumerate(batch.events):
            try:
                ev = protocol.decode_event(raw)
            except msgspec.ValidationError as e:
                ignored.append(f"events[{i}] ({raw.get('type')}): {e}")
                continue
            if ev is not None:          # (None: a kind this controller does not know)
                typed.append(ev)
        if ignored:
            log.warning("events from %s ignored: %s", machine, "; ".join(ignored[:5]))
        ack = self.ctl.agent_events_typed(machine, typed)
        more = f" (and {len(ignored) - 5} more)" if len(ignored) > 5 else ""
        return protocol.Ack(seq=batch.seq, reregister=ack.reregister, taken=ack.taken,
                            ignored="; ".join(ignored[:5]) + more if ignored else None)


class ChannelConn(asyncio.Protocol):
    """One agent's open channel (the connection's protocol once upgraded)."""

    __slots__ = ("channels", "machine", "transport", "remote", "frames", "held", "waiting", "closing", "heard")

    def __init__(self, channels: Channels, machine: str, transport: asyncio.Transport, remote: str):
        self.channels, self.machine, self.transport, self.remote = channels, machine, transport, remote
        self.frames = ws.FrameReader(channels.max_message, masked=True)
        self.held: deque[tuple[int, bytes]] | None = None     # messages behind a registration
        self.waiting = False
        self.closing = False        # our close was sent: only the agent's answer is awaited
        loop = asyncio.get_running_loop()
        self.heard = loop.time()    # when the agent last sent anything (see _idle)
        loop.call_later(CHANNEL_IDLE_S, self._idle)

    def _idle(self) -> None:
        """A channel that carried nothing for CHANNEL_IDLE_S (an agent beats every heartbeat) is
        closed: its agent is gone or stuck, and it reconnects if it is not."""
        if self.transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self.heard
        if quiet >= CHANNEL_IDLE_S:
            log.warning("channel of %s from %s closed: silent for %.0f s", self.machine, self.remote, quiet)
            self.close(1001, "idle")
            return
        loop.call_later(CHANNEL_IDLE_S - quiet, self._idle)

    def data_received(self, data: bytes) -> None:
        self.heard = asyncio.get_running_loop().time()
        for opcode, payload in self.frames.feed(data):
            if self.closing:
                if opcode == ws.OP_CLOSE:
                    self.transport.close()
                continue
            if self.waiting:
                if self.held is None:
                    self.held = deque()
                self.held.append((opcode, payload))
            else:
                self._one(opcode, payload)
        e = self.frames.error
        if e is None or self.closing:
            return
        log.warning("channel of %s from %s closed: %s", self.machine, self.remote, e.reason)
        if e.code != ws.CLOSE_TOO_BIG:
            self.close(e.code, e.reason)        # the stream cannot be read on
            return
        # an oversized message: its payload is passed over, the close handshake is kept (the
        # agent reads the close once it has sent the rest), bounded by a timer
        self._write(ws.OP_CLOSE, ws.close_payload(e.code, e.reason))
        self.closing = True
        asyncio.get_running_loop().call_later(CLOSE_WAIT_S, self.transport.close)

    def _one(self, opcode: int, payload: bytes) -> None:
        if opcode == ws.OP_BINARY:
            out = self.channels.message(self, payload)
            if isinstance(out, bytes):
                self.send(out)
            elif out is not None:           # a registration: what follows waits for it
                self.waiting = True
                loop = asyncio.get_running_loop()
                out.add_done_callback(lambda f: loop.call_soon_threadsafe(self._answered, f.result()))
        elif opcode == ws.OP_TEXT:
            self.send(self.channels.encode(protocol.ChannelError(
                error="the channel takes binary frames of MessagePack (stalwart.protocol), not text")))
        elif opcode == ws.OP_PING:
            self._write(ws.OP_PONG, payload)
        elif opcode == ws.OP_CLOSE:
            self._write(ws.OP_CLOSE, payload[:2])
            self.transport.close()

    def _answered(self, reply: bytes) -> None:
        self.send(reply)
        self.waiting = False
        while self.held and not self.waiting:
            self._one(*self.held.popleft())

    def send(self, data: bytes) -> bool:
        return self._write(ws.OP_BINARY, data)

    def _write(self, opcode: int, payload: bytes) -> bool:
        if self.transport.is_closing():
            return False
        self.transport.write(ws.frame(opcode, payload, masked=False))
        return True

    def push(self) -> None:
        """Write the machine's waiting commands (a job thread's `send` woke this, on the loop)."""
        if self.transport.is_closing():
            return                          # (they wait for the machine's next channel or poll)
        queues = self.channels.ctl.command_queues
        cmds = queues.take_now(self.machine)
        if cmds and not self.send(self.channels.encode(protocol.CommandPush(commands=cmds))):
            queues.give_back(self.machine, cmds)    # for the agent's next channel (or poll)

    def close(self, code: int, reason: str) -> None:
        self._write(ws.OP_CLOSE, ws.close_payload(code, reason))
        self.transport.close()

    def pause_writing(self) -> None:      # the agent does not read: read nothing more from it
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.channels.gone(self)


class FrontDoor(asyncio.Protocol):
    """The first protocol of every connection to the API: a channel's upgrade request is answered
    by `Channels.upgrade`; anything else is handed to aiohttp (`http()`: its protocol) with the
    bytes read so far, once its head is complete. A connection whose first request head is not
    complete within HEAD_TIMEOUT_S is closed (one that connects and says nothing, or a slow head:
    nothing of it is looked at, no token needed to hold it open); aiohttp closes idle kept-alive
    connections (its keepalive timeout) and agents' channels carry a beat every heartbeat."""

    __slots__ = ("http", "channels", "transport", "buf", "timer")

    def __init__(self, http: Callable[[], asyncio.Protocol], channels: Channels):
        self.http, self.channels = http, channels
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self._too_slow)

    def _too_slow(self) -> None:
        self.timer = None
        if self.transport is not None and self.transport.get_protocol() is self:
            self.transport.close()

    def _done(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def data_received(self, data: bytes) -> None:
        buf = self.buf = self.buf + data
        end = buf.find(b"\r\n\r\n")
        if not b"GET /api/agents/".startswith(buf[:16]):
            if end < 0 and len(buf) <= MAX_HEAD:
                return None                     # (the head is not complete yet)
            return self._to_http()
        if end < 0:
            if len(buf) > MAX_HEAD:
                return self._to_http()          # (aiohttp answers an oversized head)
            return None
        head = buf[:end]
        first = head[:head.find(b"\r\n")] if b"\r\n" in head else head
        upgrade = re.search(rb"\r\nupgrade:[ \t]*websocket[ \t]*(\r\n|$)", head, re.IGNORECASE)
        if upgrade is None or PATH.match(first.split(b" ")[1].decode("latin-1")
                                         if first.count(b" ") == 2 else "") is None:
            return self._to_http()
        assert self.transport is not None
        self._done()
        self.channels.upgrade(self.transport, head, buf[end + 4:])
        return None

    def _to_http(self) -> None:
        self._done()
        proto, transport, data = self.http(), self.transport, self.buf
        assert transport is not None
        self.buf = b""
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if data:
            proto.data_received(data)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._done()


def _key_ok(key: str) -> bool:
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except (binascii.Error, ValueError):
        return False


def _seq_of(data: bytes) -> int | None:
    try:
        obj = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, ValueError):
        return None
    seq = obj.get("seq") if isinstance(obj, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def raise_open_files() -> None:
    """Every agent holds one connection to the controller (its channel): the soft limit of open
    files (often 1,024) goes up to the hard one, so a cluster of thousands is not refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            log.warning("cannot raise the open-files limit from %d: at most about that many agents "
                        "can connect", soft)
