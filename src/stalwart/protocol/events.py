"""The events an agent sends its controller (agent -> controller): what its workers did (some are
its workers' own messages passed on, see `protocol.workerlink`), what its probes found, what its
commands did. Which of them are evidence of a failure, and their decoding."""
from __future__ import annotations

import enum
from typing import Any, Union

import msgspec

from stalwart.protocol.message import Message


class Step(Message, tag="step", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    t: float
    dur: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    tokens: int | None = None
    local_grad_norm: float | None = None
    compute_s: float | None = None


class StepOfRank(msgspec.Struct, kw_only=True):
    """One rank's part of a `Steps` message (the fields of its `Step`)."""
    rank: int
    t: float
    dur: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    tokens: int | None = None
    local_grad_norm: float | None = None
    compute_s: float | None = None


class Steps(Message, tag="steps", kw_only=True):
    """One step of several ranks of a machine in one message: the agent merges its ranks'
    consecutive reports of a step (one message per machine per step, not one per rank)."""
    run: int | None = None
    step: int
    ranks: list[StepOfRank]
    t: float = 0.0

    def expand(self) -> list[Step]:
        return [Step(run=self.run, rank=r.rank, step=self.step, t=r.t, dur=r.dur, loss=r.loss,
                     grad_norm=r.grad_norm, tokens=r.tokens, local_grad_norm=r.local_grad_norm,
                     compute_s=r.compute_s) for r in self.ranks]


STEP_FIELDS = ("dur", "loss", "grad_norm", "tokens", "local_grad_norm", "compute_s")


def merge_steps(events: list[dict]) -> list[dict]:
    """Consecutive `step` events of one (run, step) merged into one `steps` event. Nothing moves:
    a rank's reports keep their order (time never runs backwards for a rank) and every other
    event keeps its place; a step one rank alone reported stays as it is. The ranks of a machine
    train in lockstep, so their reports of a step arrive together: one message per step."""
    out: list[dict] = []
    group: list[dict] = []

    def flush() -> None:
        if len(group) == 1:
            out.append(group[0])
        elif group:
            ranks = [{"rank": e["rank"], "t": e.get("t", 0.0),
                      **{k: e[k] for k in STEP_FIELDS if e.get(k) is not None}} for e in group]
            merged = {"type": "steps", "run": group[0].get("run"), "step": group[0]["step"], "ranks": ranks,
                      "t": max(r["t"] for r in ranks)}
            if "machine" in group[0]:
                merged["machine"] = group[0]["machine"]
            out.append(merged)
        group.clear()

    for ev in events:
        if ev.get("type") == "step" and isinstance(ev.get("rank"), int) and isinstance(ev.get("step"), int):
            if group and (group[0].get("run"), group[0]["step"]) != (ev.get("run"), ev["step"]):
                flush()
            group.append(ev)
            continue
        flush()
        out.append(ev)
    flush()
    return out


class Ckpt(Message, tag="ckpt", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    tier: str
    t: float = 0.0
    holder: str | None = None
    location: str | None = None
    checksum: str = ""


class WorkerExit(Message, tag="worker_exit", kw_only=True):
    run: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    code: int | None = None
    signal: int | None = None
    expected: bool = False
    pid: int | None = None
    log_tail: str = ""
    t: float = 0.0


class Severity(enum.StrEnum):
    """How bad a probe's finding is (a str: it travels and is stored as its value)."""
    FATAL = "fatal"      # the machine cannot train
    WARN = "warn"        # degraded, maybe transient
    INFO = "info"        # worth a line in the job's log


class Health(Message, tag="health", kw_only=True):
    probe: str = ""
    kind: str
    severity: Severity
    machine_certain: bool = False
    network: bool = False
    detail: Any = None
    t: float = 0.0


class Stopped(Message, tag="stopped", kw_only=True):
    run: int | None = None
    inventory: dict[str, dict[int, list[int]]] = {}
    t: float = 0.0


class Stacks(Message, tag="stacks", kw_only=True):
    run: int | None = None
    records: list[dict[str, Any]] = []
    t: float = 0.0


class DiagResult(Message, tag="diag_result", kw_only=True):
    id: str
    results: list[dict[str, Any]] = []
    killed: list[int] = []
    warm: bool = False
    seconds: float = 0.0
    t: float = 0.0


class SparesReady(Message, tag="spares_ready", kw_only=True):
    key: str = ""                          # RunSpec code_path (or cwd) the spares run
    pids: list[int] = []
    t: float = 0.0


class ChaosApplied(Message, tag="chaos_applied", kw_only=True):
    kind: str = ""
    rank: int | None = None
    injected_at: float | None = None
    t: float = 0.0


# The longest an agent takes to start a run's workers: it waits this long for its fork server's
# preload (import torch), then starts them without the server. The controller's hang watch waits
# this much longer than its warm-up timeout for a worker not reported started (policy.worker_start_s).
WORKER_START_S = 120.0


class Started(Message, tag="started", kw_only=True):
    """`preload_s`: of the time to start the workers, how long the machine's fork server was
    still importing (torch...) for them: import time, not spawn time."""
    run: int | None = None
    pids: list[int] = []
    warm: bool = False
    t: float = 0.0
    preload_s: float = 0.0


class RestoreSourceUsed(Message, tag="restore_source", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    tier: str
    skipped: list[str] = []
    t: float = 0.0


class RestoreFailed(Message, tag="restore_failed", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    error: str = ""
    t: float = 0.0


class CommandFailed(Message, tag="command_failed", kw_only=True):
    command: str | None = None
    kind: str | None = None
    error: str = ""
    t: float = 0.0


class Done(Message, tag="done", kw_only=True):
    run: int | None = None
    rank: int
    t: float = 0.0


class Metrics(Message, tag="metrics", kw_only=True):
    values: dict[str, Any] = {}
    t: float = 0.0


class Prewarmed(Message, tag="prewarmed", kw_only=True):
    pids: list[int] = []
    t: float = 0.0


class Hello(Message, tag="hello", kw_only=True):
    run: int | None = None
    rank: int | None = None
    pid: int | None = None
    t: float = 0.0
    imported: float | None = None      # the SDK began (torch imported; a warm worker: activated)
    ready: float | None = None         # its process groups are up (the rendezvous is over)


class Restored(Message, tag="restored", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    tier: str = ""
    t: float = 0.0


class StandbyReady(Message, tag="standby_ready", kw_only=True):
    run: int | None = None
    pid: int | None = None
    t: float = 0.0


class TraceOp(msgspec.Struct, array_like=True, frozen=True):
    """A collective a rank entered (worker/frhook.py `Tracer`): kind, group name and description,
    ms taken and bytes where recorded, ms since its previous one, the recorder's id."""
    kind: str
    group: str
    desc: str
    dur_ms: float | None
    nbytes: int | None
    gap_ms: float | None
    seq: int


class LinkStat(msgspec.Struct, array_like=True, frozen=True):
    """The kernel's view (tcp_info) of this machine's workers' TCP connections to one peer address,
    since the previous sample (agent/tcpstats.py): the local and the peer address, how many sockets,
    the largest smoothed RTT (ms) among the sockets that had data acknowledged (None: none did),
    retransmissions, bytes still unacknowledged, the largest RTO backoff, bytes acknowledged."""
    local: str
    peer: str
    socks: int
    rtt_ms: float | None
    retrans: int
    unacked: int
    backoff: int
    acked: int


class Activity(Message, tag="activity", kw_only=True):
    """Progress the agent saw in its workers without step reports (agent/progress.py): `ranks` used
    CPU (or wrote to their log) outside a collective since the last sample; `collectives` is, per
    rank without the SDK, how many collectives it has entered (its flight recorder), when that grew;
    `traces`, per rank, the collectives entered since the last sample (the newest, at most 128);
    `links`, the workers' connections to other machines, per peer address (`LinkStat`)."""
    run: int | None = None
    ranks: list[int] = []
    collectives: dict[int, int] = {}
    traces: dict[int, list[TraceOp]] = {}
    links: list[LinkStat] = []
    t: float = 0.0


class ScriptRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One record of a plain script's step hook (worker/stephook.py): an optimizer step ended
    (`step`), or the script saved or loaded a file (`save`, `load`, with its absolute `path`), or
    renamed a file it saved (`move`, `path` to `dest`); `n` is the number of steps the process had
    completed then; `steps`: the mark a loaded file carries (worker/stephook.py), if any."""
    kind: str
    n: int
    t: float
    path: str = ""
    dest: str = ""
    steps: int | None = None


class Script(Message, tag="script", kw_only=True):
    """A rank's step-hook records since the last period, in order (agent/scriptsteps.py): the
    steps and snapshots of a script without the SDK."""
    run: int | None = None
    rank: int
    records: list[ScriptRecord] = []


Event = Union[Step, Steps, Ckpt, WorkerExit, Health, Stopped, Stacks, DiagResult, SparesReady, ChaosApplied,
              Started, RestoreSourceUsed, RestoreFailed, CommandFailed, Done, Metrics, Prewarmed, Hello,
              Restored, StandbyReady, Activity, Script]

EVENT_TYPES = frozenset(t.__struct_config__.tag for t in Event.__args__)  # type: ignore[attr-defined]
# Events whose loss would lose evidence of a failure: an agent's bounded buffer never drops them.
EVIDENCE = frozenset({"worker_exit", "health", "stopped", "stacks", "diag_result", "restore_failed",
                      "chaos_applied", "command_failed", "done", "started", "spares_ready"})
_events_by_tag = {t.__struct_config__.tag: t for t in Event.__args__}  # type: ignore[attr-defined]


def decode_event(data: dict) -> Event | None:
    """An agent event from its JSON form, or None for a kind this controller does not know."""
    cls = _events_by_tag.get(data.get("type"))  # type: ignore[arg-type]
    if cls is None:
        return None
    return msgspec.convert(data, cls, strict=False)
