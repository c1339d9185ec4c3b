"""GPU smoke test: what stalwart does on a real NVIDIA GPU, each part checked and timed, printed
as a table.

    python bench/gpu_smoke.py [--mib 256] [--json FILE]

- nvml: the agent's NVML probe (`NvmlSource`) reads each device: name, temperature, clocks,
  PCIe link, ECC, Xids, throttling;
- pinned-shm snapshot: a CUDA tensor copied every step into shared memory pinned for the GPU
  (`cudaHostRegister` on a file of the in-memory tier's kind), then restored to the GPU; bytes
  compared, GiB/s each way;
- memckpt: the SDK's `MemCheckpointer` snapshots a CUDA state (model + optimizer), `load`
  restores it;
- nccl abort/re-init: an NCCL group of as many ranks as GPUs (one process each: NCCL refuses two
  ranks on one GPU), an all-reduce, the group aborted, a new one built in the same processes on a
  fresh store prefix, an all-reduce again;
- sdk: `worker.init()` on the GPU (NCCL), steps with `on_gradients`, `report` and `checkpoint`
  into shared memory, then a restore;
- dcp adapter: FSDP2 (`fully_shard`) on the GPU, the DCP adapter's every-step save (its blocking
  time), a restore by `load_from`.

Where no GPU exists it prints one line saying so and exits 0: nothing to check. Results of a run
go to docs/performance.md with the GPU's name.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

Row = tuple[str, bool, str]


def no_gpu_reason() -> str | None:
    """Why this host cannot run the checks, or None when it has a CUDA GPU."""
    if not torch.cuda.is_available():
        built = torch.version.cuda
        return ("no NVIDIA GPU here: torch.cuda.is_available() is False "
                + (f"(torch {torch.__version__} built for CUDA {built})" if built
                   else f"(torch {torch.__version__} is a CPU build)"))
    return None


def check_nvml() -> Row:
    from stalwart.agent.probes.gpu import NvmlSource
    src = NvmlSource(count=torch.cuda.device_count())
    try:
        devs = src.read()
    finally:
        src.close()
    parts = []
    for i, d in enumerate(devs):
        parts.append(f"{i}: {d.get('name', '?')} {d.get('temperature', '?')} C, "
                     f"sm {d.get('clock_sm', '?')}/{d.get('clock_sm_max', '?')} MHz, "
                     f"pcie gen {d.get('pcie_gen', '?')} x{d.get('pcie_width', '?')}, "
                     f"ecc dbe {d.get('ecc_dbe', '?')}, xids {d.get('xid', [])}, throttle {d.get('throttle', [])}")
    return "nvml", bool(devs) and all(d.get("present") for d in devs), "; ".join(parts)


def pinned_roundtrip(nbytes: int, device: str, dir: str, steps: int = 5) -> tuple[bool, float, float]:
    """(equal, GiB/s device->shm, GiB/s shm->device) for a tensor of `nbytes` copied `steps` times
    into a shared-memory file pinned for the GPU (pinning skipped on a CPU device)."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    path = os.path.join(dir, "pinned.data")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, n * 4)
    finally:
        os.close(fd)
    buf = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
    buf.zero_()
    pinned = device != "cpu"
    if pinned:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), n * 4, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            buf.copy_(src, non_blocking=pinned)
            if pinned:
                torch.cuda.synchronize()
        down = steps * n * 4 / (time.perf_counter() - t0) / 2**30
        back = torch.empty_like(src)
        t0 = time.perf_counter()
        back.copy_(buf, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()
        up = n * 4 / (time.perf_counter() - t0) / 2**30
        return bool(torch.equal(back, src)), down, up
    finally:
        if pinned:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        del buf
        os.unlink(path)


def check_pinned(mib: int, dir: str) -> Row:
    ok, down, up = pinned_roundtrip(mib * 2**20, "cuda", dir)
    return "pinned-shm snapshot", ok, f"{mib} MiB: GPU->shm {down:.1f} GiB/s, shm->GPU {up:.1f} GiB/s"


def memckpt_roundtrip(device: str, dir: str, dim: int = 512) -> tuple[bool, float]:
    """(restored equal, ms per snapshot) for a small model + optimizer state on `device`."""
    from stalwart.worker import memckpt
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.Linear(dim, dim)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, dim, device=device)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with memckpt.MemCheckpointer(dir, 0) as m:
        t0 = time.perf_counter()
        for step in range(5):
            m.snapshot(state, step)
        if device != "cpu":
            torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / 5 * 1e3
    step, back = memckpt.load(dir, 0, map_location=device)
    same = step == 4 and all(torch.equal(a.cpu(), b.cpu()) for a, b in
                             zip(state["model"].values(), back["model"].values()))
    return same, per


def check_memckpt(dir: str) -> Row:
    ok, per = memckpt_roundtrip("cuda", dir)
    return "memckpt", ok, f"model+optimizer snapshot {per:.2f} ms, restored equal: {ok}"


