"""Every-step in-memory checkpoint of one rank, in round-robin slots of shared memory: the writer
(`MemCheckpointer`: the training thread copies, a background thread commits) and the reader
(`latest`, `load`). The shard format they share with every other tier is `shardfmt`'s (its
helpers are importable from here too, as `memckpt.read_header` and the like).

torch is imported lazily so that the agent can use the format helpers without loading it.
"""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from stalwart.worker.commits import CommitThread
from stalwart.worker.shardfmt import (  # noqa: F401  (the format's helpers, re-exported)
    ALIGN, FORMAT, HASH, KEY_BYTES, MAC, CorruptShard, ForgedShard, NoSpace, _encode_header, base_of, check_free,
    checksum,
    encode_shard, encode_shard_raw, header_fields, header_step_rank, key_path, list_shards, mac_prefix, mac_summer,
    map_data, meta_bytes, parse_name, read_header, read_header_bytes, read_key, slot_base, step_base, step_shards,
    still_current, still_current_raw, summer, verify_shard, write_header, write_key,
)


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
    again strictly where one is not a dense tensor (`MemCheckpointer.snapshot`). That reduction
    is a closure over its locals returning reductions made once (`refs`): half the pickling
    time of a bound method building each (the training thread pickles every step)."""

    refs: tuple = ()        # (_tensor_ref, (i,)) for i = 0, 1, ...: made once, grown by replacement

    def __init__(self, buf, strict: bool = True):
        import torch
        super().__init__(buf, protocol=5)
        self.tensors: list = []
        self._types = (torch.Tensor, torch.nn.Parameter)
        self._strided = torch.strided
        if not strict:
            self.reducer_override = _any_tensor(self.tensors, _Pickler.refs)  # type: ignore[method-assign]

    def reducer_override(self, obj):
        t = type(obj)
        if (t is not self._types[0] and t is not self._types[1]) or obj.layout is not self._strided \
                or obj.is_quantized or obj.is_meta:
            return NotImplemented
        self.tensors.append(obj)
        return _tensor_ref, (len(self.tensors) - 1,)


def _any_tensor(tensors: list, refs: tuple):
    """The non-strict reduction (see `_Pickler`): any plain tensor or parameter becomes a
    reference to its index in `tensors`."""
    import torch
    t0, t1, append = torch.Tensor, torch.nn.Parameter, tensors.append

    def reduce(obj):
        t = type(obj)
        if t is not t0 and t is not t1:
            return NotImplemented
        i = len(tensors)
        append(obj)
        try:
            return refs[i]
        except IndexError:
            return _tensor_ref, (i,)
    return reduce


# What a state's metadata may name (`_Unpickler`): the containers and values a model's, an
# optimizer's and a data loader's state hold, and the functions that rebuild the tensors the
# shard's data does not carry (sparse, quantized, meta). Anything else is refused, so that a
# shard's pickle cannot call an arbitrary function at restore; `allow_globals` adds a type.
_ALLOWED: set[tuple[str, str]] = {
    ("builtins", n) for n in ("set", "frozenset", "complex", "slice", "range", "bytearray")} | {
    ("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")} | {
    ("torch", "Size"), ("torch", "device"),
    ("torch._utils", "_rebuild_sparse_tensor"), ("torch._utils", "_rebuild_qtensor"),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch.serialization", "_get_layout"),
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    ("random", "Random"),
}


def allow_globals(*objs: Any) -> None:
    """Let a shard's state hold instances of these classes (or name these functions): what a
    state of the user's own types needs to be restored (the restricted unpickler refuses
    every other global)."""
    for o in objs:
        _ALLOWED.add((o.__module__, o.__qualname__))


def _load_storage(b: bytes):
    """A tensor storage pickled inside a state (a sparse tensor's), loaded with torch's own
    restricted loader (torch's `_load_from_bytes` loads it with `weights_only=False`)."""
    import torch
    return torch.load(io.BytesIO(b), weights_only=True)


class _Unpickler(pickle.Unpickler):
    """The shard's metadata, with tensor references resolved and only `_ALLOWED` globals."""

    def __init__(self, buf, tensors):
        super().__init__(buf)
        self._tensors = tensors

    def find_class(self, module, name):
        if module == __name__ and name == "_tensor_ref":
            return self._tensors.__getitem__
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if module == "torch":
            import torch
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)):
                return value
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a checkpoint's state names {module}.{name}, which is not allowed in "
                                     "a state (stalwart.worker.memckpt.allow_globals admits a type)")

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
    if len(p.tensors) > len(_Pickler.refs):   # (a new tuple, whole: a reader never sees it half made)
        _Pickler.refs = tuple((_tensor_ref, (i,)) for i in range(2 * len(p.tensors)))
    return p, buf.getvalue()


