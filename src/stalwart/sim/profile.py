"""Durations the simulator gives its machines and agents: how long a probe takes to see a fault,
a stop, stack capture, stop-time checks, a replay phase, a restart, a requeue... (seconds).

Two profiles ship as data files beside this module, each value with where it came from:

- `paper`: ByteRobust's tables (Table 3 detection, Table 6 resolution, Table 7 hot update vs
  requeue, Table 8 checkpoint cost, Fig. 12 warm standby), at the scale of a 9,600-GPU job;
- `measured`: this repository's benches (`bench/recovery.py`, `bench/detection.py`) on a small
  local cluster, so the simulator can predict from what stalwart did here, not only from what the
  paper claims.

`python -m stalwart.sim.profile --recovery rec.json --detection det.json -o measured.json`
rebuilds the measured profile from the benches' `--json` files (values the benches do not measure
keep the shipped file's value and source).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, fields
from typing import Any

HERE = os.path.join(os.path.dirname(__file__), "profiles")
NAMES = ("paper", "measured")


@dataclass(frozen=True)
class Profile:
    """Seconds, except the recalls (probabilities) and the checkpoint overhead (a fraction)."""
    name: str
    detect_exit_s: float          # a worker's exit reaches the controller
    detect_gpu_s: float           # a GPU probe sees a lost GPU / fatal Xid / ECC error
    detect_network_s: float       # a NIC probe's alert (one of the two that evict)
    detect_kernel_s: float        # the kernel-log probe sees a panic
    detect_disk_s: float          # the disk probe sees a full or broken disk
    nccl_timeout_s: float         # a stuck collective fails on its own (no inspection)
    stop_s: float                 # stopping every worker of the run
    trace_s: float                # capturing every training process's stacks
    checks_s: float               # stop-time checks on every machine
    checks_recall: float          # a faulty machine fails the stop-time checks with this probability
    align_recall: float           # an SDC machine fails the bitwise alignment test with this probability
    replay_phase_s: float         # one phase of a dual-phase replay
    restart_s: float              # restart every worker in place from memory (warm spares, warm standbys)
    hot_update_s: float           # a planned in-place restart on new code
    peer_restart_s: float         # an in-job restart without warm spares (torchrun / NVRx style)
    requeue_s: float              # the whole job requeued: machines reallocated, pods rebuilt
    durable_load_s: float         # extra to restore from durable storage instead of memory
    prewarm_s: float              # a new standby until its workers are warm
    provision_s: float            # a replacement machine for the pool arrives
    spares_s: float               # spare workers on a new code version warm up beside training
    manual_s: float               # a human diagnoses a job stalwart gave up on, then resubmits it
    manual_sdc_s: float           # ... when the cause was silent data corruption
    memckpt_overhead: float       # step-time cost of the every-step in-memory checkpoint
    sources: dict[str, str]

    def describe(self) -> list[tuple[str, Any, str]]:
        """(field, value, source) of every value."""
        return [(f.name, getattr(self, f.name), self.sources.get(f.name, ""))
                for f in fields(self) if f.name not in ("name", "sources")]


VALUE_FIELDS = tuple(f.name for f in fields(Profile) if f.name not in ("name", "sources"))


def load(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile JSON file ({"name", "values", "sources"})."""
    path = os.path.join(HERE, f"{name_or_path}.json") if name_or_path in NAMES else name_or_path
    if not os.path.exists(path):
        raise ValueError(f"no profile {name_or_path!r} (use {' or '.join(NAMES)}, or a profile JSON file)")
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:
        raise ValueError(f"profile {path} is not valid JSON: {e}") from None
    values = data.get("values") if isinstance(data, dict) else None
    if not isinstance(values, dict):
        raise ValueError(f"profile {path} has no 'values' mapping")
    missing = [k for k in VALUE_FIELDS if k not in values]
    unknown = [k for k in values if k not in VALUE_FIELDS]
    if missing or unknown:
        raise ValueError(f"profile {path}: missing {missing or 'nothing'}, unknown {unknown or 'nothing'}")
    for k in VALUE_FIELDS:
        v = values[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"profile {path}: {k} must be a number >= 0 (got {v!r})")
    for k in ("checks_recall", "align_recall"):
        if values[k] > 1:
            raise ValueError(f"profile {path}: {k} is a probability (got {values[k]})")
    return Profile(name=str(data.get("name") or os.path.basename(path)),
                   sources=dict(data.get("sources") or {}), **{k: float(values[k]) for k in VALUE_FIELDS})


# -- rebuilding the measured profile from the benches ---------------------------------------------

def _get(d: Any, *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def from_benches(base: dict, recovery: dict | None, detection: list | None) -> dict:
    """The measured profile's data with the benches' figures in place of the base's.

    `recovery`: `bench/recovery.py --json` ({case: {"torchrun": {...}, "stalwart": {...}}});
    `detection`: `bench/detection.py --json` ([{"kind", "stalwart_s", ...}])."""
    values, sources = dict(base["values"]), dict(base.get("sources") or {})

    def put(key: str, value: float | None, source: str) -> None:
        if value is not None and value >= 0:
            values[key], sources[key] = round(value, 3), source
    rec = recovery or {}
    crash = rec.get("crash", {}).get("stalwart", {})
    put("detect_exit_s", _get(crash, "detection_s"), "bench/recovery.py crash: stalwart detection_s")
    put("checks_s", _get(crash, "localization_s"), "bench/recovery.py crash: stalwart localization_s (checks)")
    nxt, det, loc = (_get(crash, k) for k in ("fault_to_next_step_s", "detection_s", "localization_s"))
    if nxt is not None:
        put("restart_s", nxt - (det or 0.0) - (loc or 0.0),
            "bench/recovery.py crash: fault -> next step less detection and checks")
    put("hot_update_s", _get(rec, "update", "stalwart", "fault_to_next_step_s"),
        "bench/recovery.py update: stalwart hot update, stop -> next step")
    put("requeue_s", _get(rec, "update", "torchrun", "fault_to_next_step_s"),
        "bench/recovery.py update: full requeue, stop -> next step")
    put("peer_restart_s", _get(rec, "crash", "torchrun", "fault_to_next_step_s"),
        "bench/recovery.py crash: torchrun --max-restarts, fault -> next step")
    by_kind = {r.get("kind"): r for r in detection or [] if isinstance(r, dict)}
    for kind, key in (("gpu-lost", "detect_gpu_s"), ("nic-down", "detect_network_s")):
        put(key, _get(by_kind.get(kind), "stalwart_s"), f"bench/detection.py {kind}: stalwart detection")
    return {"name": base.get("name", "measured"), "description": base.get("description", ""),
            "values": values, "sources": sources}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stalwart.sim.profile",
                                 description="Rebuild the measured profile from the benches' --json files.")
    ap.add_argument("--recovery", help="bench/recovery.py --json FILE")
    ap.add_argument("--detection", help="bench/detection.py --json FILE")
    ap.add_argument("-o", "--output", help="where to write (default: print)")
    a = ap.parse_args(argv)
    with open(os.path.join(HERE, "measured.json")) as f:
        base = json.load(f)
    loaded: list[Any] = []
    for path in (a.recovery, a.detection):
        if path is None:
            loaded.append(None)
            continue
        try:
            with open(path) as f:
                loaded.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            return 2
    text = json.dumps(from_benches(base, loaded[0], loaded[1]), indent=2) + "\n"
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
