"""`torch.distributed.checkpoint` (DCP) into stalwart's in-memory tier.

    from stalwart.worker.adapters.dcp import Checkpointer
    dist.init_process_group(...); model = fully_shard(...)          # the script's own set-up
    ckpt = Checkpointer()                                           # joins the job (worker.attach)
    start = ckpt.load({"model": model.state_dict(), "optim": optim.state_dict()})  # 0 on a fresh start
    for step in range(start, steps):
        ...
        ckpt.save(state_dict, step)        # every step: the step waits for the copy alone

What a save is. The first `save` (and any save whose local tensors changed shape) is a real DCP
save through `StalwartStorageWriter`: DCP plans it across ranks (the collectives, the global
`Metadata`, the checks of overlapping chunks) and the writer keeps this rank's write items. Every
later save reuses that plan: it resolves the same items from the new state dict on this rank alone
(no collective) and hands them to the worker's `MemCheckpointer`, which copies the tensors into a
preallocated shared-memory slot and commits the shard (checksum, header) on a background thread;
the agent streams each committed shard to a backup peer outside the rank's groups and to the
durable tier every `ckpt_every` steps, as for the SDK. A rank's shard holds every item the rank
holds, including replicated ones DCP's plan assigns to another rank, so that one rank's shard
restores that rank alone (a DDP rank restores from its own memory or its backup peer's). The
shard's payload names no rank (the shard's header does): data-parallel replicas write
byte-identical shards, so a backup peer that runs a replica keeps a reference to its own copy
instead of receiving the bytes (agent/twins.py).

Restoring. `load` is DCP's load through `StalwartStorageReader`: DCP's load planner asks for the
chunks each of this layout's tensors needs, and the reader serves them from the shard the agent
materialized for this rank (its own memory, its backup peer's copy or the durable tier), and, for
chunks that shard does not hold (the layout changed: another world size, another sharding), from
the same step's shards of the other ranks found in the durable tier, the machine's shared memory
or `sources`: DCP's resharding.

Without an agent (plain torchrun) and when the state does not fit the shared-memory filesystem,
`save` is DCP's own file save into the job's checkpoint directory every `ckpt_every` steps, and
`load` restores the newest complete one; the second case says so in one `error:` line first.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from stalwart.protocol import Env
from stalwart.worker import memckpt
from stalwart.worker.standby import wait_if_standby
from stalwart.errors import StalwartError

FORMAT = "stalwart-dcp-1"
DURABLE_PREFIX = "dcp_step_"

wait_if_standby()      # a warm standby waits here for its ranks, torch loaded (worker/standby.py)


class StateTooLarge(StalwartError, RuntimeError):
    """The state does not fit the shared-memory filesystem of the in-memory tier."""


def _key(fqn: str, offset) -> tuple:
    return (fqn, tuple(offset) if offset is not None else None)


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.chunk.sizes:
        n *= s
    return n * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


class StalwartStorageWriter(StorageWriter):
    """A DCP storage writer that keeps this rank's write items for the in-memory tier.

    `prepare_local_plan` sees the rank's plan before DCP's de-duplication of replicated tensors:
    those items (`local_items`) are what the rank's shard holds. `write_data` stores nothing
    itself (the `Checkpointer` copies the resolved items into shared memory once DCP returned the
    global metadata); its results name the rank as the storage of each item DCP gave it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rank = 0
        self.local_items: list[WriteItem] = []
        self.planner: SavePlanner | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.local_items = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank", dist.get_rank() if dist.is_initialized() else 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.local_items = list(plan.items)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.planner = planner
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=i.index, size_in_bytes=_item_bytes(i), storage_data=self.rank)
                        for i in plan.items])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def storage_meta(self) -> None:
        return None


