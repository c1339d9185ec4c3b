"""The agent's line to the controller: registration, beats, batches of events, commands.

Over the agent's channel (one WebSocket, `controller/api/channel.py`) when the controller serves one:
messages are MessagePack frames, each beat and batch answered by an ack naming its `seq`, and
commands pushed as the controller has them. Over HTTP requests otherwise (a controller from
before the channel answers the upgrade with 404): register, heartbeat and events are POSTs and
commands a long poll, as before. Every `register` tries the channel again, so an agent finds it
once its controller is upgraded and restarted.

The agent's threads call this as they called the HTTP client (blocking, with a timeout;
ControllerUnreachable when the controller is away or silent, ApiError when it refuses). The
channel's socket belongs to one event loop in its own thread (asyncio's, with TLS through
`ssl`), so no two threads ever read or write it at once; a caller waits on a future its answer
resolves. A call that times out closes the channel (a half-open TCP connection looks the same),
and the next registration opens a new one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import queue
import threading
from typing import Any

import msgspec

from stalwart import protocol
from stalwart.transport import websocket
from stalwart.transport.client import ApiError, Client, ControllerUnreachable

log = logging.getLogger("stalwart.agent")


def _enc_hook(obj: Any) -> Any:
    """What MessagePack has no type for: numbers as numbers, anything else as its text."""
    for kind in (int, float):
        try:
            return kind(obj)
        except (TypeError, ValueError):
            continue
    return str(obj)


class _TooBig(Exception):
    def __init__(self, size: int):
        super().__init__(f"{size} bytes")
        self.size = size


class Link:
    def __init__(self, client: Client, machine_id: str, channel: bool = True, urls: list[str] | None = None):
        """`channel`: try the WebSocket channel (False: HTTP requests only); `urls`: the active
        controller's and its standbys' (tried in turn while none answers)."""
        self.client = client
        self.urls = [u.rstrip("/") for u in (urls or [client.url])]
        self.machine_id = machine_id
        self.channel = channel
        self.over_channel = False       # the last registration went over the channel
        self._said_http = False
        self._prefix = f"/api/agents/{machine_id}/"
        self._path = protocol.CHANNEL_PATH.format(machine=machine_id)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ws: websocket.WsClient | None = None
        self._seq = itertools.count(1)
        self._waiting: dict[int, tuple[websocket.WsClient, concurrent.futures.Future]] = {}
        self._commands: queue.Queue[list[dict]] = queue.Queue()
        self._encode = msgspec.msgpack.Encoder(enc_hook=_enc_hook).encode
        self._lock = threading.Lock()

    # -- where the controller is ------------------------------------------------------------------
    def find_controller(self, controller_file: str | None) -> None:
        """Re-read the controller's address where it is published (it may have restarted on
        another port); a new address closes the channel to the old one. Without such a file and
        with several controllers, the next one in the list (a standby may have taken over)."""
        if not controller_file:
            if len(self.urls) > 1:
                at = self.urls.index(self.client.url) if self.client.url in self.urls else -1
                url = self.urls[(at + 1) % len(self.urls)]
                log.info("trying the controller at %s", url)
                self.client = self.client.with_url(url)
                self._drop()
            return
        try:
            with open(controller_file) as f:
                url = json.load(f)["url"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if url != self.client.url:
            log.info("controller moved to %s", url)
            self.client = self.client.with_url(url)
            self._drop()

    # -- the calls ----------------------------------------------------------------------------------
    def register(self, reg: dict, timeout: float = 10.0) -> dict:
        """Register (over a channel, opened when none is open; HTTP when the controller has none)."""
        if self.channel:
            try:
                ws = self._open(timeout)
            except websocket.Refused as e:
                if e.status in (401, 403):
                    raise ApiError(e.status, e.message) from None
                if e.status >= 500:
                    raise ControllerUnreachable(f"controller at {self.client.url} failed the upgrade: "
                                                f"{e}") from None
                if not self._said_http:
                    log.info("the controller at %s serves no channel (%s): HTTP requests", self.client.url, e)
                    self._said_http = True
            else:
                # beats and batches wait until the registration is through: on a fresh channel
                # the controller hears who this is before anything else
                try:
                    reply = self._call({"type": "register", "reg": reg}, timeout, ws)
                except BaseException:
                    self._drop(ws)
                    raise
                self._ws, self.over_channel, self._said_http = ws, True, False
                return reply
        self.over_channel = False
        return self.client.post(self._prefix + "register", reg, timeout=timeout)

    def beat(self, body: dict, timeout: float) -> dict:
        if self.over_channel:
            return self._call({"type": "beat", **body}, timeout)
        return self.client.post(self._prefix + "heartbeat", body, timeout=timeout)

    def events(self, batch: list[dict], timeout: float = 10.0) -> dict:
        """Deliver a batch; it is the controller's once this returns (ack or HTTP 200). Over the
        channel a batch over the message bound goes in halves, in order (a single event over it
        is refused here with 413, as the HTTP route refuses such a body)."""
        if not self.over_channel:
            return self.client.post(self._prefix + "events", {"events": batch}, timeout=timeout)
        try:
            reply = self._call({"type": "events", "events": batch}, timeout)
        except _TooBig as e:
            if len(batch) == 1:
                raise ApiError(413, f"an event of {e.size} bytes is over the channel's bound "
                                    f"({protocol.MAX_MESSAGE}): {str(batch[0].get('type'))[:40]}") from None
            first = self.events(batch[:len(batch) // 2], timeout)
            if first.get("taken") is False:
                return first
            second = self.events(batch[len(batch) // 2:], timeout)
            return dict(second, reregister=True) if first.get("reregister") else second
        if reply.get("ignored"):
            log.warning("the controller left events out: %s", reply["ignored"])
        return reply

    def commands(self, wait: float) -> list[dict]:
        """Commands for this machine, waiting up to `wait` seconds for the first."""
        if not self.over_channel:
            return self.client.get(f"{self._prefix}commands?wait={wait:.2f}", timeout=wait + 10)["commands"]
        try:
            cmds = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
        except queue.Empty:
            return []
        while True:
            try:
                cmds += self._commands.get_nowait()
            except queue.Empty:
                return cmds

    def close(self) -> None:
        self._drop()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)

    # -- the channel -----------------------------------------------------------------------------
    def _loop_running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="link", daemon=True).start()
            return self._loop

    def _open(self, timeout: float) -> websocket.WsClient:
        """The open channel, or a new one (not used by the other calls until registered)."""
        ws = self._ws
        if ws is not None and not ws.closed:
            return ws
        self._drop()
        loop = self._loop_running()
        box: list[websocket.WsClient] = []

        def on_message(data: bytes) -> None:
            self._received(box[0] if box else None, data)

        def on_close() -> None:
            self._closed(box[0] if box else None)

        fut = asyncio.run_coroutine_threadsafe(
            websocket.connect(self.client.url, self._path, self.client.token, self.client.tls, on_message,
                             on_close, timeout), loop)
        try:
            ws = fut.result(timeout + 1.0)
        except (OSError, ConnectionError, TimeoutError) as e:
            fut.cancel()
            raise ControllerUnreachable(f"controller at {self.client.url} is not reachable "
                                        f"({type(e).__name__}: {e})") from None
        box.append(ws)
        return ws

    def _call(self, msg: dict, timeout: float, ws: websocket.WsClient | None = None) -> dict:
        ws, loop = ws or self._ws, self._loop
        if ws is None or ws.closed or loop is None:
            raise ControllerUnreachable(f"the channel to the controller at {self.client.url} is closed")
        seq = msg["seq"] = next(self._seq)
        data = self._encode(msg)
        if len(data) > protocol.MAX_MESSAGE:
            raise _TooBig(len(data))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._waiting[seq] = (ws, fut)
        try:
            loop.call_soon_threadsafe(self._write, ws, data, fut)
            reply = fut.result(timeout)
        except TimeoutError:
            self._drop(ws)      # a silent controller, or a dead connection: a fresh one next time
            raise ControllerUnreachable(f"the controller at {self.client.url} did not answer within "
                                        f"{timeout:.1f}s") from None
        finally:
            self._waiting.pop(seq, None)
        if reply.get("type") == "error":
            raise ApiError(int(reply.get("status") or 400), str(reply.get("error")))
        return reply

    @staticmethod
    def _write(ws: websocket.WsClient, data: bytes, fut: concurrent.futures.Future) -> None:
        if not ws.send(data) and not fut.done():
            fut.set_exception(ControllerUnreachable("the channel to the controller closed"))

    def _received(self, ws: websocket.WsClient | None, data: bytes) -> None:      # (on the loop)
        try:
            msg = msgspec.msgpack.decode(data)
        except msgspec.DecodeError as e:
            log.warning("an unreadable message from the controller: %s", e)
            return
        if not isinstance(msg, dict):
            return
        if msg.get("type") == "commands":
            self._commands.put([c for c in msg.get("commands") or [] if isinstance(c, dict)])
            return
        waiting = self._waiting.get(msg.get("seq"))       # type: ignore[arg-type]
        if waiting is not None and waiting[0] is ws and not waiting[1].done():
            waiting[1].set_result(msg)
        elif msg.get("type") == "error":
            log.warning("the controller could not read a message: %s", msg.get("error"))

    def _closed(self, ws: websocket.WsClient | None) -> None:           # (on the loop)
        for w, fut in list(self._waiting.values()):
            if w is ws and not fut.done():
                fut.set_exception(ControllerUnreachable("the channel to the controller closed"))

    def _drop(self, ws: websocket.WsClient | None = None) -> None:
        """Close `ws` (default: the current channel)."""
        ws, loop = ws or self._ws, self._loop
        if ws is self._ws:
            self._ws = None
        if ws is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(ws.close)
