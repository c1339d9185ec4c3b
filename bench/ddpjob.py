"""The DDP job of `bench/overhead.py --ddp`: an ordinary torchrun script (DDP over gloo, its own
`init_process_group`), with stalwart's DCP adapter taking an every-step in-memory checkpoint when
`--dcp` is given. Rank 0 prints one JSON line a step: its number, wall time and, with `--dcp`, the
seconds the adapter's saves held the training thread so far (`sdk_s`, as the SDK's GPT prints).

    torchrun --nproc-per-node 4 bench/ddpjob.py --steps 200
    stalwart run --machines 2 --gpus-per-machine 2 -- python bench/ddpjob.py --steps 200 --dcp
"""
import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dcp", action="store_true", help="an every-step checkpoint through stalwart's DCP adapter")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.dcp:
        from stalwart.worker.adapters.dcp import Checkpointer   # (a warm standby waits here for its ranks)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.dim, a.dim), torch.nn.GELU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer() if a.dcp else None
    start = 0
    if ckpt is not None:
        state = {"model": model.module.state_dict(), "optim": opt.state_dict()}
        start = ckpt.load(state)
        if start:
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
    for step in range(start, a.steps):
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        x = torch.randn(a.batch, a.dim, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x.flip(1)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ckpt is not None:
            ckpt.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, step)
        if rank == 0:
            line = {"step": step, "t": time.time(), "loss": loss.item()}
            if ckpt is not None:
                line["sdk_s"] = ckpt.blocking_s
            print(json.dumps(line), flush=True)
    if ckpt is not None:
        ckpt.ctx.finish()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
