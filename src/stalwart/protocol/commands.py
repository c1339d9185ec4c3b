"""The commands a controller sends an agent (controller -> agent), and their decoding."""
from __future__ import annotations

from typing import Any, Union

import msgspec

from stalwart.protocol.message import Message
from stalwart.protocol.run import CkptPlan, RunSpec, WorkerSlot


class Start(Message, tag="start", kw_only=True):
    """Start a run's workers on this machine: hand the ranks to warm spares when they are ready
    within `wait_warm_s`, else start cold."""
    spec: RunSpec
    workers: list[WorkerSlot]
    ckpt: CkptPlan | None = None
    wait_warm_s: float = 2.0


class Prewarm(Message, tag="prewarm", kw_only=True):
    """A standby: stop whatever runs and keep `count` warm workers for `spec`."""
    spec: RunSpec
    count: int


class Spares(Message, tag="spares", kw_only=True):
    """Warm spares for another code version while the run goes on; answer `spares_ready`."""
    spec: RunSpec
    count: int


class Stop(Message, tag="stop", kw_only=True):
    """Stop the workers of `run` (None: everything of the job, spares included)."""
    run: int | None = None
    grace_s: float = 0.0


class Chaos(Message, tag="chaos", kw_only=True):
    kind: str
    rank: int | None = None
    step: int = 0
    params: dict[str, Any] = {}
    at_step: int | None = None      # armed: apply when a rank of the machine completed this many
                                    # steps (agent/armed.py); None: at once


class Trace(Message, tag="trace", kw_only=True):
    run: int | None = None
    timeout_s: float = 5.0


class Diagnose(Message, tag="diagnose", kw_only=True):
    """Run stop-time checks (stalwart.diag) and answer one `diag_result`."""
    id: str
    checks: list[str]
    store_host: str
    local_world: int
    intra: dict[str, Any] | None = None
    inter: list[dict[str, Any]] = []
    timeout_s: float = 10.0
    env: dict[str, str] = {}


class Shutdown(Message, tag="shutdown", kw_only=True):
    pass


Command = Union[Start, Prewarm, Spares, Stop, Chaos, Trace, Diagnose, Shutdown]


def decode_command(data: dict) -> Command:
    """A command from its JSON form; msgspec.ValidationError names a bad field."""
    return msgspec.convert(data, Command, strict=False)  # type: ignore[arg-type]
