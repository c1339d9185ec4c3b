"""The job specification (JobSpec) and its fault-handling policy (Policy).

Both are msgspec Structs: each field's type carries its bounds and its meaning
(``Annotated[int, Meta(ge=1), Meta(description=...)]``), unknown keys are refused, and the
JSON Schema that ``stalwart spec schema`` prints (docs/jobspec.schema.json, and the field
tables of docs/jobspec.md) comes from these types (``stalwart.spec.schema``).
``JobSpec.from_dict`` / ``from_yaml`` decode user input with ``msgspec.convert`` after a short
pre-pass for what JSON cannot say in one type (durations such as ``"5m"``, a command
as one shell string, numbers as environment values); ``to_dict`` gives back the plain data
that ``from_dict`` accepts unchanged, the form stored and sent to the controller.

Every refusal is one line naming the field, its allowed range and the value given
(``stalwart.spec.messages``). Constructing a spec in Python checks it the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import shlex
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from stalwart.spec.duration import PATTERN as DURATION_PATTERN
from stalwart.spec.duration import parse_duration
from stalwart.spec.messages import explain, unknown_key_error, what_failed
from stalwart.protocol.events import WORKER_START_S
from stalwart.topology import Topology

__all__ = ["JobSpec", "Policy", "parse_duration", "MAX_INT", "MAX_MACHINES", "MAX_GPUS_PER_MACHINE",
           "MAX_FLOAT"]

# The largest count a field takes (an integer JSON, JavaScript and a 64-bit column hold exactly):
# `steps: 1e30` is refused here, not by the store or a worker later.
MAX_INT = 2**53 - 1
MAX_MACHINES = 1_000_000
MAX_GPUS_PER_MACHINE = 1024
MAX_FLOAT = 1e12             # (seconds: 30,000 years; factors: far past any meaningful one)

# `x-or` (read by stalwart.spec.schema): the schema also accepts this, what the pre-pass turns
# into the declared type (a duration's text into seconds, a shell string into a command).
_DURATION_TEXT = {"x-or": {"type": "string", "pattern": DURATION_PATTERN}}
Count = Annotated[int, Meta(ge=1, le=MAX_INT)]
Count0 = Annotated[int, Meta(ge=0, le=MAX_INT)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_FLOAT, extra_json_schema=_DURATION_TEXT)]
PositiveSeconds = Annotated[float, Meta(gt=0, le=MAX_FLOAT, extra_json_schema=_DURATION_TEXT)]
Factor = Annotated[float, Meta(ge=1, le=MAX_FLOAT)]
Fraction = Annotated[float, Meta(gt=0, lt=1)]
Probability = Annotated[float, Meta(ge=0, lt=1)]
PathText = Annotated[str, Meta(min_length=1, extra={"must": "be a path string"})]
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


def _doc(text: str) -> Meta:
    return Meta(description=" ".join(text.split()))


# Decoding runs the fields' checks itself; __post_init__ (the checks of a spec built in Python)
# waits until the whole spec is decoded, so an error there is not reported at a struct's path.
_DECODING: contextvars.ContextVar[bool] = contextvars.ContextVar("stalwart_spec_decoding", default=False)


@contextlib.contextmanager
def _decoding() -> Iterator[None]:
    token = _DECODING.set(True)
    try:
        yield
    finally:
        _DECODING.reset(token)


def _check_fields(obj: msgspec.Struct, what: str) -> None:
    """Each field of `obj` against its type (bounds included), by msgspec as a decode would;
    numbers normalised (an int in a float field becomes a float). ValueError names the first
    field that fails."""
    values = {name: getattr(obj, name) for name in obj.__struct_fields__}
    checked = _decode(type(obj), values, what)
    for name in obj.__struct_fields__:
        setattr(obj, name, getattr(checked, name))


class Policy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The thresholds of fault handling. Times are in seconds; a field ending in _s also takes a
    duration's text ("90s", "5m", "24h", "1h30m")."""

    heartbeat_s: Annotated[PositiveSeconds, _doc("interval of agent heartbeats to the controller.")] = 1.0
    missed_beats: Annotated[Count, _doc(
        "a machine is declared lost after this many missed heartbeats.")] = 3
    max_restarts_without_progress: Annotated[Count, _doc(
        "restarts allowed without a new kept step before the job stops and pages a human.")] = 3
    network_alert_count: Annotated[Count, _doc(
        "network alerts on one machine that trigger its eviction, when they fall within "
        "network_alert_window_s.")] = 2
    network_alert_window_s: Annotated[PositiveSeconds, _doc(
        "the window of network_alert_count (default 5 min).")] = 300.0
    hang_timeout_floor_s: Annotated[PositiveSeconds, _doc(
        "the auto-calibrated hang timeout is never below this.")] = 10.0
    hang_safety_factor: Annotated[Factor, _doc(
        "hang timeout = this factor x the observed step time.")] = 5.0
    hang_warmup_steps: Annotated[Count0, _doc(
        "steps observed before the hang timeout is calibrated; until then only the floor applies "
        "to the first steps' compile/warm-up.")] = 3
    worker_start_s: Annotated[Seconds, _doc(
        "the longest an agent takes to start a run's workers (its fork server's import of torch); "
        "the hang watch waits this much longer for a worker not yet reported started.")] = WORKER_START_S
    loss_jump_factor: Annotated[float, Meta(gt=1, le=MAX_FLOAT), _doc(
        "a loss or grad-norm jump of at least this factor over the recent baseline is an "
        "anomaly.")] = 5.0
    failslow_rounds: Annotated[Count, _doc(
        "rounds of stack/metric sampling before a fail-slow verdict.")] = 5
    failslow_period_s: Annotated[PositiveSeconds, _doc("time between fail-slow rounds.")] = 10.0
    failslow_drop: Annotated[Fraction, _doc(
        "relative throughput decline that counts as fail-slow.")] = 0.3
    similarity_window_s: Annotated[PositiveSeconds, _doc(
        "window of worker metrics compared between peers.")] = 240.0
    similarity_continuity_s: Annotated[PositiveSeconds, _doc(
        "a machine unlike its peers for this long is a suspect (Minder: 4 minutes).")] = 240.0
    similarity_evict: Annotated[bool, _doc(
        "evict a suspect (when a standby is ready) rather than only report it.")] = True
    daily_failure_rate: Annotated[Probability, _doc(
        "per-machine probability of failing on a given day; sizes the warm standby pool when "
        "standby is \"auto\".")] = 0.0012
    hot_update_window_s: Annotated[Seconds, _doc(
        "a pending code version is applied at the latest after this window (default 24 h; "
        "0 applies at once).")] = 86400.0
    hot_update_prewarm_s: Annotated[Seconds, _doc(
        "before a code version is applied, every machine starts spare workers on it (torch "
        "imported, the new code loaded) while training goes on; a due update waits at most this "
        "long for them, then restarts cold (0 never waits). A version with a window gets its "
        "spares this long before the window expires.")] = 120.0
    stop_grace_s: Annotated[Seconds, _doc(
        "time between SIGTERM and SIGKILL when stopping workers.")] = 2.0
    max_standby_wait_s: Annotated[Seconds, _doc(
        "how long a failover waits for a standby before restarting on the remaining machines "
        "or paging.")] = 60.0
    stop_time_checks: Annotated[bool, _doc(
        "after a failure with no certain culprit, every machine runs a self-test, an all-to-all "
        "among its workers and paired all-gathers with its neighbours.")] = True
    alignment_test: Annotated[bool, _doc(
        "after a NaN with no culprit, every machine runs one step of a fixed tiny GPT and the "
        "results are compared bit for bit (needs >= 3 machines).")] = True
    diag_timeout_s: Annotated[PositiveSeconds, _doc(
        "time bound of every wait in a machine's stop-time checks.")] = 10.0
    replay: Annotated[bool, _doc(
        "allow dual-phase replay when checks and a reattempt did not resolve a failure.")] = True
    replay_k: Annotated[Count0, _doc(
        "data-parallel size of each replay group (0: the smallest that works).")] = 0
    replay_steps: Annotated[Count, _doc("steps each replay group trains.")] = 6
    replay_timeout_s: Annotated[PositiveSeconds, _doc(
        "a replay group not done after this long counts as failing.")] = 90.0
    ladder_window_s: Annotated[PositiveSeconds, _doc(
        "failures further apart than this start the ladder afresh.")] = 3600.0
    mem_slots: Annotated[int, Meta(ge=2, le=MAX_INT), _doc(
        "shared-memory slots per rank for the every-step checkpoint, used round-robin. Ranks of "
        "different data-parallel replicas stop a step or two apart and a backup peer's copy may "
        "trail by a step or two; holding the last few steps in memory lets a restore find one "
        "step that every rank has in memory. Costs one copy of a rank's state in host memory per "
        "slot.")] = 4
    over_evict: Annotated[bool, _doc(
        "a hang's or a slowdown's outlier stacks evict the parallel group they share "
        "(ByteRobust's over-eviction: fast, at the price of healthy machines in that group); "
        "false: stacks only inform, a hang's culprit is searched by stop-time checks and replay, "
        "and a slowdown evicts only machines measured slower than their peers.")] = True
    warm_spares: Annotated[bool, _doc(
        "once a run trains, every machine starts spare workers (torch imported, at low priority) "
        "so that a restart there never waits for imports. Off where many simulated machines "
        "share one host's few cores: there the spares' imports compete with training, and a "
        "fault soon after the start finds them still importing.")] = True
    trace_detector: Annotated[bool, _doc(
        "learn each job's healthy collective traces (the workers' flight recorders) and the "
        "TCP figures of its machine pairs, and alert on a rank whose trace leaves them or a "
        "machine whose pairs do (docs/trace-detector.md).")] = True
    trace_evict: Annotated[bool, _doc(
        "a trace alert may evict the machines it names, only while the job is slowed and a "
        "standby is ready; off: alerts only.")] = False
    trace_train_s: Annotated[PositiveSeconds, _doc(
        "how long the trace model learns from a healthy run before it judges.")] = 120.0
    trace_window_s: Annotated[PositiveSeconds, _doc(
        "each rank's trace is scored over windows this long.")] = 5.0

    def __post_init__(self) -> None:
        if not _DECODING.get():
            self.validate()

    def validate(self) -> None:
        """Check every field; numbers are normalised to the field's type. ValueError names
        the field."""
        _check_fields(self, "policy")

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping of every field."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, d: Any) -> Policy:
        """Policy from a mapping; unknown keys and bad values raise ValueError."""
        if d is None:
            return cls()
        return _decode(cls, _policy_prepass(d), "policy")


