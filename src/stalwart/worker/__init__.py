"""The stalwart worker SDK, used inside training scripts (optional: plain scripts work too).

    from stalwart import worker
    ctx = worker.init(tp=2, pp=2)
    start, state = ctx.restore()
    for step in range(start, steps):
        ctx.begin_step(step)
        ...                                   # forward / backward
        ctx.on_gradients(step, model.parameters())
        ...                                   # data-parallel reduction, optimizer step
        ctx.report(step, loss=loss, grad_norm=gn, tokens=n)
        ctx.checkpoint(state_dict, step)
    ctx.finish()

A script that builds its own process groups (`init_process_group`, DDP, FSDP2, a framework's
strategy) joins the job with `worker.attach()` instead of `init()`; the adapters in
`stalwart.worker.adapters` (DCP, DDP, Lightning, Hugging Face) do that for it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.worker.context import Context


def init(tp: int | None = None, pp: int | None = None, dp: int | None = None, cp: int | None = None,
         ep: int | None = None, timeout_s: float = 60.0) -> Context:
    """Join the job: rendezvous, process groups for every parallel dimension, link to the agent."""
    from stalwart.worker.context import Context
    return Context(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, timeout_s=timeout_s)


def attach(timeout_s: float = 60.0) -> Context:
    """Join the job from a script that called `torch.distributed.init_process_group` itself: the
    link to the agent, the job's topology, metrics and the in-memory checkpoint, on the script's
    own process groups (the context never creates or destroys a group)."""
    from stalwart.worker.context import Context
    return Context(timeout_s=timeout_s, attach=True)


def __getattr__(name: str) -> Any:
    # `Context` (and torch with it) loads on first use: the agent imports this package's
    # memckpt format helpers and must not pay torch's import (1.7 s of CPU per agent at start-up)
    if name == "Context":
        from stalwart.worker.context import Context
        return Context
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["init", "attach", "Context"]
