"""A Lightning script under stalwart: one callback, one argument to `fit`.

    stalwart run --machines 2 --gpus-per-machine 1 --standby 1 -- python examples/lightning_train.py

The model is a tiny random-initialized regressor (nothing downloaded); each step's batch is
generated from the step's number and the rank, so a resumed run trains a redone step on the same
batch. `Trainer`
runs DDP on CPU with gloo over the ranks stalwart (or torchrun) starts. `StalwartCallback` reports
each step's loss and per-rank gradient norms, copies Lightning's whole checkpoint into the
in-memory tier every step, and `resume_path()` hands a restarted run that checkpoint.
"""
import argparse
import os

import torch

from stalwart.worker.adapters.lightning import StalwartCallback, _pl as L


class Steps(torch.utils.data.Dataset):
    """The job's samples, drawn from the optimizer step and the rank (`batch`), not from the
    position in an epoch: Lightning restarts a plain DataLoader's epoch on resume, while a step's
    batch must be the same whenever the step is trained (a real data set wants a stateful loader)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def batch(step: int, rank: int, n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(n, dim, generator=g)
    return x, torch.tanh(x.flip(1))


class Net(L.LightningModule):
    def __init__(self, dim: int, layers: int, batch: int):
        super().__init__()
        self.dim, self.batch = dim, batch
        torch.manual_seed(0)
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*mods)

    def training_step(self, indices, batch_idx):
        x, y = batch(self.global_step, self.global_rank, self.batch, self.dim)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 0:
            print(f"step {self.global_step} loss {loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cb = StalwartCallback()
    trainer = L.Trainer(accelerator="cpu", devices=local, num_nodes=max(1, world // local),
                        strategy="ddp" if world > 1 else "auto", max_steps=a.steps, max_epochs=-1,
                        callbacks=[cb], enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.DataLoader(Steps(a.steps * world), batch_size=1, shuffle=False)
    model = Net(a.dim, a.layers, a.batch)
    trainer.fit(model, data, ckpt_path=cb.resume_path())
    if trainer.global_rank == 0:
        print(f"final step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
