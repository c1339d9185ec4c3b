"""Slurm's CLI, and what its answers say (the PyPI `pyslurm` does not fit Debian's Slurm 22.05;
the CLI is what every Slurm version keeps stable).

- Hostlists (`n[1-3,5]`, `gpu[01-02]-ib[0-1]`) are expanded by Slurm itself: `scontrol show
  hostnames`.
- Jobs and nodes are read as JSON where Slurm serves it (`squeue --json`, `sinfo --json`, Slurm
  21.08+ with its openapi plugins, Debian's 22.05 included), else from `scontrol -o show` records.
  Both become the same small records (`JobInfo`, `NodeInfo`).
- Topology (`scontrol show topology`, topology/tree) has no JSON form: its one-line records are
  split into keys (`parse_record`), their node lists expanded by Slurm.
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from typing import Any, Callable

from stalwart.errors import StalwartError

CLI_TIMEOUT_S = 30.0
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
               "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED"}
ENDED = {"PREEMPTED": "was preempted", "TIMEOUT": "reached its time limit", "CANCELLED": "was cancelled",
         "NODE_FAIL": "lost its nodes", "DEADLINE": "reached its deadline", "BOOT_FAIL": "failed to boot",
         "OUT_OF_MEMORY": "ran out of memory", "FAILED": "failed", "COMPLETED": "ended", "GONE": "is gone"}
_json_refused: set[str] = set()          # commands that said they take no --json (an older Slurm)


class SlurmError(StalwartError, RuntimeError):
    """A Slurm command failed (its stderr says why)."""


def run_cli(argv: list[str], timeout: float = CLI_TIMEOUT_S) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} not found: is Slurm's client installed (Debian slurm-client)?") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv[:3])} did not answer within {timeout:.0f}s") from None
    if p.returncode != 0:       # (one line: Slurm's last word is its reason, e.g. its fatal error)
        said = [line.strip() for line in p.stderr.splitlines() if line.strip()]
        raise SlurmError(f"{' '.join(argv[:3])}: {said[-1] if said else f'exit code {p.returncode}'}")
    return p.stdout


def run_json(argv: list[str]) -> dict[str, Any] | None:
    """`argv` with --json, parsed; None where this Slurm's command takes no --json."""
    if argv[0] in _json_refused:
        return None
    try:
        out = run_cli([argv[0], "--json", *argv[1:]])
    except SlurmError as e:
        if "unrecognized option" in str(e) or "invalid option" in str(e) or "not supported" in str(e):
            _json_refused.add(argv[0])
            return None
        raise
    try:
        data = json.loads(out)
    except ValueError:
        _json_refused.add(argv[0])
        return None
    return data if isinstance(data, dict) else None


def hostnames(expr: str) -> list[str]:
    """Slurm's expansion of a hostlist expression."""
    if not expr.strip():
        return []
    return run_cli(["scontrol", "show", "hostnames", expr]).split()


# -- records ------------------------------------------------------------------------------------
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_record(line: str) -> dict[str, str]:
    """One `scontrol -o show …` record as a dict. Values may hold spaces (`Reason=`, `OS=`): a
    value runs to the next ` Key=`; a node's `Reason`, always last, keeps the rest of the line."""
    out: dict[str, str] = {}
    line = line.strip()
    reason_at = line.find(" Reason=") if not line.startswith("JobId=") else -1
    tail = None
    if reason_at >= 0:
        line, tail = line[:reason_at], line[reason_at + len(" Reason="):]
    keys = list(_KEY.finditer(line))
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    if tail is not None:
        out["Reason"] = tail.strip()
    return out


@dataclass
class JobInfo:
    """What stalwart reads of a Slurm job (an allocation)."""
    job_id: str
    state: str                      # PENDING, RUNNING, COMPLETING, PREEMPTED, ...
    reason: str = ""                # why pending, or TimeLimit
    preempted: bool = False         # a preemption time is set
    restarts: int = 0               # times requeued
    nodes: str = ""                 # hostlist
    batch_host: str = ""
    comment: str = ""
    partition: str = ""
    account: str = ""
    gres: str = ""                  # per node, e.g. gpu:8
    time_limit_min: int = 0         # 0: none

    def like_this(self) -> list[str]:
        """sbatch options that ask for a node like this allocation's (a refill)."""
        out = [f"--partition={self.partition}"] if self.partition else []
        out += [f"--account={self.account}"] if self.account else []
        out += [f"--gres={self.gres}"] if self.gres else []
        return out + ([f"--time={self.time_limit_min}"] if self.time_limit_min else [])

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "JobInfo":
        """From an entry of `squeue --json`'s `jobs`."""
        state = d.get("job_state", "")
        if isinstance(state, list):             # (newer Slurm: a list of flags)
            state = state[0] if state else ""
        return cls(job_id=str(d.get("job_id", "")), state=str(state), reason=str(d.get("state_reason") or ""),
                   preempted=_number(d.get("preempt_time")) > 0, restarts=int(_number(d.get("restart_cnt"))),
                   nodes=str(d.get("nodes") or ""), batch_host=str(d.get("batch_host") or ""),
                   comment=str(d.get("comment") or ""), partition=str(d.get("partition") or ""),
                   account=str(d.get("account") or ""), gres=_gres(str(d.get("tres_per_node") or "")),
                   time_limit_min=int(_number(d.get("time_limit"))))

    @classmethod
    def from_record(cls, rec: dict[str, str]) -> "JobInfo":
        """From a `scontrol -o show job` record."""
        return cls(job_id=rec.get("JobId", ""), state=rec.get("JobState", ""), reason=rec.get("Reason", ""),
                   preempted=rec.get("PreemptTime", "None") not in ("None", ""),
                   restarts=int(rec.get("Restarts", "0") or 0), nodes=rec.get("NodeList", ""),
                   batch_host=rec.get("BatchHost", ""), comment=rec.get("Comment", ""),
                   partition=rec.get("Partition", ""), account=_null(rec.get("Account", "")),
                   gres=_gres(_null(rec.get("TresPerNode", ""))))


