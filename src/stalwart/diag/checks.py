"""The checks of the stop-time diagnostics, as run by one process on a machine.

Each check returns ``{"check": name, "ok": bool, "detail": str, "measure": {...}}`` and does not
raise for what looks like a hardware or network failure: that is a failed result. Where the
machine has no GPU, the simulated GPU's view (`SimGpuView`) decides what the "GPU" does: die
(`fatal`), run slow (`slowdown`), corrupt arithmetic (`corrupts`) or hold bad memory (ECC).
"""
from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import statistics
import subprocess
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch._C._distributed_c10d import AllgatherOptions

from stalwart.worker.simgpu_view import corrupt_

SELFTEST_TOL = 1e-4          # max |C - ref| / max |ref| of an n x n float32 matmul
MATMUL_REPS = 4              # timed matmuls for the speed measure, per batch
BENCH_TRIES = 3              # batches timed (at least); the fastest counts
BENCH_MIN_S = 0.15           # ...and more batches until this long has passed (at most BENCH_MAX)
BENCH_MAX = 60
PATTERN_BYTES = 16 << 20     # memory pattern test size
PATTERNS = (0x55555555, 0xAAAAAAAA - 2**32)  # 0x55.. and 0xAA.. as int32 values
ALIGN_SHAPE = dict(vocab_size=64, d_model=32, n_heads=2, d_ff=64, n_layers=2, seq_len=16)
ALIGN_BATCH = 2


def result(check: str, ok: bool, detail: str, **measure) -> dict:
    return {"check": check, "ok": bool(ok), "detail": detail, "measure": measure}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _bad_memory(state: dict) -> bool:
    """Whether the (simulated) GPU has memory that no longer holds what was written."""
    return state.get("ecc_dbe", 0) > 0 or bool(state.get("row_remap_failure"))