def _finished(fut: Future) -> None:
    """Wait for a slot's write: its commit, or its copy and then the commit that one handed on."""
    then = fut.result()
    if isinstance(then, Future):
        then.result()


def _copy(views: list, src: list) -> None:
    import torch
    with torch.no_grad():     # one call for every tensor (it releases the GIL while it copies)
        torch._foreach_copy_(views, src)


def _shapes(tensors) -> tuple:
    """What a plan depends on, for each tensor: its dtype, shape, requires_grad, type and layout
    (a dense tensor replaced by a sparse one of its shape is planned again)."""
    return tuple((t.dtype, t.shape, t.requires_grad, type(t), t.layout) for t in tensors)


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
        self.commit_args: tuple | None = None   # what `pending` commits, while it may not have started
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

    With `overlap=True` the copies run on the background thread too, while the training thread
    goes on with the next step's forward and backward (ByteRobust's every-step checkpoint: the
    copy overlaps the computation, the optimizer step waits for it): the caller calls `fence()`
    before anything modifies the state's tensors again (the SDK does in `on_gradients`). A
    tensor modified before the copy finished (an in-place update in forward, a missed fence) is
    seen by its version counter: that snapshot is dropped, never committed, and every later one
    is copied on the training thread (`overlap_off` says why).
    """

    def __init__(self, dir: str, rank: int, layout: dict | None = None, headroom: float = 0.05,
                 slots: int = 2, on_commit: Callable[[int, str], None] | None = None,
                 overlap: bool = False, mac_key: bytes | None = None):
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        if not isinstance(slots, int) or isinstance(slots, bool) or not 2 <= slots <= 999:
            raise ValueError(f"slots must be an int from 2 to 999, got {slots!r}")
        self.dir = dir
        self.rank = rank
        self.on_commit = on_commit          # (step, header path) once a snapshot is complete
        self.layout = dict(layout or {})
        self.headroom = headroom
        os.makedirs(dir, mode=0o700, exist_ok=True)
        # the job's checkpoint key (the agent's file beside `dir`): each commit adds a keyed MAC
        self.mac_key = mac_key if mac_key is not None else read_key(key_path(dir))
        self._layout_json = json.dumps(self.layout, separators=(",", ":"))
        self._slots = [_Slot(slot_base(dir, rank, k)) for k in range(slots)]
        self._pool = CommitThread(f"stalwart-memckpt-r{rank}")
        # (overlapped copies: at the training thread's priority, which waits for them in `fence`;
        # a nice-19 thread there would wait behind every other runnable thread of a busy host)
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stalwart-memckpt-copy-r{rank}") \
            if overlap else None
        self._last_step: int | None = None
        self.overlap = overlap
        self.overlap_off: str | None = None   # why snapshots stopped overlapping (a torn copy)
        self._copied: threading.Event | None = None   # set once the newest overlapped copy is done

    # -- allocation
    def _ensure(self, slot: _Slot, nbytes: int) -> None:
        import torch
        if slot.buf is not None and slot.capacity >= nbytes:
            return
        cap = max(ALIGN, int(nbytes * (1 + self.headroom)) // ALIGN * ALIGN + ALIGN)
        path = slot.base + ".data"
        check_free(self.dir, cap - (os.stat(path).st_size if os.path.exists(path) else 0),
                   f"rank {self.rank}'s checkpoint slot")
        slot.buf = None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
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
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        slot = self._slots[step % len(self._slots)]
        if slot.pending is not None:
            fut, slot.pending = slot.pending, None
            args, slot.commit_args = slot.commit_args, None
            if args is not None and fut.cancel():
                # the commit thread has not started this slot's previous commit: do it here. On a
                # busy host the nice-19 thread can wait behind every other runnable thread for
                # many steps, and the training thread would wait with it (priority inversion);
                # here it costs the commit's own work (the checksum, the MAC, the header).
                self._commit(*args)
                # ...and the newer slots' commits it has not started either, in step order: this
                # slot is overwritten next, and memory must keep a committed step while it is (a
                # rank killed now restores from the newest one)
                newer = sorted((s for s in self._slots if s is not slot and s.commit_args is not None),
                               key=lambda s: s.commit_args[1])
                for other in newer:
                    if other.pending is not None and other.pending.cancel():
                        todo, other.pending, other.commit_args = other.commit_args, None, None
                        self._commit(*todo)
            else:
                _finished(fut)    # previous write of this slot must be finished (re-raises its error)
        p, meta = _pickle_state(state, strict=False)
        # (checked here, not by the nice-19 commit thread: measured under load, Python work there
        # holds the interpreter lock while the OS has that thread waiting, and the training
        # thread waits for the lock: SDK blocking 2.02 -> 2.17 ms a step)
        shapes = _shapes(p.tensors)
        if shapes != slot.shapes or slot.plan is None:      # the same state as last time: same plan
            if not all(map(_eligible, p.tensors)):          # a sparse, quantized or meta tensor
                p, meta = _pickle_state(state, strict=True)
                shapes = _shapes(p.tensors)
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
        if len(slot.pairs) != len(src):
            views, src = [views[i] for i in slot.pairs], [src[i] for i in slot.pairs]
        slot.layout_key = nbytes
        copier = self._copier if self.overlap_off is None else None
        versions = self._versions(src) if copier is not None else None
        if copier is not None and versions is not None:
            # the copy too is the background thread's; what each tensor's version is now tells it
            # whether the training thread changed one before the copy was done
            copied = self._copied = threading.Event()
            slot.pending = copier.submit(self._copy_commit, slot, step, views, src, versions, copied,
                                         slot.table_json, nbytes, meta)
        else:
            _copy(views, src)     # the step blocks for the copy alone
            # the header (the tensor table, the base64 of the metadata), its checksum and its
            # commit are the background thread's: the training thread only copied
            slot.commit_args = (slot, step, slot.table_json, nbytes, meta)
            slot.pending = self._pool.submit(self._commit, *slot.commit_args)
        self._last_step = step

    def _versions(self, src: list) -> list[int] | None:
        """The tensors' version counters, or None (and copies on the training thread from now on)
        when one has none (an inference tensor)."""
        try:
            return [t._version for t in src]
        except RuntimeError as e:
            self.overlap_off = f"the state holds a tensor without a version counter ({e})"
            return None

    def fence(self) -> None:
        """Block until the newest snapshot's copy is done (with `overlap`; else it was done in
        `snapshot`): call it before the state's tensors are modified again."""
        copied = self._copied
        if copied is not None:
            copied.wait()
            self._copied = None

    def _copy_commit(self, slot: _Slot, step: int, views: list, src: list, versions: list[int],
                     copied: threading.Event, table_json: str, nbytes: int, meta: bytes) -> Future | None:
        """(the copier thread) The copy, then the commit handed to the commit thread: its Future."""
        try:
            _copy(views, src)
            changed = next((i for i, (t, v) in enumerate(zip(src, versions)) if t._version != v), None)
        finally:
            copied.set()
        if changed is not None:
            # torn: the slot keeps no header (it was removed before the copy), the previous stays
            self.overlap_off = (f"tensor {changed} of the state of step {step} was modified before its "
                                "copy was done (an in-place update in forward, or no fence before the "
                                "optimizer step): snapshots are copied on the training thread from now on")
            return None
        return self._pool.submit(self._commit, slot, step, table_json, nbytes, meta)

    def _commit(self, slot: _Slot, step: int, table_json: str, nbytes: int, meta: bytes) -> None:
        # (the key order is the format's: "format", "step", "rank" first, see header_step_rank)
        hdr = {"format": FORMAT, "step": step, "rank": self.rank, "layout": self.layout, "nbytes": nbytes,
               "tensors": None, "meta": base64.b64encode(meta).decode(), "hash": HASH, "complete": 1}
        data = slot.buf[:nbytes].numpy() if nbytes else b""
        if self.mac_key is not None:     # (before "hash": where the header's readers expect it)
            mac = mac_summer(self.mac_key, mac_prefix(self.rank, step, nbytes, self._layout_json, table_json))
            if nbytes:
                mac.update(data)
            mac.update(meta)
            hdr = {k: v for k, v in hdr.items() if k not in ("hash", "complete")}
            hdr.update(mac_alg=MAC, mac=mac.hexdigest(), hash=HASH, complete=1)
        hdr["checksum"] = checksum(hdr, data, meta)
        write_header(slot.base, hdr, _encode_header(hdr, table_json))
        if self.on_commit is not None:
            self.on_commit(step, slot.base + ".hdr")

    def wait(self) -> None:
        """Block until every submitted snapshot is committed (or dropped, torn); re-raises a
        background failure."""
        for slot in self._slots:
            if slot.pending is not None:
                fut, slot.pending, slot.commit_args = slot.pending, None, None
                _finished(fut)

    def close(self) -> None:
        """Wait for pending commits and stop the background thread (the slots stay on disk)."""
        try:
            self.wait()
        finally:
            if self._copier is not None:
                self._copier.shutdown(wait=True)
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