class StalwartStorageReader(StorageReader):
    """A DCP storage reader over stalwart shards written by `Checkpointer.save`.

    `payload` is the shard of rank `shard_rank` (default: `rank`, this process's) of the step
    (what `memckpt.load` returns); chunks it lacks are read from the same step's shards of the
    other ranks in `sources` (directories holding stalwart shards: the durable tier, a machine's
    shared memory), loaded on first need.
    """

    def __init__(self, payload: dict, rank: int, sources: list[str] | None = None,
                 shard_rank: int | None = None) -> None:
        super().__init__()
        if payload.get("format") != FORMAT:
            raise ValueError("the shard was not written by stalwart's DCP adapter")
        self.step = int(payload["step"])
        self.world = int(payload["world"])
        self.rank = rank
        self.sources = [s for s in (sources or []) if s]
        self.metadata: Metadata = pickle.loads(payload["md"])
        self._have: dict[tuple, Any] = {}
        self._loaded: set[int] = set()
        self._add(payload, rank if shard_rank is None else shard_rank)

    def _add(self, payload: dict, rank: int) -> None:
        self._loaded.add(rank)
        index = pickle.loads(payload["index"])
        tensors, objects = iter(payload["tensors"]), iter(payload["objects"])
        for fqn, offset, is_bytes in index:
            self._have.setdefault((fqn, offset), next(objects) if is_bytes else next(tensors))

    def _find(self, key: tuple) -> Any:
        if key in self._have:
            return self._have[key]
        for r in range(self.world):            # the other ranks' shards of this step, on first need
            if r in self._loaded:
                continue
            for src in self.sources:
                try:
                    _, payload = memckpt.load(src, r, self.step)
                except (FileNotFoundError, memckpt.CorruptShard, ValueError):
                    continue
                self._add(payload, r)
                break
            else:
                self._loaded.add(r)        # not found anywhere: do not look again
            if key in self._have:
                return self._have[key]
        raise FileNotFoundError(f"no shard of step {self.step} holds {key[0]!r} at offset {key[1]} "
                                f"(looked in {', '.join(self.sources) or 'no other directory'})")

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            src = self._find(_key(item.storage_index.fqn, item.storage_index.offset))
            if not isinstance(src, torch.Tensor):
                buf = io.BytesIO()
                torch.save(src, buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(dim, off, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != src.size():
                raise ValueError(f"{item.storage_index.fqn}: chunk of size {tuple(src.size())} for a "
                                 f"target of size {tuple(target.size())}")
            target.copy_(src)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class _Replan(Exception):
    """The state no longer matches the cached plan (a key or a local shape changed)."""


def _real_path(state_dict: dict, path) -> tuple:
    """`path` with each key as the state dict holds it: DCP's flattening names an int key (an
    optimizer's parameter ids) by its string."""
    out, obj = [], state_dict
    for k in path:
        if isinstance(obj, dict) and k not in obj and isinstance(k, str) and k.lstrip("-").isdigit() \
                and int(k) in obj:
            k = int(k)
        out.append(k)
        try:
            obj = obj[k]
        except (KeyError, IndexError, TypeError):
            break
    return tuple(out)


def _plain(state_dict: dict) -> dict:
    """`state_dict` with each `Stateful` value replaced by its own state dict, as DCP sees it. (A
    dict is never `Stateful`: tested first, since `isinstance` against the runtime-checkable
    protocol costs about 8 us a value, every save.)"""
    return {k: v if isinstance(v, dict) else v.state_dict() if isinstance(v, Stateful) else v
            for k, v in state_dict.items()}


def _size(state_dict: dict, prefix: tuple) -> int:
    """len() of the container at `prefix` in `state_dict` (-1 when there is none)."""
    obj: Any = state_dict
    try:
        for k in prefix:
            obj = obj[k]
        return len(obj)
    except (KeyError, IndexError, TypeError):
        return -1


def _free_bytes(path: str) -> int:
    """Free bytes of the filesystem holding `path` (the shared memory of the in-memory tier)."""
    return shutil.disk_usage(path).free


def _held_bytes(dir: str, rank: int) -> int:
    """Bytes this rank's slots already take in `dir` (reused, so not needed again)."""
    total = 0
    for name in os.listdir(dir) if os.path.isdir(dir) else ():
        if name.startswith(f"rank{rank:05d}.slot") and name.endswith(".data"):
            try:
                total += os.path.getsize(os.path.join(dir, name))
            except FileNotFoundError:
                pass
    return total


class Checkpointer:
    """Every-step DCP checkpoints of one rank into stalwart's in-memory tier (see the module text).

    `ctx`: a context from `stalwart.worker.attach()` (made here when None). `process_group`: the
    group DCP plans over (default: the world). `report_steps`: each `save` reports its step to the
    controller unless the script reported it already (`ctx.report`), so a script whose only
    stalwart call is `save` shows progress; pass False to report steps yourself.
    """

    def __init__(self, ctx: Any = None, process_group: Any = None, report_steps: bool = True,
                 sources: list[str] | None = None) -> None:
        if ctx is None:
            from stalwart import worker
            ctx = worker.attach()
        self.ctx = ctx
        self.pg = process_group
        self.report_steps = report_steps
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.ckpt_dir = os.environ.get(Env.CKPT_DIR) or os.path.abspath("checkpoints")
        self.sources = list(sources or [])
        self.blocking_s = 0.0      # seconds `save` held the training thread, all steps together
        self.saves = 0
        self.replans = 0
        self.plan_s = 0.0          # ...of which in DCP's own (planning, collective) saves
        self._items: list[WriteItem] | None = None
        self._planner: DefaultSavePlanner | None = None
        self._md: bytes = b""
        self._index: bytes = b""
        self._shapes: list = []
        self._paths: list[tuple] = []
        self._lens: list[tuple[tuple, int]] = []
        self._durable_only = ctx.mem is None
        self._said_full = False
        self._fence_hook = None
        if ctx.mem is not None and ctx.mem.overlap:
            # STALWART_MEM_OVERLAP=1: a save's copy runs beside the next step's forward and
            # backward; every optimizer step first waits for it (the state changes only there)
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            self._fence_hook = register_optimizer_step_pre_hook(self._fence)

    def close(self) -> None:
        """Stop waiting for this checkpointer's copies at optimizer steps (the hook is
        process-wide); the snapshots already taken stay."""
        if self._fence_hook is not None:
            self._fence_hook.remove()
            self._fence_hook = None

    def _fence(self, *_: Any) -> None:
        t0 = time.perf_counter()
        self.ctx.fence_snapshot()
        self.blocking_s += time.perf_counter() - t0

    # -- save --------------------------------------------------------------------------------
    def save(self, state_dict: dict, step: int) -> None:
        """Checkpoint `state_dict` (what DCP would save) as the state reached after `step`."""
        t0 = time.perf_counter()
        if self._durable_only:
            self._save_durable(state_dict, step)
        else:
            try:
                payload = self._payload(state_dict, step)
            except _Replan:
                t1 = time.perf_counter()
                payload = self._plan(state_dict, step)
                self.plan_s += time.perf_counter() - t1
            if payload is not None:
                self.ctx.mem.snapshot(payload, step)
        self.saves += 1
        self.blocking_s += time.perf_counter() - t0
        if self.report_steps and (self.ctx._last_reported is None or self.ctx._last_reported < step):
            self.ctx.report(step)

    def _plan(self, state_dict: dict, step: int) -> dict | None:
        """A real DCP save (collective): the global metadata and this rank's items, kept."""
        writer = StalwartStorageWriter()
        planner = DefaultSavePlanner()
        md = dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=self.pg)
        self.replans += 1
        items = sorted(writer.local_items, key=lambda i: (i.index.fqn, tuple(i.index.offset or ())))
        self._planner, self._items = planner, items
        self._md = pickle.dumps(md)
        self._index = pickle.dumps([(i.index.fqn, tuple(i.index.offset) if i.index.offset is not None else None,
                                     i.type == WriteItemType.BYTE_IO) for i in items])
        self._shapes = [None if i.tensor_data is None else tuple(i.tensor_data.chunk.sizes) for i in items]
        # where each item sits in the nested state dict (DCP flattened it to its fully qualified name)
        plain = _plain(state_dict)
        self._paths = [_real_path(plain, planner.mappings.get(i.index.fqn, (i.index.fqn,))) for i in items]
        # the size of every container on those paths: a key added anywhere changes one of them
        self._lens = [(pre, _size(plain, pre)) for pre in sorted({p[:n] for p in self._paths for n in range(len(p))},
                                                                 key=len)]
        need = sum(_item_bytes(i) for i in items) * len(self.ctx.mem._slots)
        shm = self.ctx.mem.dir
        free = _free_bytes(shm) + _held_bytes(shm, self.rank)
        if need > free:
            self._durable_only = True
            if not self._said_full:
                self._said_full = True
                print(f"error: the DCP state of rank {self.rank} needs {need / 2**20:.1f} MiB of shared memory "
                      f"({len(self.ctx.mem._slots)} slots) and {shm} has {free / 2**20:.1f} MiB free: no in-memory "
                      f"checkpoint; DCP files in {self.ckpt_dir} every {self.ctx.ckpt_every} steps instead",
                      file=sys.stderr, flush=True)
            self._save_durable(state_dict, step)
            return None
        return self._payload(state_dict, step)

    def _payload(self, state_dict: dict, step: int) -> dict:
        """This rank's items resolved from `state_dict` along the cached plan's paths (no DCP
        planner pass: flattening the state dict and DTensor's `to_local` cost a millisecond a step
        for a small model); `_Replan` when the state no longer matches the plan."""
        if self._items is None:
            raise _Replan()
        state_dict = _plain(state_dict)
        tensors, objects = [], []
        for path, shape in zip(self._paths, self._shapes):
            obj: Any = state_dict
            try:
                for k in path:
                    obj = obj[k]
            except (KeyError, IndexError, TypeError):
                raise _Replan() from None
            if shape is None:
                objects.append(obj)
                continue
            if isinstance(obj, DTensor):
                obj = obj._local_tensor
            if not isinstance(obj, torch.Tensor) or tuple(obj.shape) != shape:
                raise _Replan()
            tensors.append(obj.detach() if obj.requires_grad else obj)
        for pre, n in self._lens:
            if _size(state_dict, pre) != n:
                raise _Replan()
        return {"format": FORMAT, "step": step, "world": self.world, "md": self._md, "index": self._index,
                "tensors": tensors, "objects": objects}

    def _save_durable(self, state_dict: dict, step: int) -> None:
        every = max(1, int(self.ctx.ckpt_every or 1))
        if (step + 1) % every:
            return
        dcp.save(state_dict, checkpoint_id=os.path.join(self.ckpt_dir, f"{DURABLE_PREFIX}{step:08d}"),
                 process_group=self.pg)
        if self.rank == 0:       # complete once every rank wrote: DCP's save returned on all of them
            open(os.path.join(self.ckpt_dir, f"{DURABLE_PREFIX}{step:08d}", ".complete"), "w").close()

    # -- load --------------------------------------------------------------------------------
    def load(self, state_dict: dict) -> int:
        """Load the checkpoint this run restores into `state_dict` (in place, DCP's way); the first
        step to run (0 on a fresh start). Collective: every rank calls it."""
        path = os.environ.get(Env.RESTORE_PATH)
        if path:
            start, payload = self.ctx.restore()
            sources = self.sources + [os.path.dirname(path), os.environ.get(Env.SHM_DIR, ""),
                                      self.ckpt_dir, os.environ.get(Env.CKPT_DIR, "")]
            reader = StalwartStorageReader(payload, self.rank, sources=[s for s in dict.fromkeys(sources) if s])
            dcp.load(state_dict, storage_reader=reader, planner=DefaultLoadPlanner(), process_group=self.pg)
            return start
        step = self._newest_durable()
        if step is None:
            return 0
        dcp.load(state_dict, checkpoint_id=os.path.join(self.ckpt_dir, f"{DURABLE_PREFIX}{step:08d}"),
                 process_group=self.pg)
        return step + 1

    def _newest_durable(self) -> int | None:
        try:
            names = os.listdir(self.ckpt_dir)
        except FileNotFoundError:
            return None
        steps = [int(n[len(DURABLE_PREFIX):]) for n in names if n.startswith(DURABLE_PREFIX)
                 and n[len(DURABLE_PREFIX):].isdigit()
                 and os.path.exists(os.path.join(self.ckpt_dir, n, ".complete"))]
        return max(steps) if steps else None

    @property
    def blocking_per_save_s(self) -> float:
        return self.blocking_s / self.saves if self.saves else 0.0

    @property
    def steady_blocking_s(self) -> float:
        """Seconds a save that reused the plan held the training thread, on average."""
        n = self.saves - self.replans
        return (self.blocking_s - self.plan_s) / n if n > 0 else 0.0


def load_from(dir: str, state_dict: dict, step: int | None = None, rank: int | None = None,
              process_group: Any = None) -> int:
    """Load step `step` (default: the newest rank 0 holds) of stalwart DCP shards in `dir` into
    `state_dict`, in whatever layout this process runs (DCP's resharding: any world size, any
    sharding, a single process included); returns that step."""
    rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
    shards = memckpt.list_shards(dir, None)
    if step is None:
        held = [s for r, s, _ in shards if r == 0]
        if not held:
            raise FileNotFoundError(f"no stalwart shard of rank 0 in {dir}")
        step = max(held)
    mine = [r for r, s, _ in shards if s == step and r == rank]
    _, payload = memckpt.load(dir, mine[0] if mine else 0, step)
    reader = StalwartStorageReader(payload, rank, sources=[dir], shard_rank=mine[0] if mine else 0)
    dcp.load(state_dict, storage_reader=reader, planner=DefaultLoadPlanner(),
             process_group=process_group, no_dist=not dist.is_initialized())
    return step
