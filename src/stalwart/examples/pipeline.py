"""GPipe schedule for the example: all forwards, then all backwards, over micro-batches.

Stages exchange activations forward and activation gradients backward with blocking
``dist.send`` / ``dist.recv`` in the PP group (peers named by global rank). Every stage runs
the micro-batches in the same order, so the chain of sends never forms a cycle.

Every send goes through :func:`stage_send`, which first calls the optional ``before_send``
hook: the worker SDK's ``stage-hang`` chaos blocks there, so a hung stage's stack shows it
inside the pipeline's communication while its neighbour waits in ``dist.recv``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stalwart.examples.model import GPTStage


@dataclass(frozen=True)
class StageLinks:
    """Where this stage sits in its pipeline: neighbour global ranks (None at the ends)."""

    pp_rank: int = 0
    pp_size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None
    group: object = None

    @classmethod
    def from_ranks(cls, pp_ranks: tuple[int, ...] | list[int], pp_rank: int,
                   group: object = None) -> "StageLinks":
        """Links for stage ``pp_rank`` of a pipeline whose global ranks are ``pp_ranks``."""
        n = len(pp_ranks)
        if not 0 <= pp_rank < n:
            raise ValueError(f"pp_rank {pp_rank} is not a stage of a pipeline of {n}")
        return cls(pp_rank, n, pp_ranks[pp_rank - 1] if pp_rank > 0 else None,
                   pp_ranks[pp_rank + 1] if pp_rank < n - 1 else None, group)


def split_micro(t: torch.Tensor, micro_batches: int) -> list[torch.Tensor]:
    """Split a local batch along dim 0 into ``micro_batches`` equal pieces."""
    if micro_batches < 1 or t.shape[0] % micro_batches:
        raise ValueError(f"local batch {t.shape[0]} is not divisible into "
                         f"{micro_batches} micro-batches")
    return list(t.chunk(micro_batches, dim=0))


def stage_send(t: torch.Tensor, dst: int, links: StageLinks,
               before_send: Callable[[], None] | None = None, comm: list[float] | None = None) -> None:
    """Send ``t`` to the neighbour stage ``dst`` (blocking), after the ``before_send`` hook;
    the seconds it took are added to ``comm[0]``."""
    if before_send is not None:
        before_send()
    start = time.perf_counter()
    dist.send(t, dst=dst, group=links.group)
    if comm is not None:
        comm[0] += time.perf_counter() - start


def stage_recv(t: torch.Tensor, src: int, links: StageLinks, comm: list[float] | None = None) -> None:
    """Receive ``t`` from the neighbour stage ``src`` (blocking); the wait is added to ``comm[0]``."""
    start = time.perf_counter()
    dist.recv(t, src=src, group=links.group)
    if comm is not None:
        comm[0] += time.perf_counter() - start


def gpipe_step(stage: GPTStage, inputs: torch.Tensor, targets: torch.Tensor,
               micro_batches: int, links: StageLinks,
               before_send: Callable[[], None] | None = None,
               comm: list[float] | None = None) -> torch.Tensor | None:
    """Run forward and backward of one local batch through the pipeline; grads accumulate.

    Returns the mean cross-entropy over the local batch (a detached scalar) on the last
    stage and None elsewhere. Each micro-batch loss is scaled by ``1/micro_batches`` before
    backward, so the accumulated gradient is that of the local-batch mean.
    ``before_send`` is called before every send to a neighbour stage (see :func:`stage_send`);
    the seconds spent in sends and receives are added to ``comm[0]`` when given.
    """
    xs = split_micro(inputs, micro_batches)
    ys = split_micro(targets, micro_batches)
    first, last = links.prev_rank is None, links.next_rank is None
    b, t = xs[0].shape
    act_shape = (b, t, stage.cfg.d_model)
    device = inputs.device
    stage_inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    total = torch.zeros((), device=device)
    for m in range(micro_batches):
        if first:
            x = xs[m]
        else:
            x = torch.empty(act_shape, device=device)
            stage_recv(x, links.prev_rank, links, comm)
            x.requires_grad_(True)
        out = stage(x)
        if last:
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), ys[m].reshape(-1))
            loss = loss / micro_batches
            total += loss.detach()
            outputs.append(loss)
        else:
            stage_send(out.detach().contiguous(), links.next_rank, links, before_send, comm)
            outputs.append(out)
        stage_inputs.append(None if first else x)
    for m in range(micro_batches):
        if last:
            outputs[m].backward()
        else:
            grad = torch.empty(act_shape, device=device)
            stage_recv(grad, links.next_rank, links, comm)
            outputs[m].backward(grad)
        if not first:
            x = stage_inputs[m]
            stage_send(x.grad.contiguous(), links.prev_rank, links, before_send, comm)
    return total if last else None
