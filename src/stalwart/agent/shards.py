"""The agent's checkpoint shard store: three tiers of one machine's view of the checkpoint.

* ``own``     — the round-robin slots its workers write in shared memory (`MemCheckpointer`).
* ``backup``  — shards of other machines' ranks received from peers (`PeerServer`), one file pair
  per step in ``backup_dir`` (put it on /dev/shm to keep them in memory), newest `keep_backup` kept.
* ``durable`` — every K steps, `persist` copies a shard to a local directory or any fsspec URL.

All tiers use the shard format of `stalwart.worker.memckpt` (``.data`` + JSON ``.hdr``, header
last). Checksums are verified when listing (cached per header version) and on every transfer.
"""
from __future__ import annotations

import json
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

import fsspec

from stalwart.agent.backups import BackupReceiver
from stalwart.agent.twins import LocalTwins
from stalwart.worker import memckpt
from stalwart.worker.memckpt import CorruptShard

TIERS = ("own", "backup", "durable")
_CHUNK = 4 << 20


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")


def _name(rank: int, step: int) -> str:
    return os.path.basename(memckpt.step_base("", rank, step))


def receive_shard(dir: str, hdr: dict, chunks: Iterable, keep: int | None = None) -> str:
    """Write a shard (header + data chunks) into `dir` as a per-step shard; returns its header path.

    The CRC is computed while writing; on mismatch or short data nothing is kept and CorruptShard
    is raised. With `keep`, older steps of the same rank beyond the newest `keep` are deleted.
    """
    for k in ("rank", "step", "nbytes", "checksum", "meta"):
        if k not in hdr:
            raise ValueError(f"shard header lacks {k!r}")
    rank, step, n = int(hdr["rank"]), int(hdr["step"]), int(hdr["nbytes"])
    if rank < 0 or step < 0 or n < 0:
        raise ValueError(f"bad shard header: rank {rank} step {step} nbytes {n}")
    os.makedirs(dir, mode=0o700, exist_ok=True)
    memckpt.check_free(dir, n, f"rank {rank} step {step}")
    base = memckpt.step_base(dir, rank, step)
    tmp = f"{base}.data.tmp.{uuid.uuid4().hex}"
    s, got = memckpt.summer(hdr.get("hash")), 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as f:
            for chunk in chunks:
                if got + len(chunk) > n:
                    raise CorruptShard(f"rank {rank} step {step}: more than {n} bytes received")
                s.update(chunk)
                f.write(chunk)
                got += len(chunk)
        if got != n:
            raise CorruptShard(f"rank {rank} step {step}: {got} of {n} bytes received")
        s.update(memckpt.meta_bytes(hdr))
        if s.intdigest() != hdr["checksum"]:
            raise CorruptShard(f"rank {rank} step {step}: checksum {s.intdigest():x} != {hdr['checksum']:x}")
        try:
            os.unlink(base + ".hdr")
        except FileNotFoundError:
            pass
        os.replace(tmp, base + ".data")
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    out = dict(hdr, complete=1, format=memckpt.FORMAT)
    memckpt.write_header(base, out)
    if keep is not None:
        prune(dir, rank, keep)
    return base + ".hdr"


def prune(dir: str, rank: int, keep: int) -> None:
    """Delete all but the newest `keep` per-step shards of `rank` in `dir` (header first). The
    steps come from the names (a header is there only once its shard is complete): parsing every
    header of the directory on each received shard was most of a backup's cost."""
    shards = memckpt.step_shards(dir, rank)
    for _, path in shards[:-keep]:
        b = memckpt.base_of(path)
        for ext in (".hdr", ".data"):          # header first: never a header without data
            try:
                os.unlink(b + ext)
            except FileNotFoundError:
                pass


