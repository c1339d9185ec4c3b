"""The shard format of every checkpoint tier (own shared-memory slots, peers' backups, durable
copies): file names, headers, checksums, listing and verifying; the writer and reader of a rank's
every-step checkpoint are `memckpt`'s.

* ``<base>.data`` — the tensors' bytes, each at a 64-byte aligned offset; padding bytes are zero.
* ``<base>.hdr``  — JSON: format, step, rank, layout, nbytes, tensors, meta (base64 pickle of the
  state with every tensor replaced by a reference into the data file), hash, complete=1, checksum.

The header is written last, to a temp name then ``os.replace``d, and is unlinked before a slot is
overwritten: a shard is complete exactly when its header exists, and its checksum (of
``data[:nbytes]`` then of the meta bytes, by the header's ``hash``: XXH3-64, twelve times faster
than CRC32 here; a header without ``hash`` was summed with CRC32) says whether the bytes are intact.

Own slots are ``rank{r:05d}.slot{k}.{data,hdr}`` (step s goes to slot s % slots, 2 by default,
the job's ``policy.mem_slots``); other tiers use
``rank{r:05d}.step{s:012d}.{data,hdr}``. A *shard path* is the path of the ``.hdr`` file (the
``.data`` path or the bare base are accepted too).

A shard of a job run under an agent also carries a keyed MAC (the header's ``mac``): keyed
BLAKE3 (the `blake3` package) of the shard's identity (rank, step, nbytes, layout, tensor table),
its data and its meta bytes, under the job's checkpoint key. The checksum finds torn and flipped
bytes; the MAC finds a shard that someone without the key made or changed (a peer's backup, a
durable copy): xxh3 is not keyed, anyone can forge a matching one. The writer is the worker's
commit thread (off the training thread), which reads the key from `key_path(shm_dir)`, a 0600
file the agent writes (the key is never in a worker's environment); the agent verifies the MAC
before it restores a shard. Measured on 8 MiB, one thread, best of 15 (2026-11-27, a 2-core
host under load 16): keyed BLAKE3 3.6 GiB/s, hashlib's keyed BLAKE2b 0.16 GiB/s (xxh3: 36 GiB/s),
hence blake3; it adds 0.6-1.0 ms per step to the commit thread of the bundled GPT's 2.5 MiB
state (0.2-0.3 ms without), on that thread, not the training thread.

Standard library, xxhash and blake3 only: the agent reads shards without loading torch.
"""
from __future__ import annotations

import base64
import hmac
import json
import mmap
import os
import re
import threading
import zlib

import blake3
import xxhash

from stalwart.errors import StalwartError

FORMAT = "stalwart-shard/1"
ALIGN = 64
CRC_CHUNK = 16 << 20
_NAME = re.compile(r"^rank(\d{5})\.(slot\d{1,3}|step\d{12})\.hdr$")


class CorruptShard(StalwartError, RuntimeError):
    """A shard is incomplete, truncated, or fails its checksum."""


# ----------------------------------------------------------------------------- format helpers

def slot_base(dir: str, rank: int, slot: int) -> str:
    """Base path (without extension) of one own slot."""
    return os.path.join(dir, f"rank{rank:05d}.slot{slot}")


def step_base(dir: str, rank: int, step: int) -> str:
    """Base path (without extension) of a per-step shard (backup and durable tiers)."""
    return os.path.join(dir, f"rank{rank:05d}.step{step:012d}")


