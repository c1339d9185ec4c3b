"""Every-step in-memory checkpoint of one rank, in round-robin slots of shared memory.

On-disk (tmpfs) format of one *shard*, shared by every tier (own shm slots, peer backups, durable):

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

torch is imported lazily so that the agent can use the format helpers without loading it.
"""
from __future__ import annotations

import base64
import io
import json
import mmap
import os
import pickle
import re
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import xxhash

FORMAT = "stalwart-shard/1"
ALIGN = 64
CRC_CHUNK = 16 << 20
_NAME = re.compile(r"^rank(\d{5})\.(slot\d{1,3}|step\d{12})\.hdr$")


class CorruptShard(RuntimeError):
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


def read_header_bytes(path: str) -> bytes | None:
    """A shard's header as written (not parsed), or None when there is none."""
    try:
        with open(base_of(path) + ".hdr", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


_HEAD = re.compile(rb'^\{"format":"' + re.escape(FORMAT.encode()) + rb'","step":(\d+),"rank":(\d+),')


def header_step_rank(path: str) -> tuple[int, int] | None:
    """(step, rank) of a complete shard from the start of its header alone (a header exists only
    once its shard is complete; parsing a whole one, 30 KB for a small model's optimizer state,
    costs ~0.5 ms); None when there is none. A header laid out otherwise is parsed."""
    try:
        with open(base_of(path) + ".hdr", "rb") as f:
            head = f.read(160)
    except FileNotFoundError:
        return None
    m = _HEAD.match(head)
    if m:
        return int(m.group(1)), int(m.group(2))
    hdr = read_header(path)
    return (hdr["step"], hdr["rank"]) if hdr is not None else None


_NBYTES = re.compile(rb'"nbytes":(\d+),"tensors":')
_TAIL = re.compile(rb'(?:"hash":"([a-z0-9_]+)",)?"complete":1,"checksum":(\d+)\}')


def header_fields(raw: bytes) -> dict:
    """The fields a backup's receiver needs (step, rank, nbytes, hash, checksum, meta as bytes) from a
    complete header's bytes, without parsing its JSON (tens of KB for a small model's optimizer
    state, on every backup of every step): found where `_encode_header` puts them, else parsed.
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
            return {"step": int(head.group(1)), "rank": int(head.group(2)), "nbytes": int(nbytes.group(1)),
                    "hash": algo, "checksum": int(tail.group(2)),
                    "meta": base64.b64decode(raw[m0 + 8:m1], validate=True)}
        except ValueError:
            pass
    hdr = _parse_header(raw)
    if hdr is None or not all(isinstance(hdr.get(k), int) for k in ("step", "rank", "nbytes", "checksum")):
        raise CorruptShard("not a complete shard header")
    try:
        return {"step": hdr["step"], "rank": hdr["rank"], "nbytes": hdr["nbytes"], "hash": hdr.get("hash"),
                "checksum": hdr["checksum"], "meta": meta_bytes(hdr)}
    except (KeyError, ValueError, TypeError):
        raise CorruptShard("a shard header without valid meta") from None


def write_header(base: str, hdr: dict, encoded: bytes | None = None) -> None:
    """Write a header atomically (temp file then rename) — the commit point of a shard.
    `encoded`: the header's JSON already made (`hdr` unused then)."""
    tmp = f"{base}.hdr.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(encoded if encoded is not None else json.dumps(hdr, separators=(",", ":")).encode())
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


def verify_shard(path: str) -> dict:
    """Re-read a shard's data and check it against its header; returns the header or raises CorruptShard."""
    hdr = read_header(path)
    if hdr is None:
        raise CorruptShard(f"{base_of(path)}: no complete header")
    s = summer(hdr.get("hash"))
    try:
        with open(base_of(path) + ".data", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < hdr["nbytes"]:
                raise CorruptShard(f"{base_of(path)}: data is {size} bytes, header says {hdr['nbytes']}")
            if hdr["nbytes"]:
                with mmap.mmap(f.fileno(), hdr["nbytes"], prot=mmap.PROT_READ) as mm:
                    s.update(mm)
    except FileNotFoundError:
        raise CorruptShard(f"{base_of(path)}: data file missing") from None
    s.update(meta_bytes(hdr))
    if s.intdigest() != hdr["checksum"]:
        raise CorruptShard(f"{base_of(path)}: checksum {s.intdigest():x} != header {hdr['checksum']:x}")
    return hdr


def encode_shard(path: str) -> tuple[dict, memoryview]:
    """(header, read-only view of the data bytes) of a complete shard, for shipping to a peer.

    The view maps the file: call ``view.release()`` when done. The slot may be overwritten by its
    worker `slots` steps later; use `still_current` after copying to know the copy is consistent.
    """
    hdr = read_header(path)
    if hdr is None:
        raise CorruptShard(f"{base_of(path)}: no complete header")
    return hdr, _map_data(path, hdr)


def _map_data(path: str, hdr: dict) -> memoryview:
    n = hdr["nbytes"]
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
    return hdr, raw, _map_data(path, hdr)


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


# ----------------------------------------------------------------------------- pickling

def _eligible(obj) -> bool:
    import torch
    return (isinstance(obj, torch.Tensor) and (type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter)
            and obj.layout == torch.strided and not obj.is_quantized and obj.device.type != "meta")


class _TensorTypes:
    """`type(x) in _TENSOR_TYPES` without importing torch at module load."""

    def __contains__(self, t: type) -> bool:
        import torch
        return t is torch.Tensor or t is torch.nn.Parameter


_TENSOR_TYPES = _TensorTypes()


def _tensor_ref(index: int):
    """What a tensor's place in the metadata pickle names (`_Unpickler.find_class` resolves it to
    the index-th tensor of the shard); never called itself."""
    raise pickle.UnpicklingError("a shard's tensor reference read outside memckpt.load")


class _Pickler(pickle.Pickler):
    """Pickles a state with every eligible tensor replaced by a reference to its index.

    `reducer_override` is consulted only for objects that are not of a basic type (ints, floats,
    strings, dicts, lists...): for a model's and optimizer's state that is the tensors alone,
    where a `persistent_id` would be a Python call for every object (a third of the training
    thread's snapshot time). A tensor seen twice is the pickler's memo's, not ours.

    With `strict=False` every plain tensor or parameter is taken without reading its layout,
    quantization or device (one type test: half the time of the strict test, for every tensor
    of every step); the snapshot then checks them with `_eligible` once per new plan, and pickles
    again strictly where one is not a dense tensor (`MemCheckpointer.snapshot`)."""

    def __init__(self, buf, strict: bool = True):
        import torch
        super().__init__(buf, protocol=5)
        self.tensors: list = []
        self._types = (torch.Tensor, torch.nn.Parameter)
        self._strided = torch.strided
        if not strict:
            self.reducer_override = self._any_tensor     # type: ignore[method-assign]

    def reducer_override(self, obj):
        t = type(obj)
        if (t is not self._types[0] and t is not self._types[1]) or obj.layout is not self._strided \
                or obj.is_quantized or obj.is_meta:
            return NotImplemented
        self.tensors.append(obj)
        return _tensor_ref, (len(self.tensors) - 1,)

    def _any_tensor(self, obj):
        t = type(obj)
        if t is not self._types[0] and t is not self._types[1]:
            return NotImplemented
        self.tensors.append(obj)
        return _tensor_ref, (len(self.tensors) - 1,)


class _Unpickler(pickle.Unpickler):
    def __init__(self, buf, tensors):
        super().__init__(buf)
        self._tensors = tensors

    def find_class(self, module, name):
        if module == __name__ and name == "_tensor_ref":
            return self._tensors.__getitem__
        return super().find_class(module, name)

    def persistent_load(self, pid):
        # shards written before the references were globals (persistent ids ("t", index))
        if pid[0] != "t":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._tensors[pid[1]]


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pickle_state(state: Any, strict: bool) -> tuple[_Pickler, bytes]:
    buf = io.BytesIO()
    p = _Pickler(buf, strict=strict)
    try:
        p.dump(state)
    except Exception as e:
        raise ValueError(f"checkpoint state is not picklable: {e}") from e
    return p, buf.getvalue()


def _plan(tensors) -> tuple[list[dict], int]:
    """Tensor table (dtype, shape, offset, nbytes, …) and total data size for a list of tensors."""
    table, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        table.append({"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": n,
                      "param": type(t).__name__ == "Parameter", "requires_grad": bool(t.requires_grad)})
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    return table, off


# ----------------------------------------------------------------------------- writer

class _Slot:
    def __init__(self, base: str):
        self.base = base
        self.capacity = 0
        self.buf = None           # torch uint8 tensor mapping base.data
        self.layout_key = None    # set once `views` were zeroed and made for the current buffer
        self.pending: Future | None = None
        self.shapes: tuple | None = None   # the (dtype, shape) of each tensor last written...
        self.plan: tuple[list[dict], int] | None = None     # ...their table and size...
        self.table_json = ""                                # (the table, encoded)
        self.views: list | None = None     # ...and the views of `buf` they were copied into
        self.pairs: list[int] = []         # the indices of those with any bytes


class MemCheckpointer:
    """Snapshots one rank's state into `slots` preallocated shared-memory slots, round-robin
    (two: double buffering; more keep more recent steps in memory).

    `snapshot` blocks only for the tensor copies; the checksum and header commit run on a
    background thread. Not thread-safe: call it from the training thread.
    """

    def __init__(self, dir: str, rank: int, layout: dict | None = None, headroom: float = 0.05,
                 slots: int = 2, on_commit: Callable[[int, str], None] | None = None):
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        if not isinstance(slots, int) or isinstance(slots, bool) or not 2 <= slots <= 999:
            raise ValueError(f"slots must be an int from 2 to 999, got {slots!r}")
        self.dir = dir
        self.rank = rank
        self.on_commit = on_commit          # (step, header path) once a snapshot is complete
        self.layout = dict(layout or {})
        self.headroom = headroom
        os.makedirs(dir, exist_ok=True)
        self._slots = [_Slot(slot_base(dir, rank, k)) for k in range(slots)]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"memckpt-r{rank}")
        self._last_step: int | None = None

    # -- allocation
    def _ensure(self, slot: _Slot, nbytes: int) -> None:
        import torch
        if slot.buf is not None and slot.capacity >= nbytes:
            return
        cap = max(ALIGN, int(nbytes * (1 + self.headroom)) // ALIGN * ALIGN + ALIGN)
        path = slot.base + ".data"
        slot.buf = None
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, cap)
        finally:
            os.close(fd)
        buf = torch.from_file(path, shared=True, size=cap, dtype=torch.uint8)
        buf.zero_()               # first touch now, not during a step
        slot.buf, slot.capacity, slot.layout_key = buf, cap, None

    # -- public API
    def snapshot(self, state: Any, step: int) -> None:
        """Copy `state` (nested tensors / picklable values) into slot step % slots; commit in the background."""
        import torch
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        slot = self._slots[step % len(self._slots)]
        if slot.pending is not None:
            fut, slot.pending = slot.pending, None
            fut.result()          # previous write of this slot must be finished (re-raises its error)
        p, meta = _pickle_state(state, strict=False)
        shapes = tuple((t.dtype, t.shape, t.requires_grad, type(t)) for t in p.tensors)
        if shapes != slot.shapes or slot.plan is None:      # the same state as last time: same plan
            if not all(map(_eligible, p.tensors)):          # a sparse, quantized or meta tensor
                p, meta = _pickle_state(state, strict=True)
                shapes = tuple((t.dtype, t.shape, t.requires_grad, type(t)) for t in p.tensors)
            slot.plan, slot.views, slot.shapes = _plan(p.tensors), None, None
            slot.table_json = json.dumps(slot.plan[0], separators=(",", ":"))
        table, nbytes = slot.plan
        self._ensure(slot, nbytes)
        try:                      # invalidate first: a crash from here on never looks complete
            os.unlink(slot.base + ".hdr")
        except FileNotFoundError:
            pass
        if slot.views is None or slot.layout_key is None:
            slot.buf[:nbytes].zero_()  # keep padding bytes zero so the checksum is deterministic
            slot.views = [slot.buf[e["offset"]:e["offset"] + e["nbytes"]].view(t.dtype).view(t.shape)
                          for t, e in zip(p.tensors, table)]
            slot.shapes = shapes
            slot.pairs = [i for i, e in enumerate(table) if e["nbytes"]]
        views, src = slot.views, p.tensors
        with torch.no_grad():     # one call for every tensor: the step blocks for the copy alone
            if len(slot.pairs) == len(src):
                torch._foreach_copy_(views, src)
            else:
                torch._foreach_copy_([views[i] for i in slot.pairs], [src[i] for i in slot.pairs])
        slot.layout_key = nbytes
        # the header (the tensor table, the base64 of the metadata), its checksum and its commit
        # are the background thread's: the training thread only copied
        slot.pending = self._pool.submit(self._commit, slot, step, slot.table_json, nbytes, meta)
        self._last_step = step

    def _commit(self, slot: _Slot, step: int, table_json: str, nbytes: int, meta: bytes) -> None:
        # (the key order is the format's: "format", "step", "rank" first, see header_step_rank)
        hdr = {"format": FORMAT, "step": step, "rank": self.rank, "layout": self.layout, "nbytes": nbytes,
               "tensors": None, "meta": base64.b64encode(meta).decode(), "hash": HASH, "complete": 1}
        hdr["checksum"] = checksum(hdr, slot.buf[:nbytes].numpy() if nbytes else b"", meta)
        write_header(slot.base, hdr, _encode_header(hdr, table_json))
        if self.on_commit is not None:
            self.on_commit(step, slot.base + ".hdr")

    def wait(self) -> None:
        """Block until every submitted snapshot is committed; re-raises a background failure."""
        for slot in self._slots:
            if slot.pending is not None:
                fut, slot.pending = slot.pending, None
                fut.result()

    def close(self) -> None:
        """Wait for pending commits and stop the background thread (the slots stay on disk)."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            for slot in self._slots:
                slot.buf = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- reader

def latest(dir: str, rank: int) -> tuple[int, str] | None:
    """(step, shard path) of the newest complete shard of `rank` in `dir`, or None (checksum not verified)."""
    shards = list_shards(dir, rank)
    if not shards:
        return None
    _, step, path = shards[-1]
    return step, path


def _resolve(path_or_dir: str, rank: int, step: int | None) -> str:
    if os.path.isdir(path_or_dir):
        shards = [(s, p) for _, s, p in list_shards(path_or_dir, rank) if step is None or s == step]
        if not shards:
            what = "any step" if step is None else f"step {step}"
            raise FileNotFoundError(f"no complete shard of rank {rank} for {what} in {path_or_dir}")
        return shards[-1][1]
    return base_of(path_or_dir) + ".hdr"


def load(path_or_dir: str, rank: int, step: int | None = None, map_location=None) -> tuple[int, Any]:
    """(step, state) from a shard path or a directory (newest step, or `step`), checksum verified.

    Tensors are fresh CPU tensors (each with its own storage), moved to `map_location` if given.
    Raises CorruptShard on any mismatch, FileNotFoundError when no such shard exists.
    """
    import torch
    path = _resolve(path_or_dir, rank, step)
    hdr = read_header(path)
    if hdr is None:
        raise CorruptShard(f"{base_of(path)}: no complete header")
    if hdr["rank"] != rank or (step is not None and hdr["step"] != step):
        raise ValueError(f"{path} holds rank {hdr['rank']} step {hdr['step']}, not rank {rank} step {step}")
    tensors, s, pos = [], summer(hdr.get("hash")), 0
    try:
        f = open(base_of(path) + ".data", "rb")
    except FileNotFoundError:
        raise CorruptShard(f"{base_of(path)}: data file missing") from None
    with f:
        def read_into(view) -> None:
            got = f.readinto(view)
            if got != len(view):
                raise CorruptShard(f"{base_of(path)}: data truncated")
        for e in hdr["tensors"]:
            if e["offset"] > pos:
                gap = bytearray(e["offset"] - pos)
                read_into(gap)
                s.update(gap)
            t = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
            if e["nbytes"]:
                raw = t.reshape(-1).view(torch.uint8).numpy()
                read_into(raw)
                s.update(raw)
            pos = e["offset"] + e["nbytes"]
            tensors.append(t)
        if hdr["nbytes"] > pos:
            gap = bytearray(hdr["nbytes"] - pos)
            read_into(gap)
            s.update(gap)
    meta = meta_bytes(hdr)
    s.update(meta)
    if s.intdigest() != hdr["checksum"]:
        raise CorruptShard(f"{base_of(path)}: checksum {s.intdigest():x} != header {hdr['checksum']:x}")
    out = []
    for t, e in zip(tensors, hdr["tensors"]):
        if map_location is not None:
            t = t.to(map_location)
        if e["param"]:
            t = torch.nn.Parameter(t, requires_grad=e["requires_grad"])
        elif e["requires_grad"]:
            t.requires_grad_(True)
        out.append(t)
    return hdr["step"], _Unpickler(io.BytesIO(meta), out).load()