class ShardStore:
    """Lists, validates, receives and persists the checkpoint shards held by one agent."""

    def __init__(self, shm_dir: str, backup_dir: str, durable_dir: str | None = None,
                 keep_backup: int = 2, keep_durable: int | None = None):
        if keep_backup < 1:
            raise ValueError(f"keep_backup must be >= 1, got {keep_backup}")
        if keep_durable is not None and keep_durable < 1:
            raise ValueError(f"keep_durable must be >= 1 or None, got {keep_durable}")
        self.shm_dir = shm_dir
        self.backup_dir = backup_dir
        self.durable_dir = durable_dir
        self.keep_backup = keep_backup
        self.keep_durable = keep_durable
        os.makedirs(backup_dir, mode=0o700, exist_ok=True)
        self._fs, self._root = (fsspec.core.url_to_fs(durable_dir) if durable_dir else (None, None))
        if self._fs is not None:
            self._fs.makedirs(self._root, exist_ok=True)
        self.receiver = BackupReceiver(backup_dir, keep_backup)
        # peers' backups held as references to identical own shards (DP replicas): made into
        # ordinary files before anything reads the backup tier
        self.twins = LocalTwins(shm_dir, self.receiver)
        self._valid: dict[tuple, bool] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-persist")

    # ------------------------------------------------------------------ listing / validation
    def _local_shards(self, tier: str) -> list[tuple[int, int, str]]:
        if tier == "own":
            return memckpt.list_shards(self.shm_dir)
        self.twins.materialize()
        return memckpt.list_shards(self.backup_dir)

    def _valid_local(self, path: str) -> bool:
        try:
            st = os.stat(path)
            dst = os.stat(memckpt.base_of(path) + ".data")
            hdr = memckpt.read_header(path)
        except FileNotFoundError:
            return False
        if hdr is None:
            return False
        # a new commit replaces the header (new inode); a write() to the data changes its mtime
        key = (path, st.st_ino, st.st_mtime_ns, dst.st_mtime_ns, dst.st_size, hdr["step"], hdr["checksum"])
        with self._lock:
            hit = self._valid.get(key)
        if hit is None:
            try:
                memckpt.verify_shard(path)
                hit = memckpt.still_current(path, hdr)   # overwritten while verifying: not valid
            except CorruptShard:
                hit = False
            with self._lock:
                self._valid[key] = hit
        return hit

    def _durable_shards(self) -> list[tuple[int, int, str]]:
        out = []
        for p in self._fs.ls(self._root, detail=False):
            parsed = memckpt.parse_name(os.path.basename(p))
            if parsed and parsed[1] == "step":
                out.append((parsed[0], parsed[2], p))
        out.sort()
        return out

    def newest_durable(self, ranks: Iterable[int]) -> dict[int, tuple[int, str]]:
        """rank -> (step, header location) of its newest complete durable copy, for those of
        `ranks` that have one (the durable store listed once)."""
        wanted, best = set(ranks), {}
        if self._fs is None:
            return best
        for r, step, path in self._durable_shards():        # sorted: the newest last
            if r in wanted and self._valid_durable(path, verify=False):
                best[r] = (step, path)
        return best

    def _durable_header(self, path: str) -> dict | None:
        try:
            hdr = json.loads(self._fs.cat_file(path))
        except (FileNotFoundError, ValueError):
            return None
        return hdr if hdr.get("complete") == 1 and hdr.get("format") == memckpt.FORMAT else None

    def _valid_durable(self, path: str, verify: bool) -> bool:
        hdr = self._durable_header(path)
        if hdr is None:
            return False
        data = memckpt.base_of(path) + ".data"
        try:
            info = self._fs.info(data)
        except FileNotFoundError:
            return False
        size = info.get("size") or 0
        if size < hdr["nbytes"] or not verify:
            return size >= hdr["nbytes"]
        # whatever the filesystem reports (size, mtime, etag…) identifies this version of the data
        key = ("durable", path, hdr["step"], hdr["checksum"], tuple(sorted((k, str(v)) for k, v in info.items())))
        with self._lock:
            hit = self._valid.get(key)
        if hit is None:
            s = memckpt.summer(hdr.get("hash"))
            with self._fs.open(data, "rb") as f:
                left = hdr["nbytes"]
                while left:
                    chunk = f.read(min(_CHUNK, left))
                    if not chunk:
                        break
                    s.update(chunk)
                    left -= len(chunk)
            s.update(memckpt.meta_bytes(hdr))
            hit = left == 0 and s.intdigest() == hdr["checksum"]
            with self._lock:
                self._valid[key] = hit
        return hit

    def steps(self, tier: str, verify: bool = True) -> dict[int, list[int]]:
        """rank -> sorted steps held complete (and, with `verify`, checksum-valid) in one tier."""
        _check_tier(tier)
        out: dict[int, list[int]] = {}
        if tier == "durable":
            if self._fs is None:
                return out
            for rank, step, path in self._durable_shards():
                if self._valid_durable(path, verify):
                    out.setdefault(rank, []).append(step)
            return out
        for rank, step, path in self._local_shards(tier):
            if not verify or self._valid_local(path):
                out.setdefault(rank, []).append(step)
        for v in out.values():
            v.sort()
        return out

    def available_steps(self, verify: bool = True) -> dict[str, dict[int, list[int]]]:
        """tier -> rank -> sorted steps complete and valid, for the tiers own, backup and durable."""
        return {tier: self.steps(tier, verify) for tier in TIERS}

    # ------------------------------------------------------------------ fetch
    def fetch(self, rank: int, step: int, tier: str) -> str:
        """Local header path of a valid shard of (rank, step) in `tier`; durable shards are downloaded.

        Raises FileNotFoundError when the tier has no such shard, CorruptShard when it is invalid.
        An own slot is overwritten a few steps later by its worker: fetch it while workers are stopped
        or copy it at once (`memckpt.load` re-verifies the checksum).
        """
        _check_tier(tier)
        if tier == "durable":
            return self._download(rank, step)
        for r, s, path in self._local_shards(tier):
            if (r, s) == (rank, step):
                memckpt.verify_shard(path)
                return path
        raise FileNotFoundError(f"no shard of rank {rank} step {step} in tier {tier}")

    def locate(self, rank: int, step: int) -> tuple[str, str]:
        """(tier, local path) of the first valid copy of (rank, step), trying own, backup, durable."""
        errors = []
        for tier in TIERS:
            try:
                return tier, self.fetch(rank, step, tier)
            except (FileNotFoundError, CorruptShard) as e:
                errors.append(f"{tier}: {e}")
        raise FileNotFoundError(f"rank {rank} step {step} not found in any tier ({'; '.join(errors)})")

    def _download(self, rank: int, step: int) -> str:
        if self._fs is None:
            raise FileNotFoundError("no durable tier configured")
        src = self._root.rstrip("/") + "/" + _name(rank, step)
        hdr = self._durable_header(src + ".hdr")
        if hdr is None:
            raise FileNotFoundError(f"no shard of rank {rank} step {step} in tier durable")

        def chunks():
            with self._fs.open(src + ".data", "rb") as f:
                while True:
                    b = f.read(_CHUNK)
                    if not b:
                        return
                    yield b
        return receive_shard(os.path.join(self.backup_dir, ".durable"), hdr, chunks(), keep=self.keep_backup)

    # ------------------------------------------------------------------ receive (backup tier)
    def put_backup(self, hdr: dict, chunks: Iterable) -> str:
        """Store a shard received from a peer (header + data chunks) in the backup tier.

        The CRC is computed while writing; on mismatch or short data nothing is kept and
        CorruptShard is raised. Older steps of the same rank beyond `keep_backup` are deleted.
        """
        return receive_shard(self.backup_dir, hdr, chunks, keep=self.keep_backup)

    # ------------------------------------------------------------------ persist (durable tier)
    def persist(self, rank: int, step: int, or_newer: bool = False) -> Future:
        """Copy (rank, step) from own or backup to the durable tier in the background.

        Returns a Future resolving to the durable header URL. The copy is staged in memory and
        checked (CRC, and that an own slot was not overwritten meanwhile) before upload; data goes
        to a temp name then is renamed, and the header is written last the same way. With
        `or_newer`, a step whose slot was overwritten before the copy began is replaced by the
        oldest newer step still held (a busy machine then makes a later step durable, not none).
        """
        if self._fs is None:
            raise ValueError("persist needs a durable_dir")
        return self._pool.submit(self._persist, rank, step, or_newer)

    def _stage(self, rank: int, step: int, or_newer: bool = False) -> tuple[dict, bytes, bytes]:
        try:
            return self._stage_exact(rank, step)
        except FileNotFoundError:
            if not or_newer:
                raise
        for s in sorted(s for r, s, _ in self._local_shards("own") if r == rank and s > step):
            try:
                return self._stage_exact(rank, s)
            except FileNotFoundError:      # overwritten meanwhile too: try the next one
                continue
        raise FileNotFoundError(f"rank {rank}: neither step {step} nor a newer one is held")

    def _stage_exact(self, rank: int, step: int) -> tuple[dict, bytes, bytes]:
        """(the header's fields, its bytes as written, a private copy of the data), checked.
        The header is not parsed (tens of KB of JSON for a small model's optimizer state, three
        times a copy, was most of the persist thread's time): `header_fields` finds what the
        check needs, and the bytes go to the durable tier as they are."""
        for tier in ("own", "backup"):
            for r, s, path in self._local_shards(tier):
                if (r, s) != (rank, step):
                    continue
                raw = memckpt.read_header_bytes(path)
                if raw is None:
                    continue
                fields = memckpt.header_fields(raw)
                view = memckpt.map_data(path, fields["nbytes"])
                try:
                    data = bytes(view)
                finally:
                    view.release()
                if not memckpt.still_current_raw(path, raw):
                    continue
                sm = memckpt.summer(fields["hash"])
                if data:
                    sm.update(data)
                sm.update(fields["meta"])
                if sm.intdigest() != fields["checksum"]:
                    raise CorruptShard(f"{path}: checksum mismatch, not persisting it")
                return fields, raw, data
        raise FileNotFoundError(f"rank {rank} step {step} is in neither the own nor the backup tier")

    def _persist(self, rank: int, step: int, or_newer: bool = False) -> str:
        fields, raw, data = self._stage(rank, step, or_newer)
        base = self._root.rstrip("/") + "/" + _name(rank, int(fields["step"]))
        tag = uuid.uuid4().hex
        with self._fs.open(f"{base}.data.tmp.{tag}", "wb") as f:
            mv = memoryview(data)
            for i in range(0, len(mv), _CHUNK):
                f.write(mv[i:i + _CHUNK])
        self._fs.mv(f"{base}.data.tmp.{tag}", base + ".data")
        self._fs.pipe_file(f"{base}.hdr.tmp.{tag}", raw)
        self._fs.mv(f"{base}.hdr.tmp.{tag}", base + ".hdr")
        if int(fields["step"]) != step:
            self._drop_durable(rank, step)
        if self.keep_durable is not None:
            mine = [p for r, _, p in self._durable_shards() if r == rank]
            for p in mine[:-self.keep_durable]:
                b = memckpt.base_of(p)
                for ext in (".hdr", ".data"):
                    if self._fs.exists(b + ext):
                        self._fs.rm(b + ext)
        return base + ".hdr"

    def _drop_durable(self, rank: int, step: int) -> None:
        """A durable copy of (rank, step) that this run will never replace goes: it is an earlier
        run's (a restore went back before it, as after a NaN), and its step number would pass it
        for this run's once the controller holds the step good again. (A run persists each step of
        a rank once; when its copy of `step` was lapped, a newer step went in its place.) The
        header goes first: a shard is complete only while its header exists."""
        stale = self._root.rstrip("/") + "/" + _name(rank, step)
        for ext in (".hdr", ".data"):
            if self._fs.exists(stale + ext):
                self._fs.rm(stale + ext)

    def drain(self) -> None:
        """Wait for the persists queued so far, and for their done callbacks (they run on the
        persist thread as each copy ends, before it takes the next)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for pending persists and stop the background thread."""
        self._pool.shutdown(wait=True)
        self.receiver.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
