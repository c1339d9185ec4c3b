"""The simulated agents of bench/controller_scale.py: N machines as asyncio tasks in a few load
processes, speaking to a real controller what the real agent (`stalwart.agent`) speaks, over real
sockets.

With a controller that serves agents' channels: each agent opens its WebSocket with
the same client code as the real agent (`stalwart.transport.websocket`), registers with a full
`Registration` over it, sends its beats and batches of events as MessagePack messages (each
answered by an ack, whose round trip is the figure measured) and gets its commands pushed. As
the real agent, a machine whose batch of events went through within the last half interval
skips its beat (the batch is the beat). With a controller that answers the upgrade with 404 (one
from before the channel, such as the "before" column's): HTTP requests as the real agent falls
back to, on a minimal keep-alive HTTP/1.1 client (`Conn`), one connection each for beats, the
long poll for commands and events.

Events: one step a second, its ranks' reports merged into one message as the real agent merges
them (`protocol.merge_steps`), and one metrics sample a second, each with the `machine` and `t`
the real agent's `emit` adds. A `start` command makes an agent report steps, a `stop` makes it
report stopped; no workers are started.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
import urllib.parse

import msgspec

from stalwart import protocol
from stalwart.protocol import merge_steps
from stalwart.transport import websocket


class HttpError(Exception):
    pass


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the controller, one request at a time: the least a
    client needs (a request line, a few headers, a Content-Length body back), so that the load
    generator spends its CPU on the agents' traffic, not on a client library's per-request objects.
    Real sockets, the real protocol: the controller cannot tell it from the agent's client."""

    def __init__(self, host: str, port: int, head: bytes):
        self.host, self.port, self.head = host, port, head
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("the controller closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).lower()
        i = head.find(b"content-length:")
        length = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        if b"connection: close" in head and self.transport is not None:
            self.transport.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((int(head[9:12]), body))

    async def request(self, method: str, path: str, body: bytes = b"", timeout: float = 10.0) -> bytes:
        loop = asyncio.get_running_loop()
        if self.transport is None or self.transport.is_closing():
            self.buf.clear()
            await loop.create_connection(lambda: self, self.host, self.port)
        assert self.transport is not None
        self.waiter = fut = loop.create_future()
        self.transport.write(b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
                             % (method.encode(), path.encode(), self.head, len(body), body))
        timer = loop.call_later(timeout, lambda: fut.done() or fut.set_exception(TimeoutError()))
        try:
            status, data = await fut
        except BaseException:
            if self.transport is not None:      # a late answer must not be read as the next one's
                self.transport.close()
            raise
        finally:
            timer.cancel()
        if status >= 400:
            raise HttpError(f"{path}: HTTP {status}: {data[:200]!r}")
        return data


class SimAgent:
    def __init__(self, mid: str, url: str, token: str | None, head: bytes, gpus: int, hb_s: float,
                 rtts: list, lags: list, errors: dict, measuring):
        self.mid, self.url, self.token, self.head, self.gpus, self.hb_s = mid, url, token, head, gpus, hb_s
        self.rtts, self.lags, self.errors, self.measuring = rtts, lags, errors, measuring
        parts = urllib.parse.urlsplit(url)
        self.addr = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.prefix = f"/api/agents/{mid}/"
        # HTTP (a controller without channels): as the real agent, beats, long poll and events
        # each on their own connection
        self.beat_conn, self.poll_conn, self.event_conn = (Conn(*self.addr, head) for _ in range(3))
        self.ws: websocket.WsClient | None = None
        self.waiting: dict[int, asyncio.Future] = {}
        self.seq = itertools.count(1)
        self.run: int | None = None
        self.ranks: list[int] = []
        self.step = 0
        self.outbox: list[dict] = []
        self.delivered_at = float("-inf")
        self.merge_steps = False
        self.pids = [0] * gpus

    def failed(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def registration(self) -> dict:
        return protocol.encode(protocol.Registration(address="127.0.0.1", gpus=self.gpus, hostname=self.mid,
                                                     pid=os.getpid(), workdir="/nonexistent",
                                                     peer=("127.0.0.1", 1), labels={}))

    # -- the channel --------------------------------------------------------------------------------
    def received(self, data: bytes) -> None:
        msg = msgspec.msgpack.decode(data)
        if msg.get("type") == "commands":
            self.obey(msg["commands"])
            return
        fut = self.waiting.pop(msg.get("seq"), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def channel_closed(self) -> None:
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the channel closed"))
        self.waiting.clear()

    async def call(self, msg: dict, timeout: float = 10.0) -> dict:
        """One message over the channel and its answer (as agent/link.py: seq, MessagePack)."""
        ws = self.ws
        if ws is None or ws.closed:
            raise ConnectionError("no channel")
        loop = asyncio.get_running_loop()
        seq = msg["seq"] = next(self.seq)
        fut = self.waiting[seq] = loop.create_future()
        ws.send(msgspec.msgpack.encode(msg))
        timer = loop.call_later(timeout, lambda: fut.done() or fut.set_exception(TimeoutError()))
        try:
            reply = await fut
        finally:
            timer.cancel()
            self.waiting.pop(seq, None)
        if reply.get("type") == "error":
            raise RuntimeError(reply.get("error"))
        return reply

    async def register(self) -> None:
        """Open the channel and register over it (as the real agent); HTTP where the controller
        answers the upgrade with 404."""
        while True:
            try:
                if self.ws is not None:
                    self.ws.close()
                self.ws = None
                try:
                    self.ws = await websocket.connect(self.url, protocol.CHANNEL_PATH.format(machine=self.mid),
                                                     self.token, None, self.received, self.channel_closed)
                except websocket.Refused as e:
                    if e.status in (401, 403) or e.status >= 500:
                        raise
                    reply = await self.register_http()
                else:
                    reply = await self.call({"type": "register", "reg": self.registration()})
                self.merge_steps = bool(reply.get("steps_batch"))   # as the real agent
                return
            except Exception:
                self.failed("register")
                await asyncio.sleep(1.0 + random.random())

    async def register_http(self) -> dict:
        conn = Conn(*self.addr, self.head)     # (its own: a beat or a batch may be in flight)
        try:
            return json.loads(await conn.request("POST", self.prefix + "register",
                                                 msgspec.json.encode(self.registration())))
        finally:
            if conn.transport is not None:
                conn.transport.close()

    # -- what the agent sends ---------------------------------------------------------------------------
    def beat_sent(self, t0: float, due: float) -> None:
        """A message that carried the machine's beat (a heartbeat, or a batch of events) was answered."""
        self.delivered_at = time.perf_counter()
        if self.measuring.is_set():
            self.rtts.append((self.delivered_at - t0) * 1000.0)
            # the load generator's own lateness: an overloaded generator sends late, not the controller
            self.lags.append(max(0.0, t0 - due) * 1000.0)

    async def heartbeats(self, stop: asyncio.Event) -> None:
        """As the real agent: a heartbeat only when no batch of events went through within the
        last half interval (a delivered batch counts as the beat)."""
        await asyncio.sleep(random.random() * self.hb_s)        # agents do not beat in step
        while not stop.is_set():
            if time.perf_counter() - self.delivered_at < self.hb_s / 2:
                await asyncio.sleep(self.hb_s)
                continue
            t0 = time.perf_counter()
            try:
                if self.ws is not None:
                    reply = await self.call({"type": "beat", "t": time.time(), "workers": self.pids}, 3.0)
                    again = reply.get("reregister")
                else:
                    again = b"reregister" in await self.beat_conn.request(
                        "POST", self.prefix + "heartbeat", b'{"t":%.3f,"workers":%s}'
                        % (time.time(), json.dumps(self.pids).encode()))
                self.beat_sent(t0, self.delivered_at + self.hb_s)
                if again:
                    self.failed("reregister")
                    await self.register()
            except Exception:
                self.failed("heartbeat")
                if self.ws is not None and self.ws.closed:
                    await self.register()
            await asyncio.sleep(max(0.0, t0 + self.hb_s - time.perf_counter()))

    def obey(self, commands: list[dict]) -> None:
        for cmd in commands:
            kind = cmd.get("type")
            now = time.time()
            if kind == "start":
                self.run = cmd["spec"]["run"]
                self.ranks = [w["rank"] for w in cmd["workers"]]
                self.step = int(cmd["spec"].get("restore_step", -1)) + 1
                self.outbox.append({"type": "started", "run": self.run, "pids": [], "warm": False, "t": now,
                                    "machine": self.mid})
                self.outbox += [{"type": "hello", "run": self.run, "rank": r, "pid": 0, "t": now,
                                 "machine": self.mid} for r in self.ranks]
            elif kind in ("stop", "shutdown"):
                self.run = None
                self.outbox.append({"type": "stopped", "run": cmd.get("run"), "inventory": {}, "t": now,
                                    "machine": self.mid})

    async def commands(self, stop: asyncio.Event) -> None:
        """HTTP only (over the channel commands are pushed): the long poll."""
        while not stop.is_set():
            try:
                reply = json.loads(await self.poll_conn.request("GET", self.prefix + "commands?wait=5",
                                                                timeout=15))
            except Exception:
                self.failed("commands")
                await asyncio.sleep(0.5)
                continue
            self.obey(reply.get("commands", []))

    async def events(self, stop: asyncio.Event) -> None:
        await asyncio.sleep(random.random())
        due = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            now = time.time()
            if self.run is not None:
                self.outbox += [{"type": "step", "rank": r, "step": self.step, "t": now, "dur": 1.0,
                                 "loss": 2.0, "grad_norm": 1.0, "tokens": 4096, "local_grad_norm": None,
                                 "compute_s": 0.8, "run": self.run, "machine": self.mid} for r in self.ranks]
                self.step += 1
            self.outbox.append({"type": "metrics", "t": now, "machine": self.mid,
                                "values": {"cpu": 0.125, "rss_mb": 3072.0, "net_mbps": 812.5, "gpu_temp": 61.0,
                                           "gpu_clock": 1410.0}})   # (the keys of agent/metrics.py)
            batch, self.outbox = self.outbox, []
            if self.merge_steps:
                batch = merge_steps(batch)
            try:
                if self.ws is not None:
                    reply = await self.call({"type": "events", "events": batch})
                    again = reply.get("reregister")
                    if reply.get("taken") is False:
                        self.outbox = batch + self.outbox
                else:
                    again = b"reregister" in await self.event_conn.request(
                        "POST", self.prefix + "events", msgspec.json.encode({"events": batch}))
                self.beat_sent(t0, due)
                if again:
                    self.failed("reregister")
                    await self.register()
            except Exception:
                self.failed("events")
                self.outbox = batch + self.outbox       # (kept, in order, as the real agent)
                if self.ws is not None and self.ws.closed:
                    await self.register()
            due = t0 + 1.0
            await asyncio.sleep(max(0.0, due - time.perf_counter()))

    async def live(self, stop: asyncio.Event) -> None:
        await self.register()
        loops = [self.heartbeats(stop), self.events(stop)]
        if self.ws is None:
            loops.append(self.commands(stop))
        await asyncio.gather(*loops)

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
        for c in (self.beat_conn, self.poll_conn, self.event_conn):
            if c.transport is not None:
                c.transport.close()


def load_process(ids: list[str], base: str, token: str | None, gpus: int, ramp_s: float,
                 measuring, stopping, out) -> None:
    """Run the agents `ids` until `stopping` is set; put (rtts, lags, errors) on `out`."""

    async def main() -> tuple[list, list, dict]:
        rtts: list[float] = []
        lags: list[float] = []
        errors: dict[str, int] = {}
        url = urllib.parse.urlsplit(base)
        head = b"Host: %s\r\nContent-Type: application/json\r\n" % url.netloc.encode()
        if token:
            head += b"Authorization: Bearer %s\r\n" % token.encode()
        stop = asyncio.Event()
        agents = [SimAgent(m, base, token, head, gpus, 1.0, rtts, lags, errors, measuring) for m in ids]
        tasks = []
        for a in agents:       # a ramp: the agents of a new cluster do not all start at once
            tasks.append(asyncio.create_task(a.live(stop)))
            await asyncio.sleep(ramp_s / max(1, len(agents)))
        while not stopping.is_set():
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait(tasks, timeout=20)
        for t in tasks:
            t.cancel()
        for a in agents:
            a.close()
        return rtts, lags, errors

    try:
        import uvloop
    except ImportError:
        out.put(asyncio.run(main()))
    else:
        out.put(uvloop.run(main()))
