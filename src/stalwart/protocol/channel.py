"""The agent's channel: one WebSocket per agent (controller/api/channel.py, agent/link.py).

Binary frames, one MessagePack message each (a NaN loss stays a NaN, rank maps keep int keys).
Every message an agent sends carries a `seq` its answer names: a beat and a batch get an `Ack`
(a batch is taken only once acked: the agent keeps it until then), a registration gets
`Registered`, a message the controller cannot read gets `ChannelError` naming the field. The
controller pushes commands (`CommandPush`) to the one agent they are for.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Union

import msgspec

from stalwart.protocol.events import Event
from stalwart.protocol.registration import Registration

# An agent that lost its controller retries with a delay that doubles up to this cap (times a
# jitter); a restarted controller waits for its agents at least two such delays before it calls
# a machine that did not come back lost.
AGENT_RETRY_CAP_S = 4.0

# A machine id, checked at the edge (API paths, channels, `stalwart agent --machine-id`): 1-128
# ASCII letters, digits and ._- starting with a letter or digit (an id with a non-ASCII digit
# once broke every view that orders machines by number).
MACHINE_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
MACHINE_ID_RE = re.compile(f"^(?:{MACHINE_ID})$")
MACHINE_ID_RULE = "a machine id is 1-128 ASCII letters, digits and ._- starting with a letter or digit"
CHANNEL_PATH = "/api/agents/{machine}/channel"
MAX_EVENTS = 10_000          # per batch; an agent's outbox sends far fewer
MAX_MESSAGE = 8 << 20        # one message of a channel (and an HTTP request's body)


class _Chan(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=True):
    """A channel message, tagged by `type`; unknown fields are ignored (rolling upgrades)."""


class Register(_Chan, tag="register", kw_only=True):
    seq: int
    reg: Registration


class Beat(_Chan, tag="beat", kw_only=True):
    seq: int
    t: float = 0.0
    workers: Any = None


class EventBatch(_Chan, tag="events", kw_only=True):
    seq: int
    events: Annotated[list[Event], msgspec.Meta(max_length=MAX_EVENTS)] = []


class LooseBatch(_Chan, tag="events", kw_only=True):
    """A batch read event by event (one holds a kind this controller does not know, or a bad field)."""
    seq: int
    events: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_EVENTS)] = []


AgentMessage = Union[Register, Beat, EventBatch]


class Ack(_Chan, tag="ack", kw_only=True):
    seq: int
    reregister: bool = False         # the controller does not know this machine as alive: register
    taken: bool = True               # False: a batch from a machine the controller does not know
                                     # (it restarted): keep it, register, send it again
    ignored: str | None = None       # events of the batch that were left out, and why


class Registered(_Chan, tag="registered", kw_only=True):
    seq: int
    heartbeat_s: float
    missed_beats: int
    role: str
    steps_batch: bool = False


class CommandPush(_Chan, tag="commands", kw_only=True):
    commands: list[dict[str, Any]]


class ChannelError(_Chan, tag="error", kw_only=True):
    seq: int | None = None
    error: str
    status: int = 400                # as HTTP's: 4xx the message's fault (sending it again cannot help)
