"""The job specification (JobSpec) and its fault-handling policy (Policy).

Both are plain validated dataclasses.  ``JobSpec.from_dict`` / ``from_yaml`` turn user
input into a spec and reject anything wrong with a one-line message naming the field and
the bad value; ``to_dict`` gives back plain data that ``from_dict`` accepts unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from stalwart.topology import Topology

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PLAIN_SECONDS = re.compile(rf"\s*({_NUMBER})\s*")
_WITH_UNITS = re.compile(rf"(?:\s*{_NUMBER}\s*(?:ms|s|m|h|d))+\s*", re.IGNORECASE)
_DURATION_PART = re.compile(rf"({_NUMBER})\s*(ms|s|m|h|d)", re.IGNORECASE)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_duration(s: Any) -> float:
    """Seconds in a duration: a number (seconds) or a string such as ``"90s"``, ``"5m"``,
    ``"24h"``, ``"1d"``, ``"250ms"``, ``"1.5"`` or ``"1h30m"``.  Raises ValueError otherwise
    (negative, NaN, infinite, empty or unparsable)."""
    bad = ValueError(f"invalid duration {s!r} (expected e.g. 90s, 5m, 24h or seconds)")
    if isinstance(s, bool):
        raise bad
    if isinstance(s, (int, float)):
        value = float(s)
    elif isinstance(s, str) and (plain := _PLAIN_SECONDS.fullmatch(s)):
        value = float(plain.group(1))
    elif isinstance(s, str) and _WITH_UNITS.fullmatch(s):
        value = sum(float(n) * _DURATION_UNITS[u.lower()] for n, u in _DURATION_PART.findall(s))
    else:
        raise bad
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"invalid duration {s!r} (must be a finite number of seconds >= 0)")
    return value


def _unknown_key_error(key: Any, known: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
    return ValueError(f"unknown field {key!r} in {where}{hint}")


# The largest count a field takes (an integer JSON, JavaScript and a 64-bit column hold exactly):
# `steps: 1e30` is refused here, not by the store or a worker later.
MAX_INT = 2**53 - 1
MAX_MACHINES = 1_000_000
MAX_GPUS_PER_MACHINE = 1024
MAX_FLOAT = 1e12             # (seconds: 30,000 years; factors: far past any meaningful one)


def _check_int(name: str, value: Any, minimum: int, maximum: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer (got {value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {value!r})")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum} (got {str(value)[:40]})")
    return value


def _check_float(name: str, value: Any, low: float, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number (got {value!r})")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number (got {str(value)[:40]}...)") from None
    if math.isnan(value):
        raise ValueError(f"{name} must be a number (got {value!r})")
    high = min(high, MAX_FLOAT)
    if value < low or (low_open and value == low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low:g} (got {value:g})")
    if value > high or (high_open and value == high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high:g} (got {value:g})")
    return value


# (kind, lower bound, lower bound open?, upper bound, upper bound open?) per Policy field.
_POLICY_RULES: dict[str, tuple[str, float, bool, float, bool]] = {
    "heartbeat_s": ("float", 0.0, True, math.inf, False),
    "missed_beats": ("int", 1, False, math.inf, False),
    "max_restarts_without_progress": ("int", 1, False, math.inf, False),
    "network_alert_count": ("int", 1, False, math.inf, False),
    "network_alert_window_s": ("float", 0.0, True, math.inf, False),
    "hang_timeout_floor_s": ("float", 0.0, True, math.inf, False),
    "hang_safety_factor": ("float", 1.0, False, math.inf, False),
    "hang_warmup_steps": ("int", 0, False, math.inf, False),
    "loss_jump_factor": ("float", 1.0, True, math.inf, False),
    "failslow_rounds": ("int", 1, False, math.inf, False),
    "failslow_period_s": ("float", 0.0, True, math.inf, False),
    "failslow_drop": ("float", 0.0, True, 1.0, True),
    "similarity_window_s": ("float", 0.0, True, math.inf, False),
    "similarity_continuity_s": ("float", 0.0, True, math.inf, False),
    "similarity_evict": ("bool", 0, False, 0, False),
    "daily_failure_rate": ("float", 0.0, False, 1.0, True),
    "hot_update_window_s": ("float", 0.0, False, math.inf, False),
    "hot_update_prewarm_s": ("float", 0.0, False, math.inf, False),
    "stop_grace_s": ("float", 0.0, False, math.inf, False),
    "max_standby_wait_s": ("float", 0.0, False, math.inf, False),
    "stop_time_checks": ("bool", 0, False, 0, False),
    "alignment_test": ("bool", 0, False, 0, False),
    "diag_timeout_s": ("float", 0.0, True, math.inf, False),
    "replay": ("bool", 0, False, 0, False),
    "replay_k": ("int", 0, False, math.inf, False),
    "replay_steps": ("int", 1, False, math.inf, False),
    "replay_timeout_s": ("float", 0.0, True, math.inf, False),
    "ladder_window_s": ("float", 0.0, True, math.inf, False),
    "mem_slots": ("int", 2, False, math.inf, False),
    "over_evict": ("bool", 0, False, 0, False),
    "warm_spares": ("bool", 0, False, 0, False),
    "trace_detector": ("bool", 0, False, 0, False),
    "trace_evict": ("bool", 0, False, 0, False),
    "trace_train_s": ("float", 0.0, True, math.inf, False),
    "trace_window_s": ("float", 0.0, True, math.inf, False),
}


@dataclass
class Policy:
    """Thresholds of the fault-handling ladder (all times in seconds).

    heartbeat_s: interval of agent heartbeats to the controller (> 0).
    missed_beats: a machine is declared lost after this many missed heartbeats (>= 1).
    max_restarts_without_progress: restarts allowed without a new kept step before the job
        stops and pages a human (>= 1).
    network_alert_count: network alerts on one machine that trigger its eviction ... (>= 1)
    network_alert_window_s: ... when they fall within this window (> 0; default 5 min).
    hang_timeout_floor_s: the auto-calibrated hang timeout is never below this (> 0).
    hang_safety_factor: hang timeout = this factor x the observed step time (>= 1).
    hang_warmup_steps: steps observed before the hang timeout is calibrated (>= 0); until
        then only the floor applies to the first steps' compile/warm-up.
    loss_jump_factor: a loss or grad-norm jump of at least this factor over the recent
        baseline is an anomaly (> 1).
    failslow_rounds: rounds of stack/metric sampling before a fail-slow verdict (>= 1).
    failslow_period_s: time between fail-slow rounds (> 0).
    failslow_drop: relative throughput decline that counts as fail-slow (0 < x < 1).
    similarity_window_s: window of worker metrics compared between peers (> 0).
    similarity_continuity_s: a machine unlike its peers for this long is a suspect (> 0;
        Minder: 4 minutes).
    similarity_evict: evict a suspect (when a standby is ready) rather than only report it.
    daily_failure_rate: per-machine probability of failing on a given day, sizes the warm
        standby pool when ``standby`` is "auto" (0 <= x < 1).
    hot_update_window_s: a pending code version is applied at the latest after this window
        (>= 0; default 24 h; 0 applies at once).
    hot_update_prewarm_s: before a code version is applied, every machine starts spare workers
        on it (torch imported, the new code loaded) while training goes on; a due update waits
        at most this long for them, then restarts cold (>= 0; 0 never waits). A version with a
        window gets its spares this long before the window expires.
    stop_grace_s: time between SIGTERM and SIGKILL when stopping workers (>= 0).
    max_standby_wait_s: how long a failover waits for a standby before restarting on the
        remaining machines or paging (>= 0).
    stop_time_checks: after a failure with no certain culprit, every machine runs a self-test,
        an all-to-all among its workers and paired all-gathers with its neighbours (true/false).
    alignment_test: after a NaN with no culprit, every machine runs one step of a fixed tiny
        GPT and results are compared bit for bit (true/false; needs >= 3 machines).
    diag_timeout_s: time bound of every wait in a machine's stop-time checks (> 0).
    replay: allow dual-phase replay when checks and a reattempt did not resolve a failure.
    replay_k: data-parallel size of each replay group (0: the smallest that works).
    replay_steps: steps each replay group trains (>= 1).
    replay_timeout_s: a replay group not done after this long counts as failing (> 0).
    ladder_window_s: failures further apart than this start the ladder afresh (> 0).
    mem_slots: shared-memory slots per rank for the every-step checkpoint, used round-robin
        (>= 2). Ranks of different data-parallel replicas stop a step or two apart and a backup
        peer's copy may trail by a step or two; holding the last few steps in memory lets a
        restore find one step that every rank has in memory. Costs one copy of a rank's state
        in host memory per slot.
    over_evict: a hang's or a slowdown's outlier stacks evict the parallel group they share
        (ByteRobust's over-eviction: fast, at the price of healthy machines in that group);
        false: stacks only inform, a hang's culprit is searched by stop-time checks and replay,
        and a slowdown evicts only machines measured slower than their peers (true/false).
    warm_spares: once a run trains, every machine starts spare workers (torch imported, at low
        priority) so that a restart there never waits for imports (true/false). Off where many
        simulated machines share one host's few cores: there the spares' imports compete with
        training, and a fault soon after the start finds them still importing.
    trace_detector: learn each job's healthy collective traces (the workers' flight recorders)
        and alert on a rank whose trace leaves them (true/false; docs/trace-detector.md).
    trace_evict: a trace alert may evict the machines it names, only while the job is slowed
        and a standby is ready; off: alerts only (true/false).
    trace_train_s: how long the trace model learns from a healthy run before it judges (> 0).
    trace_window_s: each rank's trace is scored over windows this long (> 0).

    ``from_dict`` also accepts duration strings ("90s", "5m", "24h") for fields ending in _s.
    """

    heartbeat_s: float = 1.0
    missed_beats: int = 3
    max_restarts_without_progress: int = 3
    network_alert_count: int = 2
    network_alert_window_s: float = 300.0
    hang_timeout_floor_s: float = 10.0
    hang_safety_factor: float = 5.0
    hang_warmup_steps: int = 3
    loss_jump_factor: float = 5.0
    failslow_rounds: int = 5
    failslow_period_s: float = 10.0
    failslow_drop: float = 0.3
    similarity_window_s: float = 240.0
    similarity_continuity_s: float = 240.0
    similarity_evict: bool = True
    daily_failure_rate: float = 0.0012
    hot_update_window_s: float = 86400.0
    hot_update_prewarm_s: float = 120.0
    stop_grace_s: float = 2.0
    max_standby_wait_s: float = 60.0
    stop_time_checks: bool = True
    alignment_test: bool = True
    diag_timeout_s: float = 10.0
    replay: bool = True
    replay_k: int = 0
    replay_steps: int = 6
    replay_timeout_s: float = 90.0
    ladder_window_s: float = 3600.0
    mem_slots: int = 4
    over_evict: bool = True
    warm_spares: bool = True
    trace_detector: bool = True
    trace_evict: bool = False
    trace_train_s: float = 120.0
    trace_window_s: float = 5.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; floats are normalised to float.  ValueError names the field."""
        for name, (kind, low, low_open, high, high_open) in _POLICY_RULES.items():
            value = getattr(self, name)
            full = f"policy.{name}"
            if kind == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{full} must be true or false (got {value!r})")
            elif kind == "int":
                _check_int(full, value, int(low))
            else:
                setattr(self, name, _check_float(full, value, low, high,
                                                 low_open=low_open, high_open=high_open))

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Policy:
        """Policy from a mapping; unknown keys and bad values raise ValueError."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"policy must be a mapping (got {type(d).__name__})")
        known = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise _unknown_key_error(key, known, "policy")
            if key.endswith("_s") and isinstance(value, str):
                try:
                    value = parse_duration(value)
                except ValueError as e:
                    raise ValueError(f"policy.{key}: {e}") from None
            values[key] = value
        return cls(**values)


@dataclass(kw_only=True)
class JobSpec:
    """One training job: what to run, on how many machines, in which parallel layout, with
    which fault-handling policy.

    name: job name, letters/digits/``_.-``, at most 63 characters.
    machines, gpus_per_machine: machines in the job (>= 1) and ranks per machine (>= 1).
    tp, pp, dp, cp, ep: parallel sizes; ``dp`` None is derived as
        machines*gpus_per_machine/(tp*pp*cp*ep) and must be integral.
    steps: training steps of the whole job (>= 1).
    ckpt_every: durable checkpoint every K steps (>= 1); in-memory checkpoints are every step.
    command: the training command (list of strings; a string is split with shlex).
    standby: warm standby machines (>= 0), or "auto" to size the pool from
        ``policy.daily_failure_rate``.
    chaos: fault injections, e.g. "crash@step=60,machine=1" (parsed by stalwart.chaos).
    code_dir: directory of the job's code; None means the current working directory. Stored
        as an absolute path.
    workdir: the workers' working directory, where the script's relative paths land (its
        snapshots, its logs); None means code_dir. `stalwart run` sets the directory it was started
        in. The code itself comes from the code version's snapshot (docs/integration.md).
    env: extra environment variables for the workers (numbers are converted to strings).
    policy: the fault-handling thresholds.
    """

    name: str = "job"
    machines: int
    gpus_per_machine: int = 1
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    ep: int = 1
    steps: int = 100
    ckpt_every: int = 10
    command: list[str]
    standby: int | str = 0
    chaos: list[str] = field(default_factory=list)
    code_dir: str | None = None
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check and normalise every field (derives dp, resolves code_dir, splits a string
        command).  Raises ValueError with a one-line message naming the field and value."""
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"name must be 1-63 letters, digits or _.- starting with a letter "
                             f"or digit (got {self.name!r})")
        _check_int("machines", self.machines, 1, MAX_MACHINES)
        _check_int("gpus_per_machine", self.gpus_per_machine, 1, MAX_GPUS_PER_MACHINE)
        for k in ("tp", "pp", "cp", "ep"):
            _check_int(k, getattr(self, k), 1)
        world = self.machines * self.gpus_per_machine
        if self.dp is None:
            other = self.tp * self.pp * self.cp * self.ep
            if world % other:
                raise ValueError(
                    f"dp = machines*gpus_per_machine/(tp*pp*cp*ep) = {world}/{other} is not an "
                    f"integer; change the layout or set dp")
            self.dp = world // other
        _check_int("dp", self.dp, 1)
        self.topology()  # raises the layout mismatch message
        _check_int("steps", self.steps, 1)
        _check_int("ckpt_every", self.ckpt_every, 1)
        self._validate_command()
        if self.standby != "auto":
            if isinstance(self.standby, str):
                raise ValueError(f"standby must be an integer >= 0 or 'auto' (got {self.standby!r})")
            _check_int("standby", self.standby, 0)
        if not isinstance(self.chaos, list) or not all(
                isinstance(c, str) and c.strip() for c in self.chaos):
            raise ValueError(f"chaos must be a list of non-empty strings (got {self.chaos!r})")
        if self.code_dir is None:
            self.code_dir = os.getcwd()
        elif not isinstance(self.code_dir, str) or not self.code_dir:
            raise ValueError(f"code_dir must be a path string (got {self.code_dir!r})")
        self.code_dir = os.path.abspath(os.path.expanduser(self.code_dir))
        if self.workdir is not None:
            if not isinstance(self.workdir, str) or not self.workdir:
                raise ValueError(f"workdir must be a path string (got {self.workdir!r})")
            self.workdir = os.path.abspath(os.path.expanduser(self.workdir))
        self._validate_env()
        if isinstance(self.policy, dict):
            self.policy = Policy.from_dict(self.policy)
        if not isinstance(self.policy, Policy):
            raise ValueError(f"policy must be a mapping (got {type(self.policy).__name__})")
        self.policy.validate()

    def _validate_command(self) -> None:
        if isinstance(self.command, str):
            try:
                self.command = shlex.split(self.command)
            except ValueError as e:
                raise ValueError(f"command cannot be parsed ({e}): {self.command!r}") from None
        if isinstance(self.command, tuple):
            self.command = list(self.command)
        if (not isinstance(self.command, list) or not self.command
                or not all(isinstance(a, str) for a in self.command) or not self.command[0]):
            raise ValueError(f"command must be a non-empty list of strings (got {self.command!r})")

    def _validate_env(self) -> None:
        if not isinstance(self.env, dict):
            raise ValueError(f"env must be a mapping of names to strings (got {self.env!r})")
        clean: dict[str, str] = {}
        for key, value in self.env.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise ValueError(f"env name must be a valid variable name (got {key!r})")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(f"env.{key} must be a string (got {value!r})")
            clean[key] = str(value)
        self.env = clean

    # ------------------------------------------------------------ conversions
    def topology(self) -> Topology:
        """The job's parallel layout."""
        return Topology(self.machines, self.gpus_per_machine, tp=self.tp, pp=self.pp,
                        dp=self.dp if self.dp is not None else self.machines * self.gpus_per_machine
                        // (self.tp * self.pp * self.cp * self.ep), cp=self.cp, ep=self.ep)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, scalars) that ``from_dict`` turns back into this spec."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "policy"}
        d["command"] = list(self.command)
        d["chaos"] = list(self.chaos)
        d["env"] = dict(self.env)
        d["policy"] = self.policy.to_dict()
        return d

    def to_yaml(self) -> str:
        """The spec as YAML text accepted by ``from_yaml``."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: Any) -> JobSpec:
        """Spec from a mapping (policy nested); unknown keys, missing required keys and bad
        values raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"job spec must be a mapping (got {type(d).__name__})")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in known:
                raise _unknown_key_error(key, known, "job spec")
        for required in ("machines", "command"):
            if required not in d:
                raise ValueError(f"job spec is missing required field {required!r}")
        values = dict(d)
        values["policy"] = Policy.from_dict(d.get("policy"))
        return cls(**values)

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
