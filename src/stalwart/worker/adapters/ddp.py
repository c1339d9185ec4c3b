"""Per-rank gradient checks for `DistributedDataParallel`, from a communication hook.

    from stalwart.worker.adapters import ddp
    model = DistributedDataParallel(net)
    watch = ddp.watch(model)                 # joins the job (worker.attach) unless given ctx=
    for step in range(start, steps):
        loss = ...; loss.backward(); opt.step(); opt.zero_grad()
        watch.report(step, loss=loss.item())  # step, loss, the reduced and this rank's grad norm

DDP reduces the gradients inside `backward()`, bucket by bucket, so a check written after
`backward` sees only the averaged gradients: a rank whose own gradients went non-finite is no
longer told apart. The hook sees each bucket twice: before the all-reduce (this rank's own
gradients: their norm, summed over the step's buckets, is the rank's local gradient norm the
controller compares across ranks to name the machine that corrupted an update) and after it (the
reduced gradients' norm, the step's `grad_norm`). The reduction itself is DDP's default one
(`allreduce_hook`): nothing is reduced by hand and nothing extra crosses the network.

The `nan` chaos (`--chaos "nan@step=S,machine=M"`) fills this rank's buckets with NaN before the
reduction from step S on, as the SDK's `on_gradients` does for hand-written loops.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from stalwart.worker.standby import wait_if_standby

wait_if_standby()      # a warm standby waits here for its ranks, torch loaded (worker/standby.py)


class GradWatch:
    """The state of the communication hook `watch` registers (one per DDP model)."""

    def __init__(self, ctx: Any, process_group: Any = None) -> None:
        self.ctx = ctx
        self.pg = process_group
        self.step = 0                       # the step the next backward belongs to
        self.local_grad_norm: float | None = None
        self.grad_norm: float | None = None
        self._local: list[torch.Tensor] = []
        self._reduced: list[torch.Tensor] = []
        # the buckets' reductions complete on the backend's threads, in any order: the norms are
        # taken once as many were reduced as the step has buckets (known at its last bucket)
        self._buckets: int | None = None
        self._lock = threading.Lock()

    def _before(self, bucket: dist.GradBucket) -> None:
        buf = bucket.buffer()
        chaos = getattr(self.ctx, "chaos_active", None)
        if chaos is not None and chaos("nan", self.step):
            buf.fill_(float("nan"))
        self._local.append(torch.linalg.vector_norm(buf.detach(), dtype=torch.float32))

    def _last_bucket(self) -> None:
        with self._lock:
            self._buckets = len(self._local)

    def _after(self, reduced: torch.Tensor) -> None:
        norm = torch.linalg.vector_norm(reduced.detach(), dtype=torch.float32)
        with self._lock:
            self._reduced.append(norm)
            if self._buckets is None or len(self._reduced) < self._buckets:
                return
            self._buckets = None
            # one conversion a step (a device sync on a GPU), once every bucket was reduced
            self.local_grad_norm = float(torch.linalg.vector_norm(torch.stack(self._local)))
            self.grad_norm = float(torch.linalg.vector_norm(torch.stack(self._reduced)))
            self._local, self._reduced = [], []
            if self.ctx is not None:
                self.ctx._local_grad_norm = self.local_grad_norm

    def report(self, step: int, loss: float | None = None, **extra: float) -> None:
        """Report `step` with its loss and the hook's gradient norms (the next backward is step+1's)."""
        self.ctx.report(step, loss=loss, grad_norm=self.grad_norm, **extra)
        self.step = step + 1


def _hook(watch, bucket):  # (unannotated: DDP checks real annotations, and this module's are strings)
    watch._before(bucket)
    if bucket.is_last():
        watch._last_bucket()

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        reduced = fut.value()
        if isinstance(reduced, list):
            reduced = reduced[0]
        watch._after(reduced)
        return reduced

    return allreduce_hook(watch.pg, bucket).then(done)


def watch(model: torch.nn.parallel.DistributedDataParallel, ctx: Any = None, process_group: Any = None,
          start_step: int = 0) -> GradWatch:
    """Register the gradient-check hook on a DDP model (before its first backward); the returned
    watch's `report` reports a step. `ctx`: a context from `stalwart.worker.attach()` (made here
    when None)."""
    if ctx is None:
        from stalwart import worker
        ctx = worker.attach()
    w = GradWatch(ctx, process_group)
    w.step = start_step
    model.register_comm_hook(w, _hook)
    return w
