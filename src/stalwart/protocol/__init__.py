"""The wire protocol: every message between the controller, its agents and their workers, and every
`STALWART_*` environment variable a worker reads. One module per concern:

- `message`: the tagged base of every message (msgspec structs tagged by their `type` field, so
  both ends encode and decode one typed value instead of reading keys out of bare dicts);
- `run`: the pieces of a run (layout, spec, worker slots, restore sources, checkpoint plan);
- `commands`: controller -> agent (`Start`, `Stop`, `Chaos`...);
- `events`: agent -> controller (`Step`, `WorkerExit`, `Health`...), and which are evidence;
- `registration`: what an agent tells a (re)started controller;
- `channel`: the agent's WebSocket to its controller (framing messages, machine ids, limits);
- `workerlink`: worker <-> agent over the machine's Unix socket (`Shard`, `Failing`, `Activate`...);
- `env`: the environment names a worker reads and the environment a run's worker gets.

Every public name is re-exported here: `from stalwart import protocol as p; p.Start(...)`.
"""

from __future__ import annotations

from stalwart.protocol.message import Message, encode
from stalwart.protocol.env import Env, WARM_TITLE_MARK, run_env, rank_env, python_path
from stalwart.protocol.run import Layout, RunSpec, RestoreSource, WorkerSlot, Backup, CkptPlan
from stalwart.protocol.commands import (
    Start, Prewarm, Spares, Stop, Chaos, Trace, Diagnose, Shutdown, Command, decode_command,
)
from stalwart.protocol.events import (
    Step, StepOfRank, Steps, STEP_FIELDS, merge_steps, Ckpt, WorkerExit, Severity, Health, Stopped, Stacks,
    DiagResult, SparesReady, ChaosApplied, Started, RestoreSourceUsed, RestoreFailed, CommandFailed, Done,
    Metrics, Prewarmed, Hello, Restored, StandbyReady, TraceOp, LinkStat, Activity, ScriptRecord, Script, Event,
    EVENT_TYPES, EVIDENCE, decode_event,
)
from stalwart.protocol.registration import Registration
from stalwart.protocol.workerlink import (
    Shard, Failing, FromWorker, Forwarded, Activate, WorkerChaos, ToWorker, decode_from_worker, decode_to_worker,
)
from stalwart.protocol.channel import (
    AGENT_RETRY_CAP_S, MACHINE_ID, MACHINE_ID_RE, MACHINE_ID_RULE, CHANNEL_PATH, MAX_EVENTS, MAX_MESSAGE,
    Register, Beat, EventBatch, LooseBatch, AgentMessage, Ack, Registered, CommandPush, ChannelError,
)

__all__ = [
    "Message", "encode", "Env", "WARM_TITLE_MARK", "run_env", "rank_env", "python_path", "Layout", "RunSpec",
    "RestoreSource", "WorkerSlot", "Backup", "CkptPlan", "Start", "Prewarm", "Spares", "Stop", "Chaos", "Trace",
    "Diagnose", "Shutdown", "Command", "decode_command", "Step", "StepOfRank", "Steps", "STEP_FIELDS",
    "merge_steps", "Ckpt", "WorkerExit", "Severity", "Health", "Stopped", "Stacks", "DiagResult", "SparesReady",
    "ChaosApplied", "Started", "RestoreSourceUsed", "RestoreFailed", "CommandFailed", "Done", "Metrics",
    "Prewarmed", "Hello", "Restored", "StandbyReady", "TraceOp", "LinkStat", "Activity", "ScriptRecord", "Script",
    "Event",
    "EVENT_TYPES", "EVIDENCE", "decode_event", "Registration", "Shard", "Failing", "FromWorker", "Forwarded",
    "Activate", "WorkerChaos", "ToWorker", "decode_from_worker", "decode_to_worker", "AGENT_RETRY_CAP_S",
    "MACHINE_ID", "MACHINE_ID_RE", "MACHINE_ID_RULE", "CHANNEL_PATH", "MAX_EVENTS", "MAX_MESSAGE", "Register",
    "Beat", "EventBatch", "LooseBatch", "AgentMessage", "Ack", "Registered", "CommandPush", "ChannelError",
]
