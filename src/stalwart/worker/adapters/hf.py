"""A Hugging Face `TrainerCallback` that puts `transformers.Trainer` under stalwart
(extra: `stalwart[hf]`).

    from stalwart.worker.adapters import hf
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    cb = hf.install(trainer)                               # adds the callback
    trainer.train(resume_from_checkpoint=cb.resume_dir())  # None on a fresh start

What it does:
- `on_train_begin`: joins the job on the process groups Accelerate built (`worker.attach()`);
  under DDP, registers the gradient-check communication hook (`adapters.ddp`) on the wrapped model;
- every optimizer step (`on_step_end`): the model's, optimizer's and scheduler's state and the
  `TrainerState` and the random generators' states (Python's, NumPy's, torch's: dropout draws
  from them) copied into the in-memory tier (the step waits for the copy alone); the step is
  reported with the loss and gradient norm the Trainer logs (`logging_steps=1` reports each
  step's loss; a step without a log is reported without one);
- `resume_dir`: the state this run restores (from this rank's memory, its backup peer's or the
  durable tier, as the agent found it) written as a Trainer checkpoint directory
  (`pytorch_model.bin`, `optimizer.pt`, `scheduler.pt`, `trainer_state.json`,
  `rng_state_<rank>.pth`), so the Trainer restores it, its position in the data and its random
  draws included, through `resume_from_checkpoint`: a step trained again gives the same loss.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from stalwart.protocol import Restored
from stalwart.worker.adapters import require, restored_state, rng_state
from stalwart.worker.standby import wait_if_standby

_tf = require("transformers", "hf", "Hugging Face")
wait_if_standby()      # a warm standby waits here for its ranks, its framework loaded


class StalwartCallback(_tf.TrainerCallback):  # type: ignore[misc,name-defined]
    def __init__(self, trainer: Any = None, checkpoint: bool = True) -> None:
        self.trainer = trainer
        self.checkpoint = checkpoint
        self.ctx: Any = None
        self.watch: Any = None
        self._pending: int | None = None     # a step not reported yet (waiting for its log line)
        self._restored: tuple[int, str] | None = None

    def resume_dir(self) -> str | None:
        """A Trainer checkpoint directory of the state this run restores, or None on a fresh start."""
        got = restored_state()
        if got is None:
            return None
        rank, step, state, tier, root = got
        out = os.path.join(root, f"stalwart-resume-rank{rank:05d}", f"checkpoint-{step + 1}")
        os.makedirs(out, exist_ok=True)
        torch.save(state["model"], os.path.join(out, "pytorch_model.bin"))
        torch.save(state["optimizer"], os.path.join(out, "optimizer.pt"))
        if state.get("scheduler") is not None:
            torch.save(state["scheduler"], os.path.join(out, "scheduler.pt"))
        with open(os.path.join(out, "trainer_state.json"), "w") as f:
            f.write(state["trainer_state"])
        if state.get("rng") is not None:    # (a distributed Trainer reads its process index's file)
            torch.save(state["rng"], os.path.join(out, f"rng_state_{rank}.pth"))
            torch.save(state["rng"], os.path.join(out, "rng_state.pth"))
        self._restored = (step, tier)
        return out

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.ctx is None:
            from stalwart import worker
            self.ctx = worker.attach()
            if self._restored is not None:
                step, tier = self._restored
                self.ctx.link.send(Restored(rank=self.ctx.rank, step=step, tier=tier))
        wrapped = getattr(self.trainer, "model_wrapped", None)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and self.watch is None:
            from stalwart.worker.adapters import ddp
            self.watch = ddp.watch(wrapped, self.ctx, start_step=state.global_step)

    def _report(self, step: int, loss: float | None = None, grad_norm: float | None = None) -> None:
        if self.watch is not None:
            self.watch.report(step, loss=loss)
        else:
            self.ctx.report(step, loss=loss, grad_norm=grad_norm)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._pending is not None:         # the previous step had no log line
            self._report(self._pending)
            self._pending = None
        self.ctx.begin_step(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kw: Any) -> None:
        step = state.global_step - 1
        self._pending = step
        if self.checkpoint and model is not None and optimizer is not None:
            snap = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                    "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
                    "rng": rng_state()}
            self.ctx.checkpoint(snap, step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
        if self._pending is not None and logs and "loss" in logs:
            gn = logs.get("grad_norm")
            self._report(self._pending, loss=float(logs["loss"]), grad_norm=float(gn) if gn is not None else None)
            self._pending = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.ctx is None:
            return
        if self._pending is not None:
            self._report(self._pending)
            self._pending = None
        self.ctx.finish()       # the last commit is flushed; attached: the groups stay Accelerate's
        self.ctx = None


def install(trainer: Any, checkpoint: bool = True) -> StalwartCallback:
    """Add a `StalwartCallback` to `trainer` (which it needs to find the DDP-wrapped model)."""
    cb = StalwartCallback(trainer, checkpoint=checkpoint)
    trainer.add_callback(cb)
    return cb