def base_of(path: str) -> str:
    """Strip ``.hdr`` / ``.data`` from a shard path."""
    for ext in (".hdr", ".data"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def read_header(path: str) -> dict | None:
    """The parsed header of a shard, or None when it is absent or not complete."""
    raw = read_header_bytes(path)
    return _parse_header(raw) if raw is not None else None


def _parse_header(raw: bytes) -> dict | None:
    try:
        hdr = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(hdr, dict) or hdr.get("format") != FORMAT or hdr.get("complete") != 1:
        return None
    return hdr


def _read_small(path: str, limit: int = -1) -> bytes:
    """A small file's bytes (the first `limit`), in four system calls (Python's `open` makes
    seven or more: a terminal check, a seek, reads to the end; per shard, every step)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if limit >= 0:
            return os.read(fd, limit)
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)
        if len(data) > size:                        # (it grew meanwhile: read the rest)
            data += b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
        return data
    finally:
        os.close(fd)


def read_header_bytes(path: str) -> bytes | None:
    """A shard's header as written (not parsed), or None when there is none."""
    try:
        return _read_small(base_of(path) + ".hdr")
    except FileNotFoundError:
        return None


_HEAD = re.compile(rb'^\{"format":"' + re.escape(FORMAT.encode()) + rb'","step":(\d+),"rank":(\d+),')


def header_step_rank(path: str) -> tuple[int, int] | None:
    """(step, rank) of a complete shard from the start of its header alone (a header exists only
    once its shard is complete; parsing a whole one, 30 KB for a small model's optimizer state,
    costs ~0.5 ms); None when there is none. A header laid out otherwise is parsed."""
    try:
        head = _read_small(base_of(path) + ".hdr", 160)
    except FileNotFoundError:
        return None
    m = _HEAD.match(head)
    if m:
        return int(m.group(1)), int(m.group(2))
    hdr = read_header(path)
    return (hdr["step"], hdr["rank"]) if hdr is not None else None


_NBYTES = re.compile(rb'"nbytes":(\d+),"tensors":')
_TAIL = re.compile(rb'(?:"hash":"([a-z0-9_]+)",)?"complete":1,"checksum":(\d+)\}')


def header_fields(raw: bytes, meta: bool = True) -> dict:
    """The fields a backup's receiver needs (step, rank, nbytes, hash, checksum, meta as bytes) from a
    complete header's bytes, without parsing its JSON (tens of KB for a small model's optimizer
    state, on every backup of every step): found where `_encode_header` puts them, else parsed.
    `meta=False` leaves the metadata out (not decoded: what a comparison of shards needs).
    Raises CorruptShard when the bytes are no complete header."""
    head, nbytes = _HEAD.match(raw), _NBYTES.search(raw)
    m0 = raw.find(b'"meta":"')
    m1 = raw.find(b'"', m0 + 8) if m0 >= 0 else -1
    # (the tail is at the end: matched there, not searched for through tens of KB)
    t0 = raw.rfind(b'"complete":1,"checksum":')
    if t0 >= 0:
        h0 = raw.rfind(b'"hash":"', max(0, t0 - 40), t0)
        t0 = h0 if h0 >= 0 else t0
    tail = _TAIL.fullmatch(raw, t0) if t0 >= 0 else None
    if head and nbytes and m1 > m0 >= 0 and tail:
        try:
            algo = tail.group(1).decode() if tail.group(1) else None
            out = {"step": int(head.group(1)), "rank": int(head.group(2)), "nbytes": int(nbytes.group(1)),
                   "hash": algo, "checksum": int(tail.group(2))}
            if meta:
                out["meta"] = base64.b64decode(raw[m0 + 8:m1], validate=True)
            return out
        except ValueError:
            pass
    hdr = _parse_header(raw)
    if hdr is None or not all(isinstance(hdr.get(k), int) for k in ("step", "rank", "nbytes", "checksum")):
        raise CorruptShard("not a complete shard header")
    try:
        out = {"step": hdr["step"], "rank": hdr["rank"], "nbytes": hdr["nbytes"], "hash": hdr.get("hash"),
               "checksum": hdr["checksum"]}
        if meta:
            out["meta"] = meta_bytes(hdr)
        return out
    except (KeyError, ValueError, TypeError):
        raise CorruptShard("a shard header without valid meta") from None


def write_header(base: str, hdr: dict, encoded: bytes | None = None) -> None:
    """Write a header atomically (temp file then rename) — the commit point of a shard.
    `encoded`: the header's JSON already made (`hdr` unused then). Mode 0600: a shard is a
    rank's model and optimizer state."""
    tmp = f"{base}.hdr.tmp.{os.getpid()}.{threading.get_ident()}"
    data = encoded if encoded is not None else json.dumps(hdr, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, base + ".hdr")


_TABLE_MARK = "\x00tensors"


def _encode_header(hdr: dict, table_json: str) -> bytes:
    """`hdr` as JSON with its "tensors" entry given already encoded (the table stays the same
    from step to step: encoding it, tens of KB, each step held the GIL the training thread needs)."""
    text = json.dumps(dict(hdr, tensors=_TABLE_MARK), separators=(",", ":"))
    return text.replace(json.dumps(_TABLE_MARK), table_json, 1).encode()


HASH = "xxh3_64"       # the checksum of new shards (their header's "hash")


class _Crc32:
    """CRC32, the checksum of shards written before `HASH` (no "hash" in their header)."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, view) -> None:
        self.crc = crc_of(view, self.crc)

    def intdigest(self) -> int:
        return self.crc


def summer(algo: str | None = HASH):
    """A running checksum of a shard's bytes by `algo` (a header's "hash"; None: CRC32):
    `update(bytes-like)` in order (the data, then the meta bytes), then `intdigest()`."""
    if algo == HASH:
        return xxhash.xxh3_64()
    if algo in (None, "crc32"):
        return _Crc32()
    raise CorruptShard(f"unknown checksum {algo!r}")


def checksum(hdr: dict, data, meta: bytes | None = None) -> int:
    """The checksum of `data` (the shard's first nbytes) and its meta bytes, by `hdr`'s hash."""
    s = summer(hdr.get("hash"))
    if len(data):
        s.update(data)
    s.update(meta_bytes(hdr) if meta is None else meta)
    return s.intdigest()


def crc_of(view, crc: int = 0) -> int:
    """CRC32 of a bytes-like object, in chunks (zlib releases the GIL on each)."""
    mv = memoryview(view).cast("B")
    for i in range(0, len(mv), CRC_CHUNK):
        crc = zlib.crc32(mv[i:i + CRC_CHUNK], crc)
    return crc


def meta_bytes(hdr: dict) -> bytes:
    """The pickled metadata section of a header."""
    return base64.b64decode(hdr["meta"])


def parse_name(name: str) -> tuple[int, str, int] | None:
    """(rank, "slot" | "step", slot or step number) of a header file name, or None."""
    m = _NAME.match(name)
    if not m:
        return None
    kind = m.group(2)
    return int(m.group(1)), kind[:4], int(kind[4:])


def list_shards(dir: str, rank: int | None = None) -> list[tuple[int, int, str]]:
    """Complete shards in `dir` as sorted (rank, step, header path), from the start of each header
    (`header_step_rank`: the agent lists its memory every second, and a whole header is tens of
    KB of JSON); neither the checksum nor the rest of the header is checked: readers do that."""
    out = []
    try:
        names = os.listdir(dir)
    except FileNotFoundError:
        return out
    for name in names:
        m = _NAME.match(name)
        if not m or (rank is not None and int(m.group(1)) != rank):
            continue
        path = os.path.join(dir, name)
        held = header_step_rank(path)
        if held is not None and held[1] == int(m.group(1)):
            out.append((held[1], held[0], path))
    out.sort()
    return out


def step_shards(dir: str, rank: int) -> list[tuple[int, str]]:
    """Per-step shards of `rank` in `dir` whose header is there, as sorted (step, header path),
    from their names alone (headers not read: see `list_shards` for that)."""
    try:
        names = os.listdir(dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _NAME.match(name)
        if m and int(m.group(1)) == rank and m.group(2).startswith("step"):
            out.append((int(m.group(2)[4:]), os.path.join(dir, name)))
    out.sort()
    return out


# ----------------------------------------------------------------------------- space

class NoSpace(StalwartError, OSError):
    """The shared memory cannot hold a checkpoint slot or backup (the message says how much)."""


def check_free(dir: str, need: int, what: str) -> None:
    """Raise NoSpace when the filesystem of `dir` has fewer than `need` bytes free: a tmpfs
    (/dev/shm) that fills up while a mapped file is written kills the writer with SIGBUS, so the
    space is checked before a slot or a backup is sized, never found short by a write."""
    if need <= 0:
        return
    st = os.statvfs(dir)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise NoSpace(f"{what} needs {need / 2**20:.1f} MiB in {dir} but only {free / 2**20:.1f} MiB are "
                      "free (enlarge /dev/shm, e.g. the container's shm size, or keep fewer slots)")


# ----------------------------------------------------------------------------- MAC

MAC = "blake3"          # the keyed MAC of new shards (their header's "mac_alg")
KEY_BYTES = 32
KEY_FILE = "ckpt.key"


class ForgedShard(CorruptShard):
    """A shard whose MAC is absent or does not match under the job's key: not restored."""


def key_path(shm_dir: str) -> str:
    """Where the agent keeps the job's checkpoint key, beside the own slots' directory."""
    return os.path.join(os.path.dirname(os.path.abspath(shm_dir)), KEY_FILE)


def write_key(path: str, key: bytes) -> None:
    """Write `key` to `path` (0600, replaced atomically, never through a symlink)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a checkpoint key is {KEY_BYTES} bytes, got {len(key)}")
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, key)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_key(path: str) -> bytes | None:
    """The checkpoint key at `path`, or None when there is none (no agent, or none given)."""
    try:
        key = _read_small(path)
    except FileNotFoundError:
        return None
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path}: a checkpoint key is {KEY_BYTES} bytes, the file holds {len(key)}")
    return key


def mac_prefix(rank: int, step: int, nbytes: int, layout_json: str, table_json: str) -> bytes:
    """What the MAC binds besides the bytes: the shard's identity and its tensor table (a shard
    of another step, rank or shape does not pass for this one)."""
    return b"%s|mac/1|%d|%d|%d|%s|%s|" % (FORMAT.encode(), rank, step, nbytes, layout_json.encode(),
                                          table_json.encode())


def mac_summer(key: bytes, prefix: bytes):
    """A running keyed MAC: `update(bytes-like)` with the data then the meta bytes, then
    `hexdigest()`."""
    m = blake3.blake3(key=key, max_threads=1)
    m.update(prefix)
    return m


def _hdr_prefix(hdr: dict) -> bytes:
    try:
        return mac_prefix(int(hdr["rank"]), int(hdr["step"]), int(hdr["nbytes"]),
                          json.dumps(hdr.get("layout") or {}, separators=(",", ":")),
                          json.dumps(hdr.get("tensors"), separators=(",", ":")))
    except (KeyError, TypeError, ValueError) as e:
        raise ForgedShard(f"a header without the fields its MAC binds ({e})") from None


def verify_shard(path: str, key: bytes | None = None) -> dict:
    """Re-read a shard's data and check it against its header (and, with `key`, its MAC: a
    shard without one, or a wrong one, raises ForgedShard); returns the header or raises
    CorruptShard."""
    hdr = read_header(path)
    if hdr is None:
        raise CorruptShard(f"{base_of(path)}: no complete header")
    mac = None
    if key is not None:
        if hdr.get("mac_alg") != MAC or not isinstance(hdr.get("mac"), str):
            raise ForgedShard(f"{base_of(path)}: no {MAC} MAC (a shard made without the job's key)")
        mac = mac_summer(key, _hdr_prefix(hdr))
    s = summer(hdr.get("hash"))
    try:
        with open(base_of(path) + ".data", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < hdr["nbytes"]:
                raise CorruptShard(f"{base_of(path)}: data is {size} bytes, header says {hdr['nbytes']}")
            if hdr["nbytes"]:
                with mmap.mmap(f.fileno(), hdr["nbytes"], prot=mmap.PROT_READ) as mm:
                    s.update(mm)
                    if mac is not None:
                        mac.update(mm)
    except FileNotFoundError:
        raise CorruptShard(f"{base_of(path)}: data file missing") from None
    meta = meta_bytes(hdr)
    s.update(meta)
    if s.intdigest() != hdr["checksum"]:
        raise CorruptShard(f"{base_of(path)}: checksum {s.intdigest():x} != header {hdr['checksum']:x}")
    if mac is not None:
        mac.update(meta)
        if not hmac.compare_digest(mac.hexdigest(), hdr["mac"]):
            raise ForgedShard(f"{base_of(path)}: MAC mismatch (not made with the job's key)")
    return hdr


def encode_shard(path: str) -> tuple[dict, memoryview]:
    """(header, read-only view of the data bytes) of a complete shard, for shipping to a peer.

    The view maps the file: call ``view.release()`` when done. The slot may be overwritten by its
    worker `slots` steps later; use `still_current` after copying to know the copy is consistent.
    """
    hdr = read_header(path)
    if hdr is None:
        raise CorruptShard(f"{base_of(path)}: no complete header")
    return hdr, map_data(path, hdr["nbytes"])


def map_data(path: str, n: int) -> memoryview:
    """A read-only view of the first `n` bytes of a shard's data file (release it when done)."""
    if n == 0:
        return memoryview(b"")
    with open(base_of(path) + ".data", "rb") as f:
        if os.fstat(f.fileno()).st_size < n:
            raise CorruptShard(f"{base_of(path)}: data shorter than header's nbytes")
        mm = mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ)
    return memoryview(mm)


def encode_shard_raw(path: str) -> tuple[dict, bytes, memoryview]:
    """`encode_shard`, with the header's bytes as read too (to ship as they are, and for
    `still_current_raw`)."""
    raw = read_header_bytes(path)
    hdr = _parse_header(raw) if raw is not None else None
    if hdr is None or raw is None:
        raise CorruptShard(f"{base_of(path)}: no complete header")
    return hdr, raw, map_data(path, hdr["nbytes"])


def still_current_raw(path: str, raw: bytes) -> bool:
    """`still_current` against the header's bytes as read before the copy: the same bytes, the
    same shard (the header names its step and checksum), with no parsing."""
    return read_header_bytes(path) == raw


def still_current(path: str, hdr: dict) -> bool:
    """True when the shard at `path` still holds the step (and checksum) that `hdr` describes.

    Writers unlink the header before touching the data, so a header that is unchanged after a
    read proves the data was not overwritten during it (a seqlock).
    """
    now = read_header(path)
    return now is not None and now["step"] == hdr["step"] and now["checksum"] == hdr["checksum"]
