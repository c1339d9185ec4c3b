"""A plain torch.distributed training script: no stalwart SDK. The agents start it exactly as
torchrun would (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment; the rendezvous
store is the controller's, TORCHELASTIC_USE_AGENT_STORE says so).

Each step computes for `--step-s` seconds (CPU-bound matrix products) and then all-reduces its
result; every `--eval-every` steps rank 0 alone computes `--eval-s` seconds more (an evaluation)
while the other ranks wait for it inside the next all-reduce. Each step prints one line.
`--stuck-at-exit RANK` makes that rank never exit after the training (it waits without using CPU,
as a process deadlocked in its teardown does).
"""
import argparse
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist


def compute(seconds: float, a: torch.Tensor) -> torch.Tensor:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
    return a


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--eval-s", type=float, default=8.0)
    ap.add_argument("--stuck-at-exit", type=int, default=None, metavar="RANK")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    x = torch.full((32, 32), 0.01) * (rank + 1)
    for step in range(a.steps):
        x = compute(a.step_s, x)
        if rank == 0 and a.eval_every and step and step % a.eval_every == 0:
            compute(a.eval_s, x.clone())
        dist.all_reduce(x)
        x = x / dist.get_world_size()
        print(f"step {step} pid {os.getpid()} t {time.time():.3f}", flush=True)
    dist.destroy_process_group()
    if rank == a.stuck_at_exit:
        print(f"rank {rank} stuck at exit", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
