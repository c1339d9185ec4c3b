"""The wire protocol: every command the controller sends an agent, every event an agent sends the
controller, and every `STALWART_*` environment variable a worker reads.

Commands and events are msgspec structs tagged by their `type` field, so both ends encode and
decode one typed value instead of reading keys out of bare dicts. Agents decide from the typed
command they received (a run's job, layout, replay flag, restore plan), never from the workers'
environment; the environment a worker sees is built here, once, from the command
(`worker_env`).
"""
from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Union

import msgspec

# -- environment names (what workers read) -----------------------------------------------------


class Env:
    """Every `STALWART_*` variable a worker (the SDK, the bundled GPT) reads, by name."""
    JOB = "STALWART_JOB"
    RUN = "STALWART_RUN"
    TP, PP, DP, CP, EP = "STALWART_TP", "STALWART_PP", "STALWART_DP", "STALWART_CP", "STALWART_EP"
    MACHINES = "STALWART_MACHINES"
    GPUS_PER_MACHINE = "STALWART_GPUS_PER_MACHINE"
    STEPS = "STALWART_STEPS"
    CKPT_EVERY = "STALWART_CKPT_EVERY"
    CKPT_DIR = "STALWART_CKPT_DIR"
    MEM_SLOTS = "STALWART_MEM_SLOTS"
    MEM_OVERLAP = "STALWART_MEM_OVERLAP"     # "1": the in-memory checkpoint's copy overlaps the next step
    REPLAY = "STALWART_REPLAY"
    REPLAY_LAYERS = "STALWART_REPLAY_LAYERS"
    RESTORE_STEP = "STALWART_RESTORE_STEP"
    RESTORE_PATH = "STALWART_RESTORE_PATH"
    RESTORE_TIER = "STALWART_RESTORE_TIER"
    CODE_VERSION = "STALWART_CODE_VERSION"
    STANDBY = "STALWART_STANDBY"
    AGENT_SOCK = "STALWART_AGENT_SOCK"
    # seconds the SDK's link waits for its agent to come back (a restarted agent adopts the
    # worker, agent/adopt.py) before the worker gives up and exits; absent or 0: at once
    RELINK_S = "STALWART_RELINK_S"
    SIMGPU = "STALWART_SIMGPU"
    MACHINE = "STALWART_MACHINE"
    SHM_DIR = "STALWART_SHM_DIR"
    SEED = "STALWART_SEED"
    FORCE_CPU = "STALWART_FORCE_CPU"
    # the flight-recorder hook (worker/frhook.py, loaded through worker/hookdir/sitecustomize.py):
    # where it writes each process' recorder summary, and how often
    FR_DIR = "STALWART_FR_DIR"
    FR_PERIOD = "STALWART_FR_PERIOD"
    # "1" in a worker's environment: the worker SDK or an adapter reports this process' steps
    # (`worker.init()` and `worker.attach()` set it in their own process at start), so the
    # start-up hook does not count the optimizer's steps as steps too; a job's environment may
    # set it to switch that counting off
    SDK_STEPS = "STALWART_SDK_STEPS"


# what the command line of a warm worker forked by its machine's fork server ends with while it
# waits for its ranks (`ps` shows the spares); the SDK takes it off at activation
WARM_TITLE_MARK = "  [stalwart: warm, waiting for ranks]"


class _Msg(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=False):
    """Base of commands and events: tagged by `type`; unknown fields are ignored on decode so a
    newer peer can add fields."""


# -- the pieces of a run -------------------------------------------------------------------------


class Layout(msgspec.Struct, kw_only=True, frozen=True):
    """A run's parallel layout (what the workers build their process groups from)."""
    machines: int
    gpus_per_machine: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.machines * self.gpus_per_machine


class RunSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What every worker of one run (or a machine's warm spares) is started with.

    `run` is None for warm spares (they learn their run at activation). `replay` marks a
    throw-away run of the stop-time replay: it never reads or writes the job's checkpoints.
    `master` is the rendezvous store's (host, port), None for spares. `spares`: the job's
    `warm_spares` policy.
    """
    job: int
    run: int | None
    command: list[str]
    cwd: str | None
    user_env: dict[str, str]
    layout: Layout
    steps: int
    ckpt_every: int
    ckpt_dir: str
    mem_slots: int
    version: int | None = None
    code_path: str | None = None          # a code version's snapshot (prepended to PYTHONPATH)
    replay: bool = False
    replay_layers: int = 0
    restore_step: int = -1
    master: tuple[str, int] | None = None
    spares: bool = True                   # keep warm spare workers on the machine once the run trains

    def warm_key(self) -> tuple:
        """Which runs a warm worker started for this spec can serve: the same command,
        directory, code and shape (what a worker may read before its activation)."""
        return (tuple(self.command), self.cwd, self.code_path, self.layout, self.steps, self.replay)


class RestoreSource(msgspec.Struct, kw_only=True, frozen=True):
    """One candidate copy of a rank's checkpoint shard, best first in a worker's list."""
    tier: str                              # own | backup | durable
    step: int
    holder: str | None = None              # machine holding an in-memory copy
    addr: tuple[str, int] | None = None    # the holder's peer server (backup tier)
    location: str | None = None            # durable tier URL


class WorkerSlot(msgspec.Struct, kw_only=True, frozen=True):
    rank: int
    local_rank: int
    group_rank: int                        # the machine's index in the run
    restore: list[RestoreSource] = []


class Backup(msgspec.Struct, kw_only=True, frozen=True):
    machine: str
    addr: tuple[str, int]


class CkptPlan(msgspec.Struct, kw_only=True, frozen=True):
    durable_dir: str
    every: int
    backup: Backup | None = None
    key: str | None = None                 # the job's checkpoint key, hex (peer auth, shard MACs)


# -- commands (controller -> agent) -------------------------------------------------------------


class Start(_Msg, tag="start", kw_only=True):
    """Start a run's workers on this machine: hand the ranks to warm spares when they are ready
    within `wait_warm_s`, else start cold."""
    spec: RunSpec
    workers: list[WorkerSlot]
    ckpt: CkptPlan | None = None
    wait_warm_s: float = 2.0


class Prewarm(_Msg, tag="prewarm", kw_only=True):
    """A standby: stop whatever runs and keep `count` warm workers for `spec`."""
    spec: RunSpec
    count: int


class Spares(_Msg, tag="spares", kw_only=True):
    """Warm spares for another code version while the run goes on; answer `spares_ready`."""
    spec: RunSpec
    count: int


class Stop(_Msg, tag="stop", kw_only=True):
    """Stop the workers of `run` (None: everything of the job, spares included)."""
    run: int | None = None
    grace_s: float = 0.0


class Chaos(_Msg, tag="chaos", kw_only=True):
    kind: str
    rank: int | None = None
    step: int = 0
    params: dict[str, Any] = {}
    at_step: int | None = None      # armed: apply when a rank of the machine completed this many
                                    # steps (agent/armed.py); None: at once


class Trace(_Msg, tag="trace", kw_only=True):
    run: int | None = None
    timeout_s: float = 5.0


class Diagnose(_Msg, tag="diagnose", kw_only=True):
    """Run stop-time checks (stalwart.diag) and answer one `diag_result`."""
    id: str
    checks: list[str]
    store_host: str
    local_world: int
    intra: dict[str, Any] | None = None
    inter: list[dict[str, Any]] = []
    timeout_s: float = 10.0
    env: dict[str, str] = {}


class Shutdown(_Msg, tag="shutdown", kw_only=True):
    pass


Command = Union[Start, Prewarm, Spares, Stop, Chaos, Trace, Diagnose, Shutdown]

# -- events (agent -> controller) ----------------------------------------------------------------


class Step(_Msg, tag="step", kw_only=True):
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


class Steps(_Msg, tag="steps", kw_only=True):
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


class Ckpt(_Msg, tag="ckpt", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    tier: str
    t: float = 0.0
    holder: str | None = None
    location: str | None = None
    checksum: str = ""


class WorkerExit(_Msg, tag="worker_exit", kw_only=True):
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


class Health(_Msg, tag="health", kw_only=True):
    probe: str = ""
    kind: str
    severity: Severity
    machine_certain: bool = False
    network: bool = False
    detail: Any = None
    t: float = 0.0


class Stopped(_Msg, tag="stopped", kw_only=True):
    run: int | None = None
    inventory: dict[str, dict[int, list[int]]] = {}
    t: float = 0.0


class Stacks(_Msg, tag="stacks", kw_only=True):
    run: int | None = None
    records: list[dict[str, Any]] = []
    t: float = 0.0


class DiagResult(_Msg, tag="diag_result", kw_only=True):
    id: str
    results: list[dict[str, Any]] = []
    killed: list[int] = []
    warm: bool = False
    seconds: float = 0.0
    t: float = 0.0


class SparesReady(_Msg, tag="spares_ready", kw_only=True):
    key: str = ""                          # RunSpec code_path (or cwd) the spares run
    pids: list[int] = []
    t: float = 0.0


class ChaosApplied(_Msg, tag="chaos_applied", kw_only=True):
    kind: str = ""
    rank: int | None = None
    injected_at: float | None = None
    t: float = 0.0


class Started(_Msg, tag="started", kw_only=True):
    """`preload_s`: of the time to start the workers, how long the machine's fork server was
    still importing (torch...) for them: import time, not spawn time."""
    run: int | None = None
    pids: list[int] = []
    warm: bool = False
    t: float = 0.0
    preload_s: float = 0.0


class RestoreSourceUsed(_Msg, tag="restore_source", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    tier: str
    skipped: list[str] = []
    t: float = 0.0


class RestoreFailed(_Msg, tag="restore_failed", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    error: str = ""
    t: float = 0.0


class CommandFailed(_Msg, tag="command_failed", kw_only=True):
    command: str | None = None
    kind: str | None = None
    error: str = ""
    t: float = 0.0


class Done(_Msg, tag="done", kw_only=True):
    run: int | None = None
    rank: int
    t: float = 0.0


class Metrics(_Msg, tag="metrics", kw_only=True):
    values: dict[str, Any] = {}
    t: float = 0.0


class Prewarmed(_Msg, tag="prewarmed", kw_only=True):
    pids: list[int] = []
    t: float = 0.0


class Hello(_Msg, tag="hello", kw_only=True):
    run: int | None = None
    rank: int | None = None
    pid: int | None = None
    t: float = 0.0
    imported: float | None = None      # the SDK began (torch imported; a warm worker: activated)
    ready: float | None = None         # its process groups are up (the rendezvous is over)


class Restored(_Msg, tag="restored", kw_only=True):
    run: int | None = None
    rank: int
    step: int
    tier: str = ""
    t: float = 0.0


class StandbyReady(_Msg, tag="standby_ready", kw_only=True):
    run: int | None = None
    pid: int | None = None
    t: float = 0.0


# -- worker -> agent only: the agent acts on these; they go no further ----------------------------


class Shard(_Msg, tag="shard", kw_only=True):
    """A rank's in-memory snapshot of `step` is committed at `path` (the agent backs it up)."""
    rank: int
    step: int
    path: str


class Failing(_Msg, tag="failing", kw_only=True):
    """A rank's training raised: its traceback, before the slow teardown of its interpreter."""
    rank: int
    traceback: str = ""


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


class Activity(_Msg, tag="activity", kw_only=True):
    """Progress the agent saw in its workers without step reports (agent/progress.py): `ranks` used
    CPU (or wrote to their log) outside a collective since the last sample; `collectives` is, per
    rank without the SDK, how many collectives it has entered (its flight recorder), when that grew;
    `traces`, per rank, the collectives entered since the last sample (the newest, at most 128)."""
    run: int | None = None
    ranks: list[int] = []
    collectives: dict[int, int] = {}
    traces: dict[int, list[TraceOp]] = {}
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


class Script(_Msg, tag="script", kw_only=True):
    """A rank's step-hook records since the last period, in order (agent/scriptsteps.py): the
    steps and snapshots of a script without the SDK."""
    run: int | None = None
    rank: int
    records: list[ScriptRecord] = []


Event = Union[Step, Steps, Ckpt, WorkerExit, Health, Stopped, Stacks, DiagResult, SparesReady, ChaosApplied,
              Started, RestoreSourceUsed, RestoreFailed, CommandFailed, Done, Metrics, Prewarmed, Hello,
              Restored, StandbyReady, Activity, Script]
# An agent that lost its controller retries with a delay that doubles up to this cap (times a
# jitter); a restarted controller waits for its agents at least two such delays before it calls
# a machine that did not come back lost.
AGENT_RETRY_CAP_S = 4.0

EVENT_TYPES = frozenset(t.__struct_config__.tag for t in Event.__args__)  # type: ignore[attr-defined]
# Events whose loss would lose evidence of a failure: an agent's bounded buffer never drops them.
EVIDENCE = frozenset({"worker_exit", "health", "stopped", "stacks", "diag_result", "restore_failed",
                      "chaos_applied", "command_failed", "done", "started", "spares_ready"})


# -- registration: what an agent tells a (re)started controller -----------------------------------


class Registration(msgspec.Struct, kw_only=True):
    """An agent's registration: who it is, and what it runs now (so a controller that restarted
    can adopt a run that kept training)."""
    address: str
    gpus: int
    hostname: str = ""
    pid: int = 0
    workdir: str = ""
    peer: tuple[str, int] | None = None
    running_run: int | None = None
    job: int | None = None
    ranks: dict[int, int] = {}             # rank -> pid of its live worker
    done_ranks: list[int] = []             # ranks of `running_run` whose worker finished (exit 0)
    last_step: dict[int, int] = {}         # rank -> last step it reported
    inventory: dict[str, dict[int, list[int]]] = {}
    warm: int = 0                          # warm spare workers waiting at the barrier
    labels: dict[str, str] = {}
    isolated: bool = False                 # its workers have a network namespace of their own


# -- the agent's channel: one WebSocket per agent (controller/api/channel.py, agent/link.py) ---------
# Binary frames, one MessagePack message each (a NaN loss stays a NaN, rank maps keep int keys).
# Every message an agent sends carries a `seq` its answer names: a beat and a batch get an `Ack`
# (a batch is taken only once acked: the agent keeps it until then), a registration gets
# `Registered`, a message the controller cannot read gets `ChannelError` naming the field. The
# controller pushes commands (`CommandPush`) to the one agent they are for.

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


# -- encode / decode ---------------------------------------------------------------------------

_command_decoder = msgspec.convert
_events_by_tag = {t.__struct_config__.tag: t for t in Event.__args__}  # type: ignore[attr-defined]


def encode(msg: msgspec.Struct) -> dict:
    """A command or event as plain JSON-able data (with its `type`)."""
    return msgspec.to_builtins(msg)


def decode_command(data: dict) -> Command:
    """A command from its JSON form; msgspec.ValidationError names a bad field."""
    return msgspec.convert(data, Command, strict=False)  # type: ignore[arg-type]


def decode_event(data: dict) -> Event | None:
    """An agent event from its JSON form, or None for a kind this controller does not know."""
    cls = _events_by_tag.get(data.get("type"))  # type: ignore[arg-type]
    if cls is None:
        return None
    return msgspec.convert(data, cls, strict=False)


# -- the environment of a worker ---------------------------------------------------------------


def run_env(spec: RunSpec) -> dict[str, str]:
    """The environment every worker started for `spec` gets (on top of the machine's own)."""
    lay = spec.layout
    env: dict[str, Any] = dict(spec.user_env)
    env.update({"WORLD_SIZE": lay.world, "LOCAL_WORLD_SIZE": lay.gpus_per_machine,
                Env.JOB: spec.job, Env.TP: lay.tp, Env.PP: lay.pp, Env.DP: lay.dp, Env.CP: lay.cp,
                Env.EP: lay.ep, Env.MACHINES: lay.machines, Env.GPUS_PER_MACHINE: lay.gpus_per_machine,
                Env.STEPS: spec.steps, Env.CKPT_EVERY: spec.ckpt_every, Env.CKPT_DIR: spec.ckpt_dir,
                Env.MEM_SLOTS: spec.mem_slots, Env.REPLAY: int(spec.replay),
                "TORCHELASTIC_RUN_ID": f"stalwart-{spec.job}"})
    if spec.replay:
        env[Env.REPLAY_LAYERS] = spec.replay_layers
    if spec.version is not None:
        env[Env.CODE_VERSION] = spec.version
    if spec.run is not None:
        env.update({Env.RUN: spec.run, Env.RESTORE_STEP: spec.restore_step,
                    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": spec.run})
        if spec.master is not None:
            env.update({"MASTER_ADDR": spec.master[0], "MASTER_PORT": spec.master[1]})
    return {k: str(v) for k, v in env.items()}


def rank_env(w: WorkerSlot) -> dict[str, str]:
    """What differs between the workers of one run on one machine."""
    return {"RANK": str(w.rank), "LOCAL_RANK": str(w.local_rank), "GROUP_RANK": str(w.group_rank)}


def python_path(code_path: str | None, inherited: str | None) -> str | None:
    """PYTHONPATH of a worker running a code version's snapshot (the snapshot first)."""
    if not code_path:
        return inherited
    return code_path + (":" + inherited if inherited else "")
