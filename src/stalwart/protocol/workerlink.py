"""The messages between a worker's SDK and its agent, both ways (worker/link.py, agent/workerserver.py).

One JSON object per line over the agent's Unix socket (transport/jsonlines.py): JSON, not
MessagePack, because a step report may carry a NaN loss, which Python's `json` writes and reads
(msgspec's JSON decoder refuses it), and because a plain `nc -U` shows what goes by. Each line is
one tagged message: a worker sends its agent one of `FromWorker`, the agent sends a worker one of
`ToWorker`. Some of a worker's messages are also events the agent passes on to its controller
(`Forwarded`); `Shard` and `Failing` the agent acts on itself.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from stalwart.protocol.events import Ckpt, Done, Hello, Restored, StandbyReady, Step
from stalwart.protocol.message import Message

# -- worker -> agent ------------------------------------------------------------------------------


class Shard(Message, tag="shard", kw_only=True):
    """A rank's in-memory snapshot of `step` is committed at `path` (the agent backs it up)."""
    rank: int
    step: int
    path: str


class Failing(Message, tag="failing", kw_only=True):
    """A rank's training raised: its traceback, before the slow teardown of its interpreter."""
    rank: int
    traceback: str = ""


# what the agent passes on to its controller as events of the run (it sets their `run`)
Forwarded = Union[Step, Ckpt, Restored, Done, Hello, StandbyReady]
FromWorker = Union[Step, Ckpt, Restored, Done, Hello, StandbyReady, Shard, Failing]

# -- agent -> worker ------------------------------------------------------------------------------


class Activate(Message, tag="activate", kw_only=True):
    """A warm spare waiting at its barrier gets its ranks: `env` is the run's environment and its
    rank's (`protocol.env`), which it adds to its own before it builds its process groups."""
    env: dict[str, str]


class WorkerChaos(Message, tag="chaos", kw_only=True):
    """A fault the worker's SDK plays itself (`nan`, `user-error`, `stage-hang`), from step
    `from_step` on; `rank` is the rank the fault was aimed at (None: every rank of the machine)."""
    kind: str
    rank: int | None = None
    from_step: int = 0
    params: dict[str, Any] = {}


ToWorker = Union[Activate, WorkerChaos]


def decode_from_worker(data: Any) -> FromWorker:
    """A worker's message from its JSON form; msgspec.ValidationError for anything else (a kind
    the agent does not know, a field of the wrong type, not an object at all)."""
    return msgspec.convert(data, FromWorker, strict=False)  # type: ignore[arg-type]


def decode_to_worker(data: Any) -> ToWorker:
    """A message of the agent from its JSON form; msgspec.ValidationError for anything else."""
    return msgspec.convert(data, ToWorker, strict=False)  # type: ignore[arg-type]
