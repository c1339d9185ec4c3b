"""FSDP2 (`fully_shard`) with an every-step checkpoint through stalwart's DCP adapter.

The script is an ordinary torchrun script (it builds its own process group and model) with three
stalwart lines: the `Checkpointer`, its `load` at start and its `save` each step. Under
`stalwart run` each save lands in shared memory (the agent backs it up to a peer outside the
rank's groups and to the durable tier) and a restarted run resumes from the newest step every rank
can restore; under plain `torchrun` it is DCP's own file checkpoint every STALWART_CKPT_EVERY steps.

    stalwart run --machines 2 --gpus-per-machine 1 --standby 1 -- python examples/fsdp2_dcp.py
    torchrun --nproc-per-node 2 examples/fsdp2_dcp.py

CPU and gloo here; on GPUs the same script runs with NCCL. Rank 0 prints each step's loss (its
own batch's, exactly: a resumed run repeats a redone step's line bit for bit) and the final one.
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from stalwart.worker.adapters.dcp import Checkpointer


def batch(step: int, rank: int, n: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(n, dim, generator=g)
    return x.to(device), torch.tanh(x.flip(1)).to(device)      # a fixed function to learn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step-s", type=float, default=0.0, help="extra seconds of compute per step")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.dim, a.dim), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ckpt = Checkpointer()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    start = ckpt.load(state)
    if start:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed at step {start}", flush=True)
    loss = torch.zeros(())
    t0 = time.perf_counter()
    for step in range(start, a.steps):
        x, y = batch(step, rank, a.batch, a.dim, device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if a.step_s:
            time.sleep(a.step_s)
        msd, osd = get_state_dict(model, opt)
        ckpt.save({"model": msd, "optim": osd}, step)
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
    if rank == 0:
        step_s = (time.perf_counter() - t0) / max(1, a.steps - start)
        print(f"final loss {loss.item()!r}; adapter: {ckpt.replans} plan ({1e3 * ckpt.plan_s:.1f} ms), then "
              f"{1e3 * ckpt.steady_blocking_s:.3f} ms/save, {100 * ckpt.steady_blocking_s / step_s:.2f}% of a "
              f"{1e3 * step_s:.1f} ms step", flush=True)
    ckpt.ctx.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
