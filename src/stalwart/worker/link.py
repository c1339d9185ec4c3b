"""The worker's side of the local link to its agent (a Unix socket named by STALWART_AGENT_SOCK).

Metrics go out through a queue drained by a background thread, so `report()` never blocks the
training thread on I/O. Messages from the agent (activation of a warm standby, chaos) are handed to a
callback on a reader thread. Without an agent (a plain torchrun job) the link is inert.
"""
from __future__ import annotations

import os
import queue
import socket
import threading
from typing import Callable

from stalwart.jsonlines import JsonLineSocket


class AgentLink:
    def __init__(self, path: str | None, on_message: Callable[[dict], None]):
        self.path = path
        self._on_message = on_message
        self._q: queue.Queue = queue.Queue()
        self._conn: JsonLineSocket | None = None
        self._closed = threading.Event()
        if path:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            self._conn = JsonLineSocket(s)
            threading.Thread(target=self._writer, name="stalwart-link-w", daemon=True).start()
            threading.Thread(target=self._reader, name="stalwart-link-r", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def send(self, msg: dict) -> None:
        if self._conn is not None:
            self._q.put(msg)

    def send_now(self, msg: dict) -> None:
        """Send synchronously (used before blocking on the agent, and before exit)."""
        if self._conn is not None:
            self.flush()
            self._conn.send(msg)

    def flush(self, timeout: float = 5.0) -> None:
        if self._conn is None:
            return
        done = threading.Event()
        self._q.put(done)
        done.wait(timeout)

    def _writer(self) -> None:
        while not self._closed.is_set():
            msg = self._q.get()
            if msg is None:
                return
            if isinstance(msg, threading.Event):
                msg.set()
                continue
            try:
                self._conn.send(msg)
            except OSError:
                return

    def _reader(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (OSError, ValueError):
                msg = None
            if msg is None:
                if not self._closed.is_set():
                    # The agent is gone: the machine is being torn down. Do not train on alone.
                    os._exit(70)
                return
            self._on_message(msg)

    def close(self) -> None:
        if self._conn is None:
            return
        self.flush()
        self._closed.set()
        self._q.put(None)
        self._conn.close()