def _policy_prepass(d: Any) -> dict[str, Any]:
    """A policy mapping with its durations in seconds (`"5m"` -> 300.0)."""
    if not isinstance(d, dict):
        raise ValueError(f"policy must be a mapping (got {type(d).__name__})")
    out = dict(d)
    for key, value in d.items():
        if key in Policy.__struct_fields__ and key.endswith("_s") and isinstance(value, str):
            try:
                out[key] = parse_duration(value)
            except ValueError as e:
                raise ValueError(f"policy.{key}: {e}") from None
    return out


def _command(value: Any) -> Any:
    """A command given as one shell string, split; a tuple as a list; anything else as is."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as e:
            raise ValueError(f"command cannot be parsed ({e}): {value!r}") from None
    return list(value) if isinstance(value, tuple) else value


def _env(value: Any) -> Any:
    """Environment values given as numbers, as strings."""
    if not isinstance(value, dict):
        return value
    return {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in value.items()}


_COMMAND_MUST = {"must": "be a non-empty list of strings"}


class JobSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One training job: what to run, on how many machines, in which parallel layout, with
    which fault-handling policy."""

    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", extra={
        "must": "be 1-63 letters, digits or _.- starting with a letter or digit"}), _doc(
        "job name: letters, digits and _.-, at most 63 characters.")] = "job"
    machines: Annotated[int, Meta(ge=1, le=MAX_MACHINES), _doc("machines in the job.")]
    gpus_per_machine: Annotated[int, Meta(ge=1, le=MAX_GPUS_PER_MACHINE), _doc(
        "ranks per machine.")] = 1
    tp: Annotated[Count, _doc("tensor-parallel size.")] = 1
    pp: Annotated[Count, _doc("pipeline-parallel size.")] = 1
    dp: Annotated[Count | None, _doc(
        "data-parallel size; null is derived as machines*gpus_per_machine/(tp*pp*cp*ep), which "
        "must be an integer.")] = None
    cp: Annotated[Count, _doc("context-parallel size.")] = 1
    ep: Annotated[Count, _doc("expert-parallel size.")] = 1
    steps: Annotated[Count, _doc("training steps of the whole job.")] = 100
    ckpt_every: Annotated[Count, _doc(
        "a durable checkpoint every this many steps; in-memory checkpoints are taken every "
        "step.")] = 10
    backup_every: Annotated[Count | Literal["auto"], Meta(extra={"must": "be an integer >= 1 or 'auto'"}), _doc(
        "push a rank's in-memory checkpoint to its backup peer every this many steps, or \"auto\": "
        "every step unless a push's measured CPU cost (both ends) would exceed 2% of a step's time, "
        "then every 2, 4, ... steps. At most policy.mem_slots - 2 (slower paces are cut to it): the "
        "surviving ranks must still hold the backed-up step in memory. A machine loss restores "
        "every rank to the newest step all of them backed up; the steps after it are lost.")] = "auto"
    command: Annotated[list[str], Meta(min_length=1, extra=_COMMAND_MUST, extra_json_schema={
        "x-or": {"type": "string", "minLength": 1}}), _doc(
        "the training command: a list of strings, or one string split as a shell would.")]
    standby: Annotated[Count0 | Literal["auto"], Meta(extra={"must": "be an integer >= 0 or 'auto'"}), _doc(
        "warm standby machines, or \"auto\" to size the pool from "
        "policy.daily_failure_rate.")] = 0
    chaos: Annotated[list[Annotated[str, Meta(pattern=r"\S")]], Meta(extra={
        "must": "be a list of non-empty strings"}), _doc(
        "fault injections, e.g. \"crash@step=60,machine=1\" (`stalwart inject -h` lists the "
        "kinds).")] = []
    code_dir: Annotated[PathText | None, _doc(
        "directory of the job's code; null means the current working directory (a relative path "
        "in a YAML file: relative to the file). Stored as an absolute path.")] = None
    workdir: Annotated[PathText | None, _doc(
        "the workers' working directory, where the script's relative paths land (its snapshots, "
        "its logs); null means code_dir. `stalwart run` sets the directory it was started in. "
        "The code itself comes from the code version's snapshot (docs/integration.md).")] = None
    env: Annotated[dict[Annotated[str, Meta(pattern=_ENV_NAME)],
                        Annotated[str, Meta(extra_json_schema={"x-or": {"type": "number"}})]], _doc(
        "extra environment variables for the workers (numbers are converted to strings).")] = {}
    policy: Annotated[Policy, _doc("the fault-handling thresholds.")] = msgspec.field(default_factory=Policy)

    def __post_init__(self) -> None:
        if not _DECODING.get():
            self.validate()

    # ------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check and normalise every field (derives dp, resolves code_dir, splits a string
        command).  Raises ValueError with a one-line message naming the field and value."""
        self.command = _command(self.command)
        self.env = _env(self.env)
        if isinstance(self.policy, dict):
            self.policy = Policy.from_dict(self.policy)
        if not isinstance(self.policy, Policy):
            raise ValueError(f"policy must be a mapping (got {type(self.policy).__name__})")
        _check_fields(self, "job spec")
        if not self.command[0]:
            raise ValueError(f"command must be a non-empty list of strings (got {self.command!r})")
        world = self.machines * self.gpus_per_machine
        if self.dp is None:
            other = self.tp * self.pp * self.cp * self.ep
            if world % other:
                raise ValueError(
                    f"dp = machines*gpus_per_machine/(tp*pp*cp*ep) = {world}/{other} is not an "
                    f"integer; change the layout or set dp")
            self.dp = world // other
        self.topology()  # raises the layout mismatch message
        self.code_dir = os.path.abspath(os.path.expanduser(self.code_dir or os.getcwd()))
        if self.workdir is not None:
            self.workdir = os.path.abspath(os.path.expanduser(self.workdir))
        self.policy.validate()

    # ------------------------------------------------------------ conversions
    def topology(self) -> Topology:
        """The job's parallel layout."""
        return Topology(self.machines, self.gpus_per_machine, tp=self.tp, pp=self.pp,
                        dp=self.dp if self.dp is not None else self.machines * self.gpus_per_machine
                        // (self.tp * self.pp * self.cp * self.ep), cp=self.cp, ep=self.ep)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, scalars) that ``from_dict`` turns back into this spec."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    def to_yaml(self) -> str:
        """The spec as YAML text accepted by ``from_yaml``."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: Any) -> JobSpec:
        """Spec from a mapping (policy nested); unknown keys, missing required keys and bad
        values raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"job spec must be a mapping (got {type(d).__name__})")
        values = dict(d)
        if "command" in values:
            values["command"] = _command(values["command"])
        if "env" in values:
            values["env"] = _env(values["env"])
        if values.get("policy") is None:
            values.pop("policy", None)
        else:
            values["policy"] = _policy_prepass(values["policy"])
        spec = _decode(cls, values, "job spec")
        spec.validate()
        return spec

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> JobSpec:
        """Spec from a YAML file; a relative code_dir is taken relative to the file."""
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ValueError(f"cannot read job spec {os.fspath(path)}: {e.strerror}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ValueError(f"job spec {os.fspath(path)}{where} is not valid YAML: {problem}") \
                from None
        if isinstance(data, dict) and isinstance(data.get("code_dir"), str):
            base = os.path.dirname(os.path.abspath(path))
            data["code_dir"] = os.path.join(base, os.path.expanduser(data["code_dir"]))
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"job spec {os.fspath(path)}: {e}") from None


