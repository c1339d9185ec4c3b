"""The job spec and its policies: validated, with one-line messages that name the field and value.

A spec comes from `stalwart run` options, a YAML file (`--config`), or JSON through the API.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from stalwart.topology import Topology


def parse_duration(s: Any) -> float:
    """Seconds from "24h", "90s", "5m", "1.5" (seconds) or a number."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return float(s)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", str(s))
    if not m:
        raise ValueError(f"cannot read duration {s!r}; use e.g. 90s, 5m, 24h")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[m.group(2)]


@dataclass
class Policy:
    """How the controller reacts; every field has a production default.

    heartbeat_s: agent heartbeat interval. missed_beats: a machine is lost after this many missed
    heartbeats. max_restarts_without_progress: stop the job (and page a human) after this many
    consecutive restarts that made no step of progress. network_alert_count /
    network_alert_window_s: evict for a network alert only after this many within the window
    (ByteRobust: twice within 5 min). hang_timeout_floor_s, hang_safety_factor, hang_warmup_steps:
    the auto-calibrated hang timeout (max recent step time x factor, never below the floor, after
    the warm-up). loss_jump_factor: a loss or grad-norm jump of this factor over the recent median
    is an anomaly. failslow_rounds / failslow_period_s / failslow_drop: fail-slow aggregation rounds,
    their spacing, and the throughput drop that triggers them. similarity_window_s: how long a
    machine must stay the outlier of its peers to be a suspect. daily_failure_rate: per machine,
    for `standby: auto` (P99 sizing). hot_update_window_s: a lazy code update is forced after this.
    stop_grace_s: SIGTERM grace before SIGKILL when stopping workers. max_standby_wait_s: how long a
    job waits for its standbys to register before starting without them.
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
    daily_failure_rate: float = 0.0012
    hot_update_window_s: float = 86400.0
    stop_grace_s: float = 0.5
    max_standby_wait_s: float = 60.0

    POSITIVE = ("heartbeat_s", "missed_beats", "network_alert_count", "network_alert_window_s",
                "hang_timeout_floor_s", "hang_safety_factor", "loss_jump_factor", "failslow_rounds",
                "failslow_period_s", "similarity_window_s", "hot_update_window_s")

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want = int if f.type in ("int", int) else float
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not isinstance(v, int)):
                raise ValueError(f"policy.{f.name} must be a{'n integer' if want is int else ' number'} (got {v!r})")
            if f.name in self.POSITIVE and v <= 0:
                raise ValueError(f"policy.{f.name} must be > 0 (got {v})")
            if v < 0:
                raise ValueError(f"policy.{f.name} must be >= 0 (got {v})")
        if not 0 <= self.daily_failure_rate <= 1:
            raise ValueError(f"policy.daily_failure_rate must be within [0, 1] (got {self.daily_failure_rate})")
        if not 0 < self.failslow_drop < 1:
            raise ValueError(f"policy.failslow_drop must be within (0, 1) (got {self.failslow_drop})")


@dataclass
class JobSpec:
    """One training job: a command on machines x G accelerators with a parallel layout."""
    machines: int = 1
    gpus_per_machine: int = 1
    name: str = "job"
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    ep: int = 1
    steps: int = 100
    ckpt_every: int = 10
    command: list = field(default_factory=list)
    standby: Any = 0
    chaos: list = field(default_factory=list)
    code_dir: str | None = None
    env: dict = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self) -> None:
        if isinstance(self.policy, dict):
            self.policy = _build(Policy, self.policy, "policy")
        self.validate()

    def validate(self) -> None:
        for name in ("machines", "gpus_per_machine", "tp", "pp", "cp", "ep", "steps", "ckpt_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer (got {v!r})")
            if v < 1:
                raise ValueError(f"{name} must be >= 1 (got {v})")
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name must be a non-empty string (got {self.name!r})")
        total = self.machines * self.gpus_per_machine
        model = self.tp * self.pp * self.cp * self.ep
        if self.dp is None:
            if total % model:
                raise ValueError(f"{self._layout_names()} must divide machines*gpus-per-machine "
                                 f"({model} does not divide {self.machines}*{self.gpus_per_machine}={total})")
            self.dp = total // model
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp must be an integer >= 1 (got {self.dp!r})")
        if model * self.dp != total:
            factors = [self.tp, self.pp] + ([self.cp] if self.cp != 1 else []) + \
                      ([self.ep] if self.ep != 1 else []) + [self.dp]
            raise ValueError(f"{self._layout_names()}*dp must equal machines*gpus-per-machine "
                             f"({'*'.join(map(str, factors))}={model * self.dp}, "
                             f"{self.machines}*{self.gpus_per_machine}={total})")
        if not isinstance(self.command, list) or not all(isinstance(c, str) for c in self.command):
            raise ValueError(f"command must be a list of strings (got {self.command!r})")
        if self.standby != "auto" and (isinstance(self.standby, bool) or not isinstance(self.standby, int)
                                       or self.standby < 0):
            raise ValueError(f"standby must be a number >= 0 or 'auto' (got {self.standby!r})")
        if not isinstance(self.chaos, list) or not all(isinstance(c, str) for c in self.chaos):
            raise ValueError(f"chaos must be a list of strings like 'crash@step=5,machine=0' (got {self.chaos!r})")
        if not isinstance(self.env, dict):
            raise ValueError(f"env must be a mapping of names to values (got {self.env!r})")
        self.env = {str(k): str(v) for k, v in self.env.items()}
        self.policy.validate()

    def _layout_names(self) -> str:
        return "*".join(["tp", "pp"] + (["cp"] if self.cp != 1 else []) + (["ep"] if self.ep != 1 else []))

    def topology(self) -> Topology:
        return Topology(self.machines, self.gpus_per_machine, tp=self.tp, pp=self.pp, dp=self.dp,
                        cp=self.cp, ep=self.ep)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "JobSpec":
        if not isinstance(d, dict):
            raise ValueError(f"a job spec must be a mapping (got {type(d).__name__})")
        return _build(cls, d, "job spec")

    @classmethod
    def from_yaml(cls, path: str) -> "JobSpec":
        try:
            with open(path) as f:
                d = yaml.safe_load(f)
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if d is None:
            d = {}
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _build(cls, d: dict, what: str):
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a mapping (got {d!r})")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in d:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"unknown field '{key}' in {what}{hint}")
    return cls(**d)
