"""Peer streaming of checkpoint shards between agents over a tiny TCP protocol.

Every message starts with a frame: 4-byte big-endian length + a JSON object. A server given the
job's checkpoint key (every agent's) first authenticates each connection (`peerauth`: mutual
challenge-response; a frame before that is at most `peerauth.AUTH_FRAME` bytes and the client
has `peerauth.AUTH_TIMEOUT_S` for it); a connection that fails it is answered an error and
closed, before any operation. Operations:

* ``{"op": "put", "hlen": L, "run": R}`` then the shard's header as its owner wrote it (L bytes),
  its data (the header's ``nbytes``, straight from the owner's slot file by sendfile) and one
  commit byte: 1 keep, 0 drop (the owner's slot changed while it was sent). The server receives
  the data in place (`backups.BackupReceiver`), checks the CRC and answers ``{"ok": true, "path":
  ...}``, ``{"ok": true, "dropped": true}`` or ``{"ok": false, "error": ...}`` (a corrupted shard
  is rejected and nothing is kept). What the agents use.
* ``{"op": "offer", "hlen": L, "run": R}`` then the header (L bytes): a put whose data may not
  have to travel. When this machine holds an identical shard (`twins`: a data-parallel replica's
  own slot of the same step), the server holds the backup as a reference to it and answers as a
  put does, with ``"local": true``; otherwise it answers ``{"ok": true, "send": true}`` and the put goes on
  (data, commit byte, answer). What the agents use; a server without it makes them put.
* ``{"op": "push", "header": H}`` then exactly ``H["nbytes"]`` raw bytes: the same from any
  client that has the header as a JSON object (written to a new file while the CRC is computed).
* ``{"op": "fetch", "rank": r, "step": s | null, "tier": "backup"}`` — the server answers
  ``{"ok": true, "header": H}`` then ``H["nbytes"]`` raw bytes (``step`` null = newest).
* ``{"op": "list"}`` — ``{"ok": true, "steps": {tier: {rank: [steps]}}}``.

Push policy (newest step wins): each (peer, rank) lane sends one shard at a time. A push that is
in flight is always finished — a half-sent shard is worthless, and dropping it whenever a newer
step appears would starve a slow link of any complete backup. Pushes queued behind it are
coalesced: only the newest waits, older ones resolve as ``"superseded"``. The slot's header is
re-read after the data went out: a worker that overwrote its slot meanwhile (a few steps later)
tore the copy, the peer is told to drop it, and the push resolves as ``"stale"``.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from concurrent.futures import Future
from typing import Callable

from stalwart.agent import peerauth
from stalwart.agent.peerframe import (  # noqa: F401  (the frame helpers, importable from here too)
    _STALLED, CHUNK, MAX_FRAME, PeerError, _kernel_timeouts, _recv_chunks, _recv_exact, _recv_frame, _reply_error,
    _send_frame, _send_view,
)
from stalwart.agent.shards import TIERS, ShardStore, receive_shard
from stalwart.worker import memckpt
from stalwart.worker.memckpt import CorruptShard

SERVE_POLL_S = 2.0      # the accept loop's bound on noticing a stop no connection woke


# ----------------------------------------------------------------------------- server

class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: PeerServer = self.server.peer  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        key = srv.key
        if key is not None and not self._authenticate(srv, sock, key):
            return
        _kernel_timeouts(sock, srv.timeout_s)
        # A pusher keeps its connection for the next step's push (`keep: true`); any other
        # request, and any failure, ends the connection after its answer.
        keep = True
        while keep:
            try:
                req = _recv_frame(sock)
            except (ConnectionError, TimeoutError, OSError):
                return                            # the peer closed (or idled out): done
            except Exception as e:                # noqa: BLE001 — reported to the peer
                _reply_error(sock, e)
                return
            keep = req.get("keep") is True and req.get("op") in ("push", "put", "offer")
            try:
                self._one(srv, sock, req)
            except (ConnectionError, *_STALLED):
                return                            # the peer went away or stalled: nothing to answer
            except Exception as e:                # noqa: BLE001 — reported to the peer
                _reply_error(sock, e)
                return

    @staticmethod
    def _authenticate(srv: "PeerServer", sock: socket.socket, key: bytes) -> bool:
        """The handshake (`peerauth`), with small frames and a short deadline; False: refused."""
        _kernel_timeouts(sock, peerauth.AUTH_TIMEOUT_S)
        try:
            first = _recv_frame(sock, peerauth.AUTH_FRAME)
            peerauth.server(key, first, lambda o: _send_frame(sock, o),
                            lambda: _recv_frame(sock, peerauth.AUTH_FRAME))
            return True
        except peerauth.AuthError:
            srv.refused += 1
            return False
        except Exception as e:             # noqa: BLE001 — a malformed or stalled handshake
            srv.refused += 1
            _reply_error(sock, e)
            return False

    def _one(self, srv: "PeerServer", sock: socket.socket, req: dict) -> None:
        op = req.get("op")
        if op in ("put", "offer"):
            self._put(srv, sock, req)
        elif op == "push":
            self._push(srv, sock, req)
        elif op == "fetch":
            self._fetch(srv, sock, req)
        elif op == "list":
            steps = srv.store.available_steps(verify=False)
            _send_frame(sock, {"ok": True, "steps": {t: {str(r): s for r, s in d.items()}
                                                     for t, d in steps.items()}})
        else:
            raise ValueError(f"unknown op {op!r}")

    @staticmethod
    def _push(srv: "PeerServer", sock: socket.socket, req: dict) -> None:
        hdr = req.get("header")
        if not isinstance(hdr, dict) or not isinstance(hdr.get("nbytes"), int):
            raise ValueError("push without a valid header")
        n = hdr["nbytes"]
        if n < 0 or n > srv.max_shard_bytes:
            raise ValueError(f"shard of {n} bytes refused (limit {srv.max_shard_bytes})")
        try:
            path = srv.store.put_backup(hdr, _recv_chunks(sock, n))
        except CorruptShard as e:
            srv.rejected += 1
            _reply_error(sock, e)
            return
        srv.received += 1
        if srv.on_stored is not None:
            srv.on_stored(hdr, req.get("run"))
        _send_frame(sock, {"ok": True, "path": path})

    @staticmethod
    def _put(srv: "PeerServer", sock: socket.socket, req: dict) -> None:
        hlen = req.get("hlen")
        if not isinstance(hlen, int) or not 0 < hlen <= MAX_FRAME:
            raise ValueError("put without a valid header length")
        raw = _recv_exact(sock, hlen)
        offer = req.get("op") == "offer"
        fields = memckpt.header_fields(raw, meta=not offer)   # (an offer held by reference needs no meta)
        if fields["nbytes"] > srv.max_shard_bytes:
            raise ValueError(f"shard of {fields['nbytes']} bytes refused (limit {srv.max_shard_bytes})")
        if offer:
            if srv.store.twins.offer(raw, fields):
                srv.received += 1
                srv.filled += 1
                if srv.on_stored is not None:
                    srv.on_stored({"rank": fields["rank"], "step": fields["step"]}, req.get("run"))
                path = memckpt.step_base(srv.store.backup_dir, fields["rank"], fields["step"]) + ".hdr"
                _send_frame(sock, {"ok": True, "path": path, "local": True})
                return
            fields = memckpt.header_fields(raw)
            _send_frame(sock, {"ok": True, "send": True})
        try:
            path = srv.store.receiver.receive(raw, fields, sock)
        except CorruptShard as e:
            srv.rejected += 1
            _reply_error(sock, e)
            return
        if path is None:
            _send_frame(sock, {"ok": True, "dropped": True})
            return
        srv.received += 1
        if srv.on_stored is not None:
            srv.on_stored({"rank": fields["rank"], "step": fields["step"]}, req.get("run"))
        _send_frame(sock, {"ok": True, "path": path})

    @staticmethod
    def _fetch(srv: "PeerServer", sock: socket.socket, req: dict) -> None:
        rank, step, tier = req.get("rank"), req.get("step"), req.get("tier", "backup")
        if not isinstance(rank, int) or (step is not None and not isinstance(step, int)) or tier not in TIERS:
            raise ValueError(f"bad fetch request {req!r}")
        if step is None:
            held = srv.store.steps(tier, verify=True).get(rank)
            if not held:
                raise FileNotFoundError(f"no valid shard of rank {rank} in tier {tier}")
            step = held[-1]
        path = srv.store.fetch(rank, step, tier)
        hdr, view = memckpt.encode_shard(path)
        try:
            _send_frame(sock, {"ok": True, "header": hdr})
            _send_view(sock, view)
        finally:
            view.release()


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class PeerServer:
    """Receives peers' shards into `store`'s backup tier and serves shards back on request."""

    def __init__(self, host: str, port: int, store: ShardStore, timeout_s: float = 60.0,
                 max_shard_bytes: int = 1 << 40,
                 on_stored: Callable[[dict, int | None], None] | None = None, key: bytes | None = None):
        """`on_stored(header, run)`: a pushed shard is stored and verified (`run`: the run the
        pusher said made it, or None). `key`: the job's checkpoint key every connection must
        prove it holds (settable: a new job's); None serves anyone (a standalone server)."""
        self.key = key
        self.refused = 0           # connections that did not authenticate
        self.store = store
        self.timeout_s = timeout_s
        self.max_shard_bytes = max_shard_bytes
        self.received = 0
        self.filled = 0            # of them, held as references to identical local shards (twins)
        self.rejected = 0
        self.on_stored = on_stored
        self._srv = _TCPServer((host, port), _Handler)
        self._srv.peer = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound (useful with port 0)."""
        host, port = self._srv.server_address[:2]
        return host, port

    def start(self) -> "PeerServer":
        """Serve in a background thread. It sleeps until a peer connects (`stop` wakes it by
        connecting), not polling ten times a second as socketserver's default does."""
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": SERVE_POLL_S},
                                        name="peerxfer-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close the socket and join the serving thread."""
        if self._thread is not None:
            # `shutdown` asks the loop to end and waits; a connection wakes the loop to see it
            # (until it has: the first may come before the request)
            quit_ = threading.Thread(target=self._srv.shutdown, name="peerxfer-stop", daemon=True)
            quit_.start()
            deadline = time.monotonic() + 5.0
            while quit_.is_alive() and time.monotonic() < deadline:
                try:
                    socket.create_connection(self.address, timeout=1.0).close()
                except OSError:
                    pass
                quit_.join(0.05)
            self._thread.join(timeout=5)
            self._thread = None
        self._srv.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ----------------------------------------------------------------------------- client

LANE_IDLE_S = 5.0       # a push lane's thread and connection wait this long for the next step's push


class _Lane:
    def __init__(self, lock: threading.Lock):
        self.cv = threading.Condition(lock)        # its thread waits here for its next push
        self.pending: tuple[int, str, Future, int | None] | None = None
        self.busy = False
        self.sock: socket.socket | None = None    # kept for the next push (one per step)
        self.maps: dict[str, tuple[tuple[int, int], mmap.mmap]] = {}   # slot data path -> its mapping
        self.active = False                        # a push is being sent
        self.offer = True                          # offer each shard first (the peer may hold it)

    def view(self, path: str, n: int) -> memoryview | None:
        """The first `n` bytes of the slot file at `path`, from a mapping kept while the file is the
        same (a slot is rewritten in place: mapping it again each step cost page faults); None
        when the file is gone or shorter."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if st.st_size < n:
            return None
        if n == 0:
            return memoryview(b"")
        kept = self.maps.get(path)
        if kept is None or kept[0] != (st.st_ino, st.st_size):
            if kept is not None:
                kept[1].close()
            try:
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), st.st_size, prot=mmap.PROT_READ)
            except (FileNotFoundError, ValueError):
                return None
            kept = self.maps[path] = ((st.st_ino, st.st_size), mm)
        return memoryview(kept[1])[:n]

    def unmap(self) -> None:
        for _, mm in self.maps.values():
            try:
                mm.close()
            except BufferError:          # (a view still out: the mapping goes with it)
                pass
        self.maps.clear()

    def drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


class PushFuture(Future):
    """A push's future; `cpu_s`: the CPU seconds its sending took on the lane's thread (0.0 for a
    push that did not run: superseded, or failed)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_s = 0.0


class PeerClient:
    """Pushes own shards to backup peers (background, newest step wins) and fetches them back."""

    def __init__(self, timeout_s: float = 60.0, chunk_bytes: int = CHUNK, key: bytes | None = None):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.key = key             # the job's checkpoint key (`peerauth`); None: no handshake
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._lanes: dict[tuple, _Lane] = {}
        # one lock; each lane's thread waits on its own condition (a push wakes the one lane it
        # is for, not every lane of the machine), `flush` on this one
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._closed = False

    def _connect(self, addr: tuple[str, int], kernel_timeouts: bool = False) -> socket.socket:
        sock = socket.create_connection(tuple(addr), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = self.key
        if key is not None:
            try:
                peerauth.client(key, lambda o: _send_frame(sock, o), lambda: _recv_frame(sock, peerauth.AUTH_FRAME))
            except BaseException as e:
                sock.close()
                if isinstance(e, peerauth.AuthError):
                    raise PeerError(f"peer {addr[0]}:{addr[1]}: {e}") from None
                raise
        if kernel_timeouts:
            _kernel_timeouts(sock, self.timeout_s)
        return sock

    # -- push
    def push(self, addr: tuple[str, int], rank: int, step: int, slot_path: str,
             run: int | None = None) -> PushFuture:
        """Queue a push of the shard at `slot_path` (rank, step) to the peer at `addr`.

        Returns a Future: "sent" once the peer stored and verified it, "superseded" when a newer
        step replaced it in the queue, "stale" when the slot was overwritten before it was copied;
        it raises PeerError (or OSError) when the peer rejected it or could not be reached. Its
        `cpu_s` is the sending's CPU time, set before the result (what backup pacing measures).
        """
        fut = PushFuture()
        key = (tuple(addr), rank)
        with self._cv:
            if self._closed:
                raise RuntimeError("PeerClient is closed")
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(self._lock)
            old = lane.pending
            if old is not None and old[0] > step:
                fut.set_result("superseded")
                return fut
            lane.pending = (step, slot_path, fut, run)
            if old is not None:
                old[2].set_result("superseded")
            if not lane.busy:
                lane.busy = True
                t = threading.Thread(target=self._run_lane, args=(key, lane), daemon=True,
                                     name=f"peerxfer-push-r{rank}")
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
                t.start()
            lane.cv.notify()
        return fut

    def _run_lane(self, key: tuple, lane: _Lane) -> None:
        """One lane's pushes, newest first; the thread and its connection stay a while for the
        next step's push (a thread and a TCP connection per step cost more CPU than the copy)."""
        while True:
            with self._cv:
                if lane.pending is None and not self._closed:
                    lane.cv.wait_for(lambda: lane.pending is not None or self._closed, LANE_IDLE_S)
                if lane.pending is None:
                    lane.drop()                   # (under the lock: a new lane thread may start next)
                    lane.unmap()
                    lane.busy = False
                    self._cv.notify_all()
                    return
                step, path, fut, run = lane.pending
                lane.pending, lane.active = None, True
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        cpu0 = time.thread_time()
                        sent = self._send(key[0], key[1], step, path, lane, run)
                        fut.cpu_s = time.thread_time() - cpu0
                        fut.set_result(sent)
                    except BaseException as e:    # noqa: BLE001 — handed to the caller's future
                        lane.drop()
                        fut.set_exception(e)
            finally:
                with self._cv:
                    lane.active = False
                    self._cv.notify_all()         # (flush: nothing queued, nothing in flight)

    def _send(self, addr, rank: int, step: int, path: str, lane: _Lane, run: int | None = None) -> str:
        # The header travels as read (not parsed: tens of KB of JSON for a small model's optimizer
        # state) and the data straight from the slot's file (sendfile: no copy through this
        # process); the header's bytes re-read after the send say whether the worker overwrote
        # the slot meanwhile (a seqlock), and the last byte tells the peer to keep or drop it.
        raw = memckpt.read_header_bytes(path)
        if raw is None:
            return "stale"
        try:
            fields = memckpt.header_fields(raw, meta=False)
        except CorruptShard:
            return "stale"
        if fields["rank"] != rank or fields["step"] != step:
            return "stale"
        n = fields["nbytes"]
        view = lane.view(memckpt.base_of(path) + ".data", n)
        if view is None:
            return "stale"
        offer = lane.offer
        with view:
            frame = b'{"op":"%s","keep":true,"run":%s,"hlen":%d}' % (
                b"offer" if offer else b"put", json.dumps(run).encode(), len(raw))
            for attempt in (0, 1):
                reused = lane.sock is not None
                if lane.sock is None:
                    lane.sock = self._connect(addr, kernel_timeouts=True)
                try:
                    lane.sock.sendall(struct.pack(">I", len(frame)) + frame + raw)
                    # an offer's answer says whether the data must travel (see `twins`)
                    reply = _recv_frame(lane.sock) if offer else {"send": True}
                    if reply.get("send"):
                        if n:
                            lane.sock.sendall(view)
                        current = memckpt.still_current_raw(path, raw)
                        lane.sock.sendall(b"\x01" if current else b"\x00")
                        reply = _recv_frame(lane.sock)
                    break
                except _STALLED as e:
                    lane.drop()                   # a stalled peer: not twice the wait
                    raise TimeoutError(f"peer {addr[0]}:{addr[1]} stalled: {e}") from None
                except OSError:
                    lane.drop()
                    if not reused or attempt:
                        raise
                    # the peer closed the kept connection meanwhile (it idled out, or restarted): once more
        if not reply.get("ok") and offer and "unknown op" in str(reply.get("error")):
            lane.drop()                           # a peer of an older version: it takes puts
            lane.offer = False
            return self._send(addr, rank, step, path, lane, run)
        if not reply.get("ok"):
            lane.drop()
            raise PeerError(f"peer {addr[0]}:{addr[1]} rejected rank {rank} step {step}: {reply.get('error')}")
        return "stale" if reply.get("dropped") else "sent"

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no push is queued or in flight; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not any(lane.pending is not None or lane.active
                                                     for lane in self._lanes.values()), timeout)

    # -- fetch
    def _open_fetch(self, addr, rank: int, step: int | None, tier: str) -> tuple[socket.socket, dict]:
        sock = self._connect(addr)
        try:
            _send_frame(sock, {"op": "fetch", "rank": rank, "step": step, "tier": tier})
            reply = _recv_frame(sock)
            if not reply.get("ok"):
                raise PeerError(f"peer {addr[0]}:{addr[1]} cannot serve rank {rank} step {step}: "
                                f"{reply.get('error')}")
            return sock, reply["header"]
        except BaseException:
            sock.close()
            raise

    def fetch(self, addr, rank: int, step: int | None, dest_dir: str, tier: str = "backup") -> str:
        """Pull a shard from a peer into `dest_dir` (checksum verified); returns its header path."""
        sock, hdr = self._open_fetch(addr, rank, step, tier)
        with sock:
            return receive_shard(dest_dir, hdr, _recv_chunks(sock, hdr["nbytes"], self.chunk_bytes))

    def fetch_bytes(self, addr, rank: int, step: int | None = None, tier: str = "backup") -> tuple[dict, bytearray]:
        """Pull a shard from a peer into memory: (header, data), checksum verified (CorruptShard)."""
        sock, hdr = self._open_fetch(addr, rank, step, tier)
        with sock:
            data = bytearray(hdr["nbytes"])
            pos = 0
            for chunk in _recv_chunks(sock, hdr["nbytes"], self.chunk_bytes):
                data[pos:pos + len(chunk)] = chunk
                pos += len(chunk)
        if memckpt.checksum(hdr, data) != hdr["checksum"]:
            raise CorruptShard(f"rank {rank} step {hdr['step']} from {addr}: checksum mismatch")
        return hdr, data

    def list(self, addr) -> dict[str, dict[int, list[int]]]:
        """The peer's tiers: tier -> rank -> steps (complete, not re-verified)."""
        with self._connect(addr) as sock:
            _send_frame(sock, {"op": "list"})
            reply = _recv_frame(sock)
        if not reply.get("ok"):
            raise PeerError(f"peer {addr}: {reply.get('error')}")
        return {t: {int(r): s for r, s in d.items()} for t, d in reply["steps"].items()}

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued pushes (bounded by `timeout`) and refuse new ones."""
        with self._cv:
            self._closed = True
            for lane in self._lanes.values():
                lane.cv.notify()                  # idle lanes leave now
        self.flush(timeout)
        for t in self._threads:
            t.join(timeout=max(0.0, timeout))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv: list[str] | None = None) -> int:
    """Run a PeerServer until SIGTERM/SIGINT: ``python -m stalwart.agent.peerxfer --backup-dir D``."""
    ap = argparse.ArgumentParser(description="Serve checkpoint shard backups to and from peers.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--shm-dir", default=None, help="own shards written by this machine's workers")
    ap.add_argument("--backup-dir", required=True)
    ap.add_argument("--durable-dir", default=None)
    ap.add_argument("--keep-backup", type=int, default=2)
    ap.add_argument("--key-file", default=None, help="the job's checkpoint key (32 bytes); without it "
                                                     "anyone who reaches the port may use it")
    args = ap.parse_args(argv)
    key = memckpt.read_key(args.key_file) if args.key_file else None
    store = ShardStore(args.shm_dir or args.backup_dir + "/.own", args.backup_dir, args.durable_dir,
                       keep_backup=args.keep_backup)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with PeerServer(args.host, args.port, store, key=key) as srv:
        print(f"listening {srv.address[0]} {srv.address[1]}", flush=True)
        while not stop.wait(0.5):
            pass
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
