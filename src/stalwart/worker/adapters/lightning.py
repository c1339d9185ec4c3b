"""A Lightning `Callback` that puts a `Trainer` under stalwart (extra: `stalwart[lightning]`).

    from stalwart.worker.adapters.lightning import StalwartCallback
    cb = StalwartCallback()
    trainer = L.Trainer(..., callbacks=[cb])
    trainer.fit(model, data, ckpt_path=cb.resume_path())   # None on a fresh start

What it does, each hook where Lightning gives the moment:
- `setup`: joins the job on the strategy's process groups (`stalwart.worker.attach()`);
- `on_fit_start`: under DDP, registers the gradient-check communication hook (`adapters.ddp`) on
  the wrapped model: per-rank gradient norms before the reduction, the reduced norm after it;
- each training batch: `begin_step`, then the step's report (loss, gradient norms) and Lightning's
  whole checkpoint (model, optimizers, schedulers, loops' progress, callbacks' state: what
  `trainer.save_checkpoint` would write) copied into the in-memory tier, every step, the step
  waiting for the copy alone; this callback's own state in it is the random generators' (Lightning
  keeps none), put back before the first step a restored run trains, so that a step trained again
  draws the same dropout masks and gives the same loss;
- `resume_path`: the checkpoint this run restores (the agent materialized it from this rank's
  memory, its backup peer's or the durable tier), written as a Lightning checkpoint file for
  `fit(ckpt_path=...)`, so Lightning restores everything itself, its loops included;
- `teardown`: the last commit is flushed (`ctx.finish`); the strategy's groups stay the strategy's.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from stalwart.protocol import Restored
from stalwart.worker.adapters import require, restored_state, rng_state, set_rng_state
from stalwart.worker.standby import wait_if_standby

_pl = require("lightning.pytorch", "lightning", "Lightning")
wait_if_standby()      # a warm standby waits here for its ranks, its framework loaded


class StalwartCallback(_pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, checkpoint: bool = True) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.ctx: Any = None
        self.watch: Any = None
        self._restored: tuple[int, str] | None = None
        self.start_step = 0       # the first step this run trains (after `resume_path`)
        self._rng: dict | None = None     # the generators' states to put back (a restored run)

    def resume_path(self) -> str | None:
        """A Lightning checkpoint file of the state this run restores, or None on a fresh start."""
        got = restored_state()
        if got is None:
            return None
        rank, step, state, tier, out_dir = got
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, f"stalwart-resume-rank{rank:05d}.ckpt")
        torch.save(state, out + ".tmp")
        os.replace(out + ".tmp", out)
        self._restored = (step, tier)
        self.start_step = step + 1
        return out

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.ctx is None:
            from stalwart import worker
            self.ctx = worker.attach()
            if self._restored is not None:
                step, tier = self._restored
                self.ctx.link.send(Restored(rank=self.ctx.rank, step=step, tier=tier))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        model = getattr(trainer.strategy, "model", None)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and self.watch is None:
            from stalwart.worker.adapters import ddp
            self.watch = ddp.watch(model, self.ctx, start_step=trainer.global_step)

    def state_dict(self) -> dict:
        return {"rng": rng_state(plain=True)}

    def load_state_dict(self, state_dict: dict) -> None:
        self._rng = state_dict.get("rng")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._rng is not None:             # (the first step after a restore)
            set_rng_state(self._rng)
            self._rng = None
        self.ctx.begin_step(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step - 1          # the optimizer step this batch completed
        if step < 0:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss_f = float(loss.detach()) if isinstance(loss, torch.Tensor) else None
        if self.watch is not None:
            self.watch.report(step, loss=loss_f)
        else:
            self.ctx.report(step, loss=loss_f)
        if self.checkpoint:
            self.ctx.checkpoint(trainer._checkpoint_connector.dump_checkpoint(weights_only=False), step)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.ctx is not None:
            self.ctx.finish()      # the last commit is flushed; attached: the groups stay Lightning's
            self.ctx = None