def _pattern_test(device: str, state: dict) -> str | None:
    """Write 0x55.., 0xAA.. and an index pattern over ~16 MB and read them back; None = passed."""
    count = PATTERN_BYTES // 4
    t = torch.empty(count, dtype=torch.int32, device=device)
    ref = torch.arange(count, dtype=torch.int32, device=device)
    for name, fill in (("0x55", PATTERNS[0]), ("0xAA", PATTERNS[1]), ("index", None)):
        if fill is None:
            t.copy_(ref)
            expect = ref
        else:
            t.fill_(fill)
            expect = torch.full_like(t, fill)
        if _bad_memory(state):   # a bad cell: one bit pair flipped somewhere in the middle
            t[count // 3] ^= 0x3
        wrong = (t != expect).nonzero()
        if wrong.numel():
            offset = int(wrong[0]) * 4
            kind = ("double-bit ECC error" if state.get("ecc_dbe", 0) > 0
                    else "uncorrectable memory error")
            return f"{kind} at offset {offset:#x} ({name} pattern, {wrong.numel()} words wrong)"
    return None


def _dcgm(timeout_s: float = 120.0) -> dict | None:
    """`dcgmi diag -r 1` where DCGM is installed: {"ok", "detail"}; None where it is not."""
    if not shutil.which("dcgmi"):
        return None
    try:
        p = subprocess.run(["dcgmi", "diag", "-r", "1"], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "detail": f"dcgmi diag -r 1: {type(e).__name__}: {e}"}
    text = (p.stdout + p.stderr).strip()
    ok = p.returncode == 0 and not re.search(r"\bFail", text)
    return {"ok": ok, "detail": "dcgmi diag -r 1: " + ("pass" if ok else text[-400:])}


def selftest(gpu, device: str = "cpu", n: int = 384, seed: int = 0) -> dict:
    """Accelerator self-test: a checked float32 matmul, its speed, and a memory pattern test."""
    line = gpu.fatal()
    if line:
        return result("selftest", False, line, device=device)
    try:
        gen = torch.Generator().manual_seed(seed)
        a, b = (torch.randn(n, n, generator=gen) for _ in range(2))
        da, db = a.to(device), b.to(device)
        c = da @ db
        _sync(device)
        if gpu.corrupts():
            corrupt_(c)
        ref = a.double() @ b.double()
        err = float((c.cpu().double() - ref).abs().max() / ref.abs().max())
        if device.startswith("cuda"):   # big enough to time the GPU, not the launches
            da, db = (torch.randn(4096, 4096, device=device) for _ in range(2))
        size = da.shape[0]
        elapsed, tries, began = float("inf"), 0, time.perf_counter()
        # the fastest of several batches over a short while: a machine whose CPU is briefly taken
        # by something else (other machines' checks, on a local cluster) still shows its speed
        while tries < BENCH_TRIES or (time.perf_counter() - began < BENCH_MIN_S and tries < BENCH_MAX):
            start = time.perf_counter()
            for _ in range(MATMUL_REPS):
                da @ db
            _sync(device)
            elapsed = min(elapsed, time.perf_counter() - start)
            tries += 1
        slow = gpu.slowdown()
        if slow > 1:           # a throttled GPU: the same work takes `slow` times as long
            time.sleep((slow - 1) * elapsed)
            elapsed *= slow
        gflops = 2 * size**3 * MATMUL_REPS / max(elapsed, 1e-9) / 1e9
        measure = {"device": device, "rel_err": err, "gflops": round(gflops, 3), "n": n, "tries": tries}
        if err > SELFTEST_TOL:
            return result("selftest", False,
                          f"matmul mismatch: max relative error {err:.3g} > {SELFTEST_TOL:g} "
                          "(silent data corruption)", **measure)
        memory = _pattern_test(device, gpu.state())
        if memory:
            return result("selftest", False, memory, **measure)
        dcgm = _dcgm() if device.startswith("cuda") else None
        if dcgm is not None:
            measure["dcgm"] = dcgm
            if not dcgm["ok"]:
                return result("selftest", False, dcgm["detail"], **measure)
        return result("selftest", True, f"matmul {n}x{n} ok ({gflops:.1f} GFLOP/s), "
                      "memory patterns ok", **measure)
    except Exception as e:  # noqa: BLE001 - a device error is a failed check, not a crash
        return result("selftest", False, f"{type(e).__name__}: {e}", device=device)


def alignment_digest(gpu, seed: int = 1234, device: str = "cpu") -> dict:
    """Bitwise alignment test: sha256 of the loss and grads of one fixed tiny-GPT step."""
    from stalwart.examples.model import GPTConfig, GPTStage

    line = gpu.fatal()
    if line:
        return result("align", False, line)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        cfg = GPTConfig(**ALIGN_SHAPE)
        model = GPTStage(cfg, seed).to(device)
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab_size, (ALIGN_BATCH, cfg.seq_len + 1), generator=gen)
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        with _math_attention(device):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
            loss.backward()
        params = list(model.parameters())
        if gpu.corrupts():
            with torch.no_grad():
                for p in params:
                    corrupt_(p.grad)
        h = hashlib.sha256()
        for t in [loss.detach()] + [p.grad for p in params]:
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        return result("align", True, f"one step of a {cfg.n_layers}-layer GPT, "
                      f"{len(params)} grads hashed", digest=h.hexdigest(),
                      loss=float(loss.detach()))
    except Exception as e:  # noqa: BLE001
        return result("align", False, f"{type(e).__name__}: {e}")
    finally:
        torch.set_num_threads(threads)


