"""A plain torchrun-style DDP training script: nothing of stalwart in it.

    torchrun --nproc-per-node 2 examples/ddp_plain.py --epochs 20
    stalwart run --nproc-per-node 2 --nnodes 2 --standby 1 examples/ddp_plain.py --epochs 20

The second line is the first with its first word changed (and stalwart's own options). The script
is what a tutorial's DDP script is: `init_process_group` from the environment torchrun (or a
stalwart agent) sets, a tiny model built from a config with random weights, a `DistributedSampler`
over a synthetic data set, and a snapshot (`torch.save`) every epoch that a restarted script
resumes from (`torch.load`). The snapshot path is relative: it lands in the directory the job was
started from, under torchrun and under stalwart alike.

Under stalwart it needs no change to get its steps counted (the optimizer-step hook), its ETTR
booked, a crashed or lost machine replaced and the run restarted: the restarted script resumes
from its own snapshot, so a failure costs the steps since the last epoch's end.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


@dataclasses.dataclass
class Config:
    """The model and the data: small enough for a CPU, random weights from a seed."""
    d_in: int = 32
    d_hidden: int = 128
    d_out: int = 8
    layers: int = 3
    samples: int = 2048
    seed: int = 0


def make_model(cfg: Config) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    dims = [cfg.d_in] + [cfg.d_hidden] * cfg.layers
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(dims[-1], cfg.d_out))


def make_data(cfg: Config) -> TensorDataset:
    """A regression task from a fixed random teacher: the loss goes down."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.samples, cfg.d_in, generator=g)
    teacher = torch.randn(cfg.d_in, cfg.d_out, generator=g)
    return TensorDataset(x, torch.tanh(x @ teacher))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--snapshot", default="snapshot.pt", help="where the snapshot is saved and resumed from")
    ap.add_argument("--log-every", type=int, default=1, help="rank 0 prints a line every this many steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()

    cfg = Config()
    model = DDP(make_model(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = make_data(cfg)
    sampler = DistributedSampler(data, shuffle=True, seed=cfg.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    epoch0, step = 0, 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, map_location="cpu")
        model.module.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optim"])
        epoch0, step = snap["epoch"], snap["step"]
        if rank == 0:
            print(f"resumed from {args.snapshot}: epoch {epoch0}, step {step}", flush=True)

    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and args.log_every and step % args.log_every == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} t {time.time():.3f}", flush=True)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "epoch": epoch + 1,
                        "step": step}, args.snapshot)
            print(f"epoch {epoch} done: snapshot saved at step {step}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
