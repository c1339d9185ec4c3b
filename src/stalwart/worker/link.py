"""The worker's side of the local link to its agent (a Unix socket named by STALWART_AGENT_SOCK).

Metrics go out through a buffer drained by a background thread, so `report()` never blocks the
training thread on I/O. A message sent with `wake=False` (a step report when the step's
checkpoint commit follows within a millisecond or two: the SDK says so when the previous report
was followed by a snapshot) does not wake that thread: it goes with the next message, and the
two go in one write (one wake-up of the agent's reader, not two, and no thread woken while the
training thread is still in the SDK). One that no prompt message follows goes when the next one
that may wait comes LAZY_S or more after it, or within LAZY_IDLE_S of the writer's last wake-up
(the last report before a hang). The writer does not poll: with a checkpoint every step it wakes
once a step, for the commit (it woke every LAZY_S, 20 times a second, taking the interpreter
lock from the training thread each time). Messages from the agent (activation of a warm
standby, chaos) are decoded into `protocol.workerlink`'s types and handed to a callback on a
reader thread; a line that is not one of them is dropped. Without an agent (a plain torchrun job)
the link is inert.

When the agent's end closes (the agent died), the link connects to the same socket path again
for up to STALWART_RELINK_S seconds: a restarted agent listens there and adopts the worker
(agent/adopt.py); messages queued meanwhile go once it is back. Past the bound, or without it,
the worker exits (code 70): it does not train on alone.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Deque

import msgspec

from stalwart.transport.jsonlines import JsonLineSocket
from stalwart.protocol import Env, ToWorker, decode_to_worker

LAZY_S = 0.05       # a message sent with wake=False this old goes with the next such message...
LAZY_IDLE_S = 1.0   # ...and within this when none follows, while the writer waits this long...
LAZY_KEEP_S = 10.0  # ...until this long after the last (then it sleeps until a message comes)
log = logging.getLogger("stalwart.worker")


def _end_worker() -> None:
    """The agent is gone for good: the machine is being torn down. Do not train on alone."""
    os._exit(70)


class AgentLink:
    def __init__(self, path: str | None, on_message: Callable[[ToWorker], None],
                 on_gone: Callable[[], None] = _end_worker):
        """`on_gone`: what the reader does when the agent did not come back within the bound
        (the worker's process ends; a test records it instead)."""
        self.path = path
        self._on_message = on_message
        self._on_gone = on_gone
        self._buf: Deque[dict | threading.Event | None] = collections.deque()
        self._cv = threading.Condition()
        self._woken = 0                 # queued items that may not wait (see `send`)
        self._lazy_at = float("-inf")   # when the last message that may wait was queued
        self._lazy_since: float | None = None   # ...and the oldest one the buffer holds
        self._untimed = False           # the writer waits without a bound (nothing may be waiting)
        self._conn: JsonLineSocket | None = None
        self._closed = threading.Event()
        self._relink_lock = threading.Lock()
        try:
            self.relink_s = float(os.environ.get(Env.RELINK_S) or 0)
        except ValueError:
            self.relink_s = 0.0
        if path:
            self._conn = self._connect(path)
            threading.Thread(target=self._writer, name="stalwart-link-w", daemon=True).start()
            threading.Thread(target=self._reader, name="stalwart-link-r", daemon=True).start()

    @staticmethod
    def _connect(path: str) -> JsonLineSocket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            raise
        return JsonLineSocket(s)

    def _relink(self, lost: JsonLineSocket) -> bool:
        """The connection `lost` failed: connect again within the bound (another thread may have
        done it already). False: the agent did not come back."""
        with self._relink_lock:
            if self._conn is not lost:
                return self._conn is not None
            deadline = time.monotonic() + self.relink_s
            while not self._closed.is_set() and self.path:
                try:
                    self._conn = self._connect(self.path)
                    return True
                except OSError:
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(0.05)
            return False

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def send(self, msg: dict | msgspec.Struct, wake: bool = True) -> None:
        """Queue `msg` (one of `protocol`'s messages, or the wire form of a step report) for the
        writer; with `wake=False` it waits for the next message (LAZY_S at most)."""
        if self._conn is not None:
            self._put(msgspec.to_builtins(msg) if isinstance(msg, msgspec.Struct) else msg, wake)

    def _put(self, item, wake: bool) -> None:
        with self._cv:
            self._buf.append(item)
            if wake:
                self._woken += 1
                self._cv.notify()
            else:
                now = self._lazy_at = time.monotonic()
                if self._lazy_since is None:
                    self._lazy_since = now
                elif now - self._lazy_since >= LAZY_S:   # no prompt message took the older one
                    self._woken += 1
                    self._cv.notify()
                    return
                if self._untimed:               # (a writer idle for long: it must look again)
                    self._cv.notify()

    def send_now(self, msg: dict | msgspec.Struct) -> None:
        """Send synchronously (used before blocking on the agent, and before exit)."""
        data: dict = msgspec.to_builtins(msg) if isinstance(msg, msgspec.Struct) else msg
        if self._conn is not None:
            self.flush()
            conn = self._conn
            try:
                conn.send(data)
            except OSError:
                if not self._relink(conn):
                    raise
                self._conn.send(data)

    def flush(self, timeout: float = 5.0) -> None:
        if self._conn is None:
            return
        done = threading.Event()
        self._put(done, True)
        done.wait(timeout)

    def _writer(self) -> None:
        while not self._closed.is_set():
            with self._cv:
                if not self._woken:
                    # a lazy message waits here for company (see the module's text); a link
                    # without any for long (a warm spare's) sleeps until something comes
                    bounded = bool(self._buf) or time.monotonic() - self._lazy_at < LAZY_KEEP_S
                    self._untimed = not bounded
                    self._cv.wait(LAZY_IDLE_S if bounded else None)
                    self._untimed = False
                items = list(self._buf)
                self._buf.clear()
                self._woken = 0
                self._lazy_since = None
            lines = []
            for item in items:
                if isinstance(item, dict):
                    lines.append(json.dumps(item, separators=(",", ":")) + "\n")
                    continue
                if lines:                       # what came before a flush or the end goes first
                    if not self._write("".join(lines)):
                        return
                    lines.clear()
                if item is None:
                    return
                item.set()
            if lines and not self._write("".join(lines)):
                return

    def _write(self, text: str) -> bool:
        while True:
            conn = self._conn
            assert conn is not None
            try:
                conn.send_raw(text.encode())
                return True
            except OSError:
                if not self._relink(conn):
                    return False

    def _reader(self) -> None:
        while True:
            conn = self._conn
            assert conn is not None
            try:
                msg = conn.recv()
            except OSError:
                msg = None
            except ValueError as e:     # not JSON (the line is consumed: go on with the next)
                log.warning("a line from the agent dropped: %s", e)
                continue
            if msg is None:
                if not self._closed.is_set() and self._relink(conn):
                    continue
                if not self._closed.is_set():
                    self._on_gone()
                return
            try:
                typed = decode_to_worker(msg)
            except msgspec.ValidationError as e:    # (a newer agent's kind, say)
                log.warning("a message from the agent dropped: %s", e)
                continue
            self._on_message(typed)

    def close(self) -> None:
        if self._conn is None:
            return
        self.flush()
        self._closed.set()
        self._put(None, True)
        self._conn.close()