def _math_attention(device: str):
    """On CUDA, the deterministic math attention kernel; on CPU nothing to choose."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


def intra_alltoall(pg, rank: int, world: int, nbytes: int = 1 << 20,
                   timeout_s: float = 10.0) -> dict:
    """All-to-all among the machine's processes; element from src to dst = src*1000 + dst."""
    try:
        chunk = max(1, nbytes // 4 // max(world, 1))
        send = torch.cat([torch.full((chunk,), float(rank * 1000 + dst)) for dst in range(world)])
        recv = torch.empty_like(send)
        start = time.perf_counter()
        pg.alltoall_base(recv, send, [], [], timedelta(seconds=timeout_s)).wait()
        seconds = time.perf_counter() - start
        expect = torch.cat([torch.full((chunk,), float(src * 1000 + rank)) for src in range(world)])
        mbps = recv.numel() * 4 * 8 / 1e6 / max(seconds, 1e-9)
        measure = {"seconds": round(seconds, 6), "mbps": round(mbps, 3), "world": world}
        wrong = (recv != expect).nonzero()
        if wrong.numel():
            src = int(wrong[0]) // chunk
            return result("intra", False, f"all-to-all data mismatch: {wrong.numel()} values "
                          f"from local rank {src} wrong", **measure)
        return result("intra", True, f"all-to-all among {world} processes ok", **measure)
    except Exception as e:  # noqa: BLE001 - a timeout or a lost peer is a failed check
        return result("intra", False, f"{type(e).__name__}: {e}")


def _pattern(rank: int, count: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32) % 65536 + rank * 65536


LAT_REPS = 9                 # tiny all-gathers timed for a pair's latency (the median counts)
SIZES_FROM = 16 << 10        # bandwidth: all-gathers of doubling sizes from 16 KiB ...
MEASURED_S = 0.25            # ... until one takes this long (enough to measure) or the size reaches nbytes


def pair_allgather(pg, rank: int, nbytes: int = 1 << 21, timeout_s: float = 10.0) -> dict:
    """All-gathers between the two machines of a pair: latency, bandwidth, content checked.

    ``latency_s`` is the median time of ``LAT_REPS`` all-gathers of 16 bytes. Bandwidth: all-gathers
    of doubling sizes from ``SIZES_FROM`` up to ``nbytes``, stopping at the first that takes
    ``MEASURED_S`` or longer, so a throttled link is measured in about a second instead of timing
    out on the full size (the first sizes fit in a shaper's burst; a size that takes a while does
    not); both ends agree on when to stop (each size's slower time is exchanged). ``mbps`` is
    megabits per second of the bytes received from the peer at the last size, the fastest of
    ``BENCH_TRIES`` transfers. The content of every transfer is checked.
    """
    opts = AllgatherOptions()
    opts.timeout = timedelta(seconds=timeout_s)
    peer = 1 - rank

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t), torch.empty_like(t)]
        pg.allgather([out], [t], opts).wait()
        return out

    try:
        gather(torch.full((4,), float(rank)))                     # both ends are there
        lat = []
        for _ in range(LAT_REPS):
            start = time.perf_counter()
            gather(torch.full((4,), float(rank)))
            lat.append(time.perf_counter() - start)
        latency = statistics.median(lat)
        size, wrong = min(SIZES_FROM, max(4, nbytes)), 0

        def timed(t: torch.Tensor, expect: torch.Tensor) -> tuple[float, int]:
            start = time.perf_counter()
            out = gather(t)
            return time.perf_counter() - start, int((out[peer] != expect).sum())

        def agree(seconds: float, wrong: int) -> bool:
            """Whether either end saw this size take MEASURED_S or a mismatch: both ends stop
            together, so both run the same collectives."""
            other = gather(torch.tensor([seconds, float(wrong)], dtype=torch.float64))[peer]
            return bool(wrong or other[1] or max(seconds, float(other[0])) >= MEASURED_S)

        while True:
            count = max(1, size // 4)
            mine, theirs = _pattern(rank, count), _pattern(peer, count)
            seconds = float("inf")
            for _ in range(BENCH_TRIES):     # the fastest of a few: a stalled transfer (a busy
                took, bad = timed(mine, theirs)      # host) is not a slow link
                seconds, wrong = min(seconds, took), max(wrong, bad)
            if agree(seconds, wrong) or size >= nbytes:
                break
            size = min(size * 2, nbytes)
        mbps = count * 4 * 8 / 1e6 / max(seconds, 1e-9)
        measure = {"seconds": round(seconds, 6), "mbps": round(mbps, 3), "bytes": count * 4,
                   "latency_s": round(latency, 6)}
        if wrong:
            return result("inter", False, f"all-gather data mismatch: {wrong} of {count} values from "
                          f"the peer wrong", **measure)
        return result("inter", True, f"all-gather ok: {mbps:.1f} Mbit/s at {count * 4} bytes, "
                      f"latency {latency * 1e3:.2f} ms", **measure)
    except Exception as e:  # noqa: BLE001
        return result("inter", False, f"{type(e).__name__}: {e}")