def _decode(cls: Any, data: dict[str, Any], what: str) -> Any:
    """`data` as a `cls` (JobSpec or Policy) by msgspec; its error as one line naming the field."""
    try:
        with _decoding():
            return msgspec.convert(data, cls)
    except msgspec.ValidationError as e:
        raise ValueError(_one_line(cls, data, str(e), what)) from None


def _one_line(cls: Any, data: dict[str, Any], error: str, what: str) -> str:
    """msgspec's `error` (with its `$.a.b` path) as the house's message: the field by its
    name, its allowed values and the value given."""
    problem, path, of_key = what_failed(error)
    struct, prefix, obj = cls, "policy." if cls is Policy else "", data
    if cls is JobSpec and path and path[0] == "policy" and isinstance(data.get("policy"), dict):
        struct, prefix, obj, path = Policy, "policy.", data["policy"], path[1:]
        what = "policy"
    names = [f.name for f in msgspec.structs.fields(struct)]
    if m := re.fullmatch(r"Object contains unknown field `(.*)`", problem):
        return str(unknown_key_error(m.group(1), names, what))
    key = next((k for k in obj if not isinstance(k, str)), None) if of_key and not path else None
    if key is not None:                  # a key that is no string (YAML's `1: 2`)
        return str(unknown_key_error(key, names, what))
    if m := re.fullmatch(r"Object missing required field `(.*)`", problem):
        return f"{what} is missing required field {m.group(1)!r}"
    if path and path[0] in names:
        field = next(f for f in msgspec.structs.fields(struct) if f.name == path[0])
        return explain(prefix + field.name, field.type, obj.get(field.name))
    return f"{what}: {problem}"
