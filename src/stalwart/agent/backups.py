"""The receiving end of peers' backups: each arrives straight into a recycled, already mapped file.

A backup comes every step for every rank of the peer machine. Writing each into a new tmpfs file
(allocating its pages, copying from a receive buffer, then freeing a pruned step's pages) cost
more CPU in the kernel than the transfer itself. Here a rank's pruned data files are kept and
reused: the next step's bytes are received from the socket directly into the mapping of a file
whose pages exist already (one copy, no allocation), checked against the header's checksum and
published under the step's usual name (`memckpt.step_base`), header last. The tier's format on
disk is unchanged: every reader (listing, fetch, verify, restore) sees ordinary per-step shards.
"""
from __future__ import annotations

import mmap
import os
import socket
import threading
import uuid
from typing import Callable

from stalwart.worker import memckpt
from stalwart.worker.memckpt import CorruptShard


def recv_into_all(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock` exactly; ConnectionError when the peer closes first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k


class _Spare:
    """A data file no shard names any more, with its mapping kept."""

    def __init__(self, path: str):
        self.path = path
        self.mm: mmap.mmap | None = None
        self.size = 0

    def fit(self, n: int) -> memoryview:
        """A writable view of exactly `n` bytes of the file (resized and mapped again if needed)."""
        if self.mm is None or self.size != n:
            if self.mm is not None:
                self.mm.close()
                self.mm = None
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, n)
                self.mm = mmap.mmap(fd, n) if n else None
            finally:
                os.close(fd)
            self.size = n
        return memoryview(self.mm) if self.mm is not None else memoryview(b"")

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None


class BackupReceiver:
    """Receives shards into `dir`, keeping the newest `keep` steps of each rank."""

    def __init__(self, dir: str, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir, self.keep = dir, keep
        os.makedirs(dir, mode=0o700, exist_ok=True)
        for name in os.listdir(dir):          # a crashed agent's recycled files: memory, nothing else
            if name.startswith(".spare."):
                try:
                    os.unlink(os.path.join(dir, name))
                except FileNotFoundError:
                    pass
        self._lock = threading.Lock()
        self._spares: dict[int, list[_Spare]] = {}      # rank -> recycled data files
        self._mapped: dict[str, _Spare] = {}            # published data path -> its file's mapping

    def _take(self, rank: int) -> _Spare:
        with self._lock:
            pool = self._spares.get(rank)
            if pool:
                return pool.pop()
        return _Spare(os.path.join(self.dir, f".spare.rank{rank:05d}.{uuid.uuid4().hex}"))

    def _give(self, rank: int, spare: _Spare) -> None:
        with self._lock:
            self._spares.setdefault(rank, []).append(spare)

    def receive(self, raw_header: bytes, fields: dict, sock: socket.socket) -> str | None:
        """Receive `fields["nbytes"]` bytes of the shard `raw_header` describes from `sock` and
        publish it; returns its header path, or None when the sender then says the copy is not
        to be kept (its slot was overwritten while it sent: a torn copy). Raises CorruptShard on
        a checksum mismatch (nothing is published), ConnectionError when the peer goes away."""
        def from_peer(view: memoryview) -> bool:
            recv_into_all(sock, view)
            return _recv_commit(sock)
        return self._land(raw_header, fields, from_peer)

    def fill(self, raw_header: bytes, fields: dict, src: str) -> str | None:
        """Publish the shard `raw_header` describes with its data copied from the local shard at
        `src` (identical bytes: `twins.LocalTwins`); its header path, or None when `src` is gone
        or its copy does not match the header's checksum (overwritten meanwhile)."""
        def from_src(view: memoryview) -> bool:
            try:
                fd = os.open(memckpt.base_of(src) + ".data", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return False
            try:              # (one copy, kernel to this file's pages; no mapping of the source)
                got, n = 0, len(view)
                while got < n:
                    k = os.preadv(fd, [view[got:]], got)
                    if k == 0:
                        return False
                    got += k
                return True
            finally:
                os.close(fd)
        try:
            return self._land(raw_header, fields, from_src)
        except CorruptShard:
            return None

    def _land(self, raw_header: bytes, fields: dict, write: Callable[[memoryview], bool]) -> str | None:
        """Into a recycled file of the rank: `write` fills a view of exactly `nbytes` (False:
        nothing to keep, None is returned); the bytes are checked against the header's checksum
        (CorruptShard, nothing published) and published; returns the header path."""
        rank, step, n = fields["rank"], fields["step"], fields["nbytes"]
        if rank < 0 or step < 0 or n < 0:
            raise ValueError(f"bad shard header: rank {rank} step {step} nbytes {n}")
        spare = self._take(rank)
        published = False
        try:
            # (a tmpfs short of pages would kill this process by SIGBUS in the middle of a receive)
            memckpt.check_free(self.dir, n - spare.size, f"a backup of rank {rank} step {step}")
            view = spare.fit(n)
            try:
                if not write(view):
                    return None
                s = memckpt.summer(fields["hash"])
                if n:
                    s.update(view)
                s.update(fields["meta"])
            finally:
                view.release()
            if s.intdigest() != fields["checksum"]:
                raise CorruptShard(f"rank {rank} step {step}: checksum {s.intdigest():x} != {fields['checksum']:x}")
            base = memckpt.step_base(self.dir, rank, step)
            self._publish(base, spare, raw_header)
            published = True
            self._prune(rank)
            return base + ".hdr"
        finally:
            if not published:
                self._give(rank, spare)

    def _publish(self, base: str, spare: _Spare, raw_header: bytes) -> None:
        try:
            os.unlink(base + ".hdr")           # (the same step again: never its header over other data)
        except FileNotFoundError:
            pass
        os.replace(spare.path, base + ".data")
        spare.path = base + ".data"
        with self._lock:
            old = self._mapped.pop(spare.path, None)
            self._mapped[spare.path] = spare
        if old is not None and old is not spare:
            old.close()
        memckpt.write_header(base, {}, raw_header)

    def _prune(self, rank: int) -> None:
        """All but the newest `keep` steps of `rank` go: header first, the data file is kept for reuse."""
        for _, path in memckpt.step_shards(self.dir, rank)[:-self.keep]:
            base = memckpt.base_of(path)
            try:
                os.unlink(base + ".hdr")
            except FileNotFoundError:
                pass
            with self._lock:
                spare = self._mapped.pop(base + ".data", None)
            if spare is None:
                spare = _Spare(base + ".data")
            recycled = os.path.join(self.dir, f".spare.rank{rank:05d}.{uuid.uuid4().hex}")
            try:
                os.replace(base + ".data", recycled)
            except FileNotFoundError:
                spare.close()
                continue
            spare.path = recycled
            self._give(rank, spare)

    def close(self) -> None:
        with self._lock:
            spares = [s for pool in self._spares.values() for s in pool] + list(self._mapped.values())
            self._spares.clear()
            self._mapped.clear()
        for s in spares:
            s.close()


def _recv_commit(sock: socket.socket) -> bool:
    """The byte the sender ends a push with: 1 keep, 0 drop (its source changed under the send)."""
    b = sock.recv(1)
    if not b:
        raise ConnectionError("peer closed the connection before the end of a push")
    return b == b"\x01"
