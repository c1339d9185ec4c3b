"""Scenarios: a failure model and the durations it changes, as a data file.

`stalwart sim --scenario NAME|FILE` loads one. The shipped ones (`bytedance-dense`,
`bytedance-moe`, `llama3-16k`) live beside this module as YAML, each number with its source (a
table or figure of the paper it comes from, or "assumption" / "calibration") in a comment beside
it. The schema is typed (msgspec): a key the schema does not know, a negative rate or a share
above 1 is refused with the key's path in one line.

Schema (every section and key optional except `name`):

    name: str
    description: str
    profile: paper | measured | FILE      # durations not drawn from a distribution
    failures:                             # failures.Model: every rate and share, see there
      daily_rate: 0.0012                  # explicit incidents per machine per day
      ...
      recall: {KIND: share}               # stop-time check recall per fault kind (gpu, network, hang, ...)
      durations: {NAME: {mean: S, max: S}}  # a profile value (restart_s, checks_s, ...) or one of
                                          # EXTRA_DURATIONS, drawn from a lognormal with that mean
                                          # whose 99th percentile is `max`
"""
from __future__ import annotations

import os

import msgspec

from stalwart.sim.failures import Model
from stalwart.sim.profile import VALUE_FIELDS

HERE = os.path.join(os.path.dirname(__file__), "scenarios")
NAMES = ("bytedance-dense", "bytedance-moe", "llama3-16k")
# durations a scenario may give beyond the profile's values
EXTRA_DURATIONS = ("storage_outage_s", "slow_replacement_s", "planned_s", "user_fix_s", "warmup_s")
KINDS = ("gpu", "ecc", "gpu_lost", "disk", "network", "lost", "kernel", "crash", "oom", "io", "hang", "slow", "nan")


class Scenario(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str = ""
    profile: str = "paper"
    failures: Model = msgspec.field(default_factory=Model)


def load(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a YAML/JSON scenario file. Raises ValueError (one line)."""
    path = os.path.join(HERE, f"{name_or_path}.yaml") if name_or_path in NAMES else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"no scenario {name_or_path!r} (use {', '.join(NAMES)}, or a scenario file)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        if path.endswith(".json"):
            sc = msgspec.json.decode(data, type=Scenario)
        else:
            sc = msgspec.yaml.decode(data, type=Scenario)
    except msgspec.ValidationError as e:
        raise ValueError(f"scenario {path}: {_one_line(str(e))}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"scenario {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         f"{_one_line(str(e))}") from None
    known = set(VALUE_FIELDS) | set(EXTRA_DURATIONS)
    for key in sc.failures.durations:
        if key not in known:
            raise ValueError(f"scenario {path}: unknown duration `{key}` - at `$.failures.durations` "
                             f"(known: {', '.join(sorted(known))})")
    for key in sc.failures.recall:
        if key not in KINDS:
            raise ValueError(f"scenario {path}: unknown fault kind `{key}` - at `$.failures.recall` "
                             f"(known: {', '.join(KINDS)})")
    return sc


def _one_line(s: str) -> str:
    return " ".join(s.split())
