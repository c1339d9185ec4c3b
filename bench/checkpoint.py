"""Every-step checkpoint cost: stalwart's MemCheckpointer vs torch.save vs DCP async_save.

    python bench/checkpoint.py --steps 200

Trains a small GPT-like model (built inline) in one process and measures, per mode, the blocking
time of the checkpoint call and the steps/s of the whole loop:

  none      no checkpoint
  memckpt   stalwart MemCheckpointer.snapshot every step (/dev/shm, CRC + header in background)
  save      synchronous torch.save every step to /tmp
  dcp       torch.distributed.checkpoint.async_save every step (gloo, world 1)

Modes are interleaved in rounds (none, memckpt, save, dcp, none, …) so that drift in a shared
machine's load hits all of them alike. Prints a table and each mode's throughput ratio vs `none`.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from stalwart.worker.memckpt import MemCheckpointer  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[: idx.shape[1], : idx.shape[1]])
        return self.head(self.ln(x))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Modes:
    """Holds the checkpoint back-ends; `call(mode, state, step)` is the blocking part of a step."""

    def __init__(self, work: str, want_dcp: bool):
        self.work = work
        self.mem = MemCheckpointer(os.path.join(work, "shm"), rank=0, layout={"tp": 1, "pp": 1, "dp": 1})
        self.save_path = os.path.join(work, "save.pt")
        self.dcp_future = None
        self.dcp_error = None
        self.dcp = None
        if want_dcp:
            try:
                import torch.distributed as dist
                import torch.distributed.checkpoint as dcp
                if not dist.is_initialized():
                    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                            rank=0, world_size=1)
                self.dcp = dcp
            except Exception as e:  # noqa: BLE001 — reported in the output
                self.dcp_error = f"{type(e).__name__}: {e}"

    def call(self, mode: str, state, step: int) -> None:
        if mode == "memckpt":
            self.mem.snapshot(state, step)
        elif mode == "save":
            torch.save(state, self.save_path)
        elif mode == "dcp":
            if self.dcp_future is not None:
                self.dcp_future.result()        # one in flight at a time: waiting is blocking time
            self.dcp_future = self.dcp.async_save(state, checkpoint_id=os.path.join(self.work, "dcp", str(step % 2)))

    def drain(self, mode: str) -> None:
        if mode == "memckpt":
            self.mem.wait()
        elif mode == "dcp" and self.dcp_future is not None:
            self.dcp_future.result()
            self.dcp_future = None

    def close(self) -> None:
        self.mem.close()
        if self.dcp is not None:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="measured steps per mode")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds the steps are split into")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--modes", default="none,memckpt,save,dcp")
    args = ap.parse_args(argv)
    if args.steps < args.rounds or args.rounds < 1:
        raise SystemExit("--steps must be >= --rounds >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("none", "memckpt", "save", "dcp"):
            raise SystemExit(f"unknown mode {m!r}")

    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.layers, max(1, args.d // 64), args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    nparams = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)

    def step_fn():
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="stalwart-bench-ckpt-", dir=shm)
    save_dir = tempfile.mkdtemp(prefix="stalwart-bench-save-", dir="/tmp")
    res = {m: {"wall": 0.0, "cpu": 0.0, "block": [], "steps": 0} for m in modes}
    try:
        ck = Modes(work, "dcp" in modes)
        ck.save_path = os.path.join(save_dir, "save.pt")
        if "dcp" in modes and ck.dcp is None:
            print(f"dcp skipped: process group init failed ({ck.dcp_error})")
            modes.remove("dcp")
        for _ in range(3):
            step_fn()                                   # warm up (allocator, optimizer state)
        state = lambda s: {"model": model.state_dict(), "optim": opt.state_dict(),  # noqa: E731
                           "rng": torch.get_rng_state(), "step": s}
        sbytes = sum(t.numel() * t.element_size() for t in
                     list(model.state_dict().values()) + [v for st in opt.state_dict()["state"].values()
                                                          for v in st.values() if torch.is_tensor(v)])
        for m in list(modes):                            # warm each mode once (allocation, first DCP plan)
            try:
                ck.call(m, state(0), 0)
                ck.drain(m)
            except Exception as e:  # noqa: BLE001 — reported in the output
                print(f"{m} skipped: {type(e).__name__}: {e}")
                modes.remove(m)
        per_round = math.ceil(args.steps / args.rounds)
        step = 1
        for _ in range(args.rounds):
            for m in modes:
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(per_round):
                    step_fn()
                    if m != "none":
                        b0 = time.perf_counter()
                        ck.call(m, state(step), step)
                        res[m]["block"].append(time.perf_counter() - b0)
                    step += 1
                ck.drain(m)
                res[m]["wall"] += time.perf_counter() - t0
                res[m]["cpu"] += time.process_time() - c0
                res[m]["steps"] += per_round
        ck.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(save_dir, ignore_errors=True)

    print(f"model {nparams / 1e6:.2f} M params; checkpointed tensors {sbytes / 2**20:.1f} MiB; "
          f"{res[modes[0]]['steps']} steps per mode in {args.rounds} interleaved rounds; "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    base = res["none"]["steps"] / res["none"]["wall"] if "none" in modes else None
    print(f"load average {os.getloadavg()[0]:.1f} (a loaded machine makes wall-clock ratios noisy; "
          f"cpu s/step counts every thread of this process)")
    print(f"{'mode':<9} {'steps/s':>8} {'vs none':>8} {'cpu s/step':>11} {'block p50 ms':>13} {'block p99 ms':>13} "
          f"{'block mean ms':>14}")
    for m in modes:
        r = res[m]
        sps = r["steps"] / r["wall"]
        ratio = f"{sps / base:.3f}" if base else "-"
        cps = r["cpu"] / r["steps"]
        if r["block"]:
            b = sorted(r["block"])
            p50, p99, mean = (b[len(b) // 2] * 1e3, b[min(len(b) - 1, int(len(b) * 0.99))] * 1e3,
                              statistics.fmean(b) * 1e3)
            print(f"{m:<9} {sps:8.2f} {ratio:>8} {cps:11.3f} {p50:13.2f} {p99:13.2f} {mean:14.2f}")
        else:
            print(f"{m:<9} {sps:8.2f} {ratio:>8} {cps:11.3f} {'-':>13} {'-':>13} {'-':>14}")
    if base and "memckpt" in modes:
        loss = 1 - res["memckpt"]["steps"] / res["memckpt"]["wall"] / base
        cpu = res["memckpt"]["cpu"] / res["memckpt"]["steps"] / (res["none"]["cpu"] / res["none"]["steps"]) - 1
        print(f"memckpt throughput loss vs none: {loss * 100:.2f}% wall, {cpu * 100:.2f}% cpu (target <= 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