def _null(v: str) -> str:
    return "" if v in ("(null)", "N/A") else v


def _gres(tres: str) -> str:
    """`gres:gpu:8` or `gres/gpu=8` (a job's TRES per node) as sbatch's --gres takes it: gpu:8."""
    parts = [p for p in tres.split(",") if p.startswith(("gres:", "gres/"))]
    return ",".join(p[5:].replace("=", ":") for p in parts)


def _number(v: Any) -> float:
    """A number of Slurm's JSON: plain, or (newer Slurm) {set, infinite, number}."""
    if isinstance(v, dict):
        return float(v.get("number", 0)) if v.get("set", True) else 0.0
    try:
        return float(v or 0)
    except (TypeError, ValueError):
        return 0.0


def job_info(job_id: str) -> JobInfo | None:
    """The job as Slurm knows it now; None once it has forgotten it."""
    try:
        data = run_json(["squeue", "--states=all", f"--jobs={job_id}"])
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    if data is not None:
        jobs = [j for j in data.get("jobs", []) if str(j.get("job_id")) == str(job_id)]
        return JobInfo.from_json(jobs[0]) if jobs else None
    try:
        out = run_cli(["scontrol", "-o", "show", "job", job_id])
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    return JobInfo.from_record(parse_record(out.splitlines()[0])) if out.strip() else None


@dataclass
class NodeInfo:
    """What stalwart reads of a Slurm node."""
    name: str
    address: str = ""
    features: str = ""
    state: str = ""                 # idle, alloc, down, ...; with +DRAIN etc.
    reason: str = ""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "NodeInfo":
        """From an entry of `sinfo --json`'s `nodes`."""
        state = d.get("state", "")
        flags = d.get("state_flags") or []
        if isinstance(state, list):
            state = "+".join(state)
        return cls(name=str(d.get("name", "")), address=str(d.get("address") or ""),
                   features=str(d.get("active_features") or ""),
                   state="+".join([str(state).upper(), *map(str, flags)]), reason=str(d.get("reason") or ""))

    @classmethod
    def from_record(cls, rec: dict[str, str]) -> "NodeInfo":
        """From a `scontrol -o show node` record."""
        feats = rec.get("ActiveFeatures", "")
        return cls(name=rec.get("NodeName", ""), address=rec.get("NodeAddr", ""),
                   features="" if feats == "(null)" else feats, state=rec.get("State", ""),
                   reason=rec.get("Reason", ""))


def node_info(node: str) -> NodeInfo | None:
    data = run_json(["sinfo", f"--nodes={node}"])
    if data is not None:
        found = [n for n in data.get("nodes", []) if n.get("name") == node]   # (22.05 lists every node)
        return NodeInfo.from_json(found[0]) if found else None
    out = run_cli(["scontrol", "-o", "show", "node", node])
    return NodeInfo.from_record(parse_record(out)) if out.strip() else None


# -- topology labels -----------------------------------------------------------------------------
def switch_labels(topology: str, node: str, expand: Callable[[str], list[str]] = hostnames) -> dict[str, str]:
    """From `scontrol show topology` (topology/tree): `switch` = the lowest-level switch holding
    the node, `pod` = the switch above it when there is one (the tree's root over several leaves
    is everybody's, not a pod). `expand` turns a hostlist into names (Slurm's, by default)."""
    switches = []
    for line in topology.splitlines():
        rec = parse_record(line)
        if "SwitchName" in rec:
            switches.append((int(rec.get("Level", "0") or 0), rec["SwitchName"],
                             expand(rec.get("Nodes", "")), rec.get("Switches", "").split(",")))
    mine = sorted((level, name) for level, name, nodes, _ in switches if node in nodes)
    if not mine:
        return {}
    labels = {"switch": mine[0][1]}
    above = [(level, name) for level, name, _, children in switches if mine[0][1] in children]
    top = max(level for level, *_ in switches)
    if above and above[0][0] < top:
        labels["pod"] = above[0][1]
    return labels


def node_labels(node: str) -> dict[str, str]:
    """A node's topology labels where Slurm knows them: its switch (and pod) from topology/tree,
    else its features (`features=a,b`); always `slurm.node`."""
    labels = {"slurm.node": node}
    try:
        labels.update(switch_labels(run_cli(["scontrol", "show", "topology", node]), node))
    except SlurmError:
        pass                       # no topology plugin configured
    if "switch" not in labels:
        try:
            info = node_info(node)
        except SlurmError:
            info = None
        if info is not None and info.features:
            labels["features"] = info.features
    return labels


def ended_reason(job_id: str, info: JobInfo | None) -> str | None:
    """Why allocation `job_id` is over (None: Slurm forgot it, it is gone), or None while it lives."""
    if info is None:
        state = "GONE"
    else:
        state = info.state
        if state in LIVE_STATES:
            return None
        if state == "COMPLETING":
            # being torn down (its final state shows once every step ended, after KillWait): say
            # why now. With no preemption and no time limit it was cancelled: the batch script
            # never ends by itself while its agents run, and --no-kill survives failed nodes.
            if info.preempted:
                state = "PREEMPTED"
            elif info.reason == "TimeLimit":
                state = "TIMEOUT"
            else:
                return f"the Slurm allocation {job_id} was cancelled (COMPLETING)"
    return f"the Slurm allocation {job_id} {ENDED.get(state, 'ended')} ({state})"