def _nccl_worker(rank: int, world: int, port: int, out: Any) -> None:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    t0 = time.perf_counter()
    dist.init_process_group("nccl", store=dist.PrefixStore("a/", store), rank=rank, world_size=world,
                            timeout=timeout, device_id=torch.device("cuda", rank))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    first = float(x[0])
    t1 = time.perf_counter()
    dist.distributed_c10d._abort_process_group()          # what a failover does to a stuck group
    t2 = time.perf_counter()
    dist.init_process_group("nccl", store=dist.PrefixStore("b/", store), rank=rank, world_size=world,
                            timeout=timeout, device_id=torch.device("cuda", rank))
    y = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(y)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    dist.destroy_process_group()
    out.put((rank, first, float(y[0]), t1 - t0, t2 - t1, t3 - t2))


def check_nccl() -> Row:
    import socket

    import torch.multiprocessing as mp
    world = torch.cuda.device_count()      # NCCL refuses two ranks on one GPU: one rank per GPU
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    ok = all(first == world and again == world for _, first, again, *_ in got)
    _, _, _, init_s, abort_s, reinit_s = max(got, key=lambda g: g[3])
    return ("nccl abort/re-init", ok, f"{world} rank(s): init+all-reduce {init_s:.2f}s, abort {abort_s * 1e3:.0f} ms, "
            f"re-init+all-reduce {reinit_s:.2f}s")


def check_sdk(dir: str) -> Row:
    os.environ.update({"STALWART_SHM_DIR": os.path.join(dir, "sdk"), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    from stalwart import worker
    ctx = worker.init()
    model = torch.nn.Linear(1024, 1024).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(10):
        ctx.begin_step(step)
        loss = model(torch.randn(32, 1024, device=ctx.device)).pow(2).mean()
        loss.backward()
        ctx.on_gradients(step, model.parameters())
        opt.step()
        opt.zero_grad()
        ctx.report(step, loss=loss.item())
        ctx.checkpoint({"model": model.state_dict(), "optim": opt.state_dict()}, step)
    ctx.mem.wait()
    from stalwart.worker import memckpt
    step, back = memckpt.load(ctx.mem.dir, 0, map_location=ctx.device)
    ok = step == 9 and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back["model"].values()))
    detail = (f"{ctx.device} nccl={ctx.cuda}: blocking {1e3 * ctx.blocking_s / 10:.2f} ms/step "
              f"(snapshot {1e3 * ctx.blocking_parts['snapshot'] / 10:.2f} ms), restored equal: {ok}")
    ctx.finish()
    return "sdk", ok and ctx.cuda, detail


def check_dcp(dir: str) -> Row:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    os.environ.update({"STALWART_SHM_DIR": os.path.join(dir, "dcp"), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    from stalwart.worker.adapters.dcp import Checkpointer, load_from
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    for m in model:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer()
    t_first = 0.0
    for step in range(10):
        model(torch.randn(32, 1024, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        ck.save({"model": msd, "optim": osd}, step)
        if step == 0:
            t_first = ck.blocking_s
    ck.ctx.mem.wait()
    steady = (ck.blocking_s - t_first) / 9
    sd = {"model": {k: torch.zeros_like(v.full_tensor()) for k, v in model.state_dict().items()}}
    step = load_from(ck.ctx.mem.dir, sd)
    ok = step == 9 and all(torch.equal(sd["model"][k].cuda(), v.full_tensor())
                           for k, v in model.state_dict().items())
    ck.ctx.finish()
    dist.destroy_process_group()
    return "dcp adapter", ok, (f"FSDP2 on 1 GPU: first save (plan) {1e3 * t_first:.1f} ms, then "
                               f"{1e3 * steady:.2f} ms/save, restored equal: {ok}")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(rows: list[Row]) -> str:
    w = max(len(r[0]) for r in rows)
    lines = [f"{'check':{w}s}  ok    detail", f"{'-' * w}  ----  ------"]
    lines += [f"{name:{w}s}  {'yes' if ok else 'NO':4s}  {detail}" for name, ok, detail in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the pinned snapshot's tensor")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"gpu_smoke: {reason}; nothing to check")
        return 0
    print(f"gpu_smoke: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        checks: list[tuple[str, Callable[[], Row]]] = [
            ("nvml", check_nvml), ("pinned-shm snapshot", lambda: check_pinned(a.mib, d)),
            ("memckpt", lambda: check_memckpt(os.path.join(d, "mem"))), ("nccl abort/re-init", check_nccl),
            ("sdk", lambda: check_sdk(d)), ("dcp adapter", lambda: check_dcp(d))]
        for name, fn in checks:
            try:
                rows.append(fn())
            except Exception as e:       # one failed check is a row, not the end of the run
                traceback.print_exc()
                rows.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            print(f"  {rows[-1][0]}: {'ok' if rows[-1][1] else 'FAILED'}", flush=True)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"check": n, "ok": ok, "detail": d} for n, ok, d in rows], f, indent=1)
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
