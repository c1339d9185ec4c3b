"""The agent's local socket for its workers: one connection per worker SDK (worker/link.py), one
reader thread per connection, every line decoded into `protocol.workerlink`'s types and routed.

Where each kind of message goes is passed in (`WorkerRoutes`): the server holds the connections
and which warm workers wait at their activation barrier, and decides nothing. A line that is not a
worker's message (not JSON, a kind the agent does not know, a field of the wrong type) is logged
and dropped, and a route that raises is logged: either way the reader goes on with the next line,
so one bad message never cuts a worker off from its agent.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import msgspec

from stalwart import protocol as p
from stalwart.transport.jsonlines import JsonLineSocket

log = logging.getLogger("stalwart.agent")
LOG_DROPPED = 3         # a connection's first dropped lines are logged, then one in LOG_DROPPED_EVERY
LOG_DROPPED_EVERY = 1000


@dataclass(frozen=True)
class WorkerRoutes:
    """What the agent does with each kind of worker message."""
    linked: Callable[[int], None]                       # pid: a worker connected
    standby_ready: Callable[[int], None]                # pid: a warm worker waits at its barrier
    failing: Callable[[int, p.Failing], None]           # pid: its training raised (not passed on)
    shard: Callable[[p.Shard], None]                    # a committed snapshot (not passed on)
    step: Callable[[p.Step], None]                      # a step report (passed on too)
    forward: Callable[[p.Forwarded], None]              # passed on to the controller, as an event of the run


class WorkerServer:
    def __init__(self, path: str, stop: threading.Event):
        self.path = path
        self.routes: WorkerRoutes | None = None         # (set by `start`)
        self._stop = stop
        self._lock = threading.Lock()
        self._conns: dict[int, JsonLineSocket] = {}      # worker pid -> connection
        self._standby_ready: list[int] = []              # pids of warm workers at the barrier
        self._srv: socket.socket | None = None

    def start(self, routes: WorkerRoutes) -> None:
        """Listen at `path`; every worker's messages go to `routes`."""
        self.routes = routes
        if os.path.exists(self.path):
            os.unlink(self.path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.path)
        srv.listen(64)
        self._srv = srv
        threading.Thread(target=self._accept_loop, args=(srv,), daemon=True, name="sock").start()

    def close(self) -> None:
        """Take no more links (those open stay until their workers go)."""
        srv, self._srv = self._srv, None
        if srv is not None:
            try:
                srv.shutdown(socket.SHUT_RDWR)      # (wakes the accept)
            except OSError:
                pass
            srv.close()

    # -- what the agent asks ---------------------------------------------------------------------
    def has_link(self, pid: int) -> bool:
        with self._lock:
            return pid in self._conns

    def standbys(self, linked: bool = False) -> list[int]:
        """The warm workers at their barrier, in the order they got there (`linked`: only those
        whose link is up)."""
        with self._lock:
            return [pid for pid in self._standby_ready if not linked or pid in self._conns]

    def send(self, pid: int, msg: p.ToWorker) -> bool:
        """Send `msg` to the worker `pid`; False when it has no link (no SDK, or gone)."""
        with self._lock:
            conn = self._conns.get(pid)
        if conn is None:
            return False
        conn.send(p.encode(msg))
        return True

    def activate(self, pid: int, msg: p.Activate) -> None:
        """Hand a warm worker waiting at its barrier its ranks (KeyError: it has no link)."""
        with self._lock:
            conn = self._conns[pid]
            self._standby_ready.remove(pid)
        conn.send(p.encode(msg))

    # -- the connections -------------------------------------------------------------------------
    def _accept_loop(self, srv: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                if self._srv is not srv:
                    return          # closed
                raise
            self.attach(socket_peer_pid(conn), JsonLineSocket(conn))

    def attach(self, pid: int, jl: JsonLineSocket) -> None:
        """The link of the worker `pid`: its messages are read on a thread of their own."""
        self._routes.linked(pid)
        with self._lock:
            self._conns[pid] = jl
        threading.Thread(target=self._reader, args=(pid, jl), daemon=True).start()

    def _reader(self, pid: int, jl: JsonLineSocket) -> None:
        dropped = 0
        while True:
            try:
                raw = jl.recv()
            except OSError:
                raw = None
            except ValueError as e:         # not JSON (the line is consumed: go on with the next)
                dropped += 1
                self._dropped(pid, dropped, f"not JSON: {e}")
                continue
            if raw is None:
                with self._lock:
                    self._conns.pop(pid, None)
                return
            try:
                msg = p.decode_from_worker(raw)
            except msgspec.ValidationError as e:
                dropped += 1
                self._dropped(pid, dropped, f"{e}: {str(raw)[:200]}")
                continue
            try:
                self.route(pid, msg)
            except Exception:       # noqa: BLE001 - the link outlives a failed handler
                log.exception("worker pid %d: handling its %s message failed", pid, type(msg).__name__)

    @staticmethod
    def _dropped(pid: int, n: int, why: str) -> None:
        if n <= LOG_DROPPED or n % LOG_DROPPED_EVERY == 0:
            log.warning("worker pid %d: a message dropped (%d so far): %s", pid, n, why)

    @property
    def _routes(self) -> WorkerRoutes:
        assert self.routes is not None, "start() first"
        return self.routes

    def route(self, pid: int, msg: p.FromWorker) -> None:
        """Hand one of a worker's messages on, by kind."""
        routes = self._routes
        if isinstance(msg, p.Failing):
            routes.failing(pid, msg)
            return
        if isinstance(msg, p.Shard):
            routes.shard(msg)
            return
        if isinstance(msg, p.StandbyReady):
            with self._lock:
                self._standby_ready.append(pid)
            routes.standby_ready(pid)
        elif isinstance(msg, p.Step):
            routes.step(msg)
        routes.forward(msg)


def socket_peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]
