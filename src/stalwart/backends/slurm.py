"""Slurm: the job's machines are the nodes of Slurm allocations, driven by Slurm's own CLI
(`sbatch`, `srun`, `scontrol`, `squeue`, `scancel`; the PyPI `pyslurm` does not fit Debian's
Slurm 22.05, and the CLI is what every Slurm version keeps stable).

- The cluster's machines: one `sbatch --no-kill --exclusive -N K` allocation whose batch script
  `srun`s one agent per node (`backends/slurm_agent.py` names it `m<first + SLURM_NODEID>` and
  gives it the node's topology labels). `--no-kill` keeps the allocation, and the other nodes'
  agents, when one node fails.
- Eviction drains the node: `scontrol update nodename=N state=drain reason="stalwart: incident 3:
  gpu_xid 79 ..."`, so Slurm hands it to nobody until an administrator resumes it.
- A refill is a new single-node allocation of the same kind (`m<next>`).
- The allocation's end while the job runs (a time limit, a preemption, `scancel`) is read from
  `scontrol show job` and ends the job, cancelled with that reason.
- Every allocation is named `stalwart-<tag>`; `release` cancels them all.

The launcher and the controller share the config (`<state-dir>/slurm/backend.json`) and the state
next to it (the main allocation's id, the next machine index), so a restarted controller carries on.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.backends.base import Backend, BackendState

log = logging.getLogger("stalwart.slurm")
CLI_TIMEOUT_S = 30.0
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
               "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED"}
ENDED = {"PREEMPTED": "was preempted", "TIMEOUT": "reached its time limit", "CANCELLED": "was cancelled",
         "NODE_FAIL": "lost its nodes", "DEADLINE": "reached its deadline", "BOOT_FAIL": "failed to boot",
         "OUT_OF_MEMORY": "ran out of memory", "FAILED": "failed", "COMPLETED": "ended", "GONE": "is gone"}


class SlurmError(RuntimeError):
    """A Slurm command failed (its stderr says why)."""


def run_cli(argv: list[str], timeout: float = CLI_TIMEOUT_S) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} not found: is Slurm's client installed (Debian slurm-client)?") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv[:3])} did not answer within {timeout:.0f}s") from None
    if p.returncode != 0:
        raise SlurmError(f"{' '.join(argv[:3])}: {p.stderr.strip() or f'exit code {p.returncode}'}")
    return p.stdout


# -- parsing Slurm's output (pure) ------------------------------------------------------------
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_record(line: str) -> dict[str, str]:
    """One `scontrol -o show …` record as a dict. Values may hold spaces (`Reason=`, `OS=`): a
    value runs to the next ` Key=`; `Reason`, always last, keeps the rest of the line."""
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


def expand_hostlist(expr: str) -> list[str]:
    """`n[1-3,5],gpu[08-09]` -> n1 n2 n3 n5 gpu08 gpu09 (Slurm's hostlist syntax, one bracket
    per name, ranges keep their zero padding)."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", expr):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            out.append(part)
            continue
        pre, body, post = m.groups()
        for r in body.split(","):
            lo, _, hi = r.partition("-")
            if not hi:
                out.append(f"{pre}{lo}{post}")
                continue
            for i in range(int(lo), int(hi) + 1):
                out.append(f"{pre}{str(i).zfill(len(lo))}{post}")
    return out


def switch_labels(topology: str, node: str) -> dict[str, str]:
    """From `scontrol show topology` (topology/tree): `switch` = the lowest-level switch holding
    the node, `pod` = the switch above it when there is one (the tree's root over several leaves
    is everybody's, not a pod)."""
    switches = []
    for line in topology.splitlines():
        rec = parse_record(line)
        if "SwitchName" in rec:
            switches.append((int(rec.get("Level", "0") or 0), rec["SwitchName"],
                             expand_hostlist(rec.get("Nodes", "")), rec.get("Switches", "").split(",")))
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
            rec = parse_record(run_cli(["scontrol", "-o", "show", "node", node]))
        except SlurmError:
            rec = {}
        feats = rec.get("ActiveFeatures", "")
        if feats and feats != "(null)":
            labels["features"] = feats
    return labels


def ended_reason(job_id: str, rec: dict[str, str] | None) -> str | None:
    """Why allocation `job_id` is over, from its `scontrol -o show job` record (None: no record,
    the job is gone), or None while it lives."""
    if rec is None:
        state = "GONE"
    else:
        state = rec.get("JobState", "")
        if state in LIVE_STATES:
            return None
        if state == "COMPLETING":
            # being torn down (its final state shows once every step ended, after KillWait): say
            # why now. With no preemption and no time limit it was cancelled: the batch script
            # never ends by itself while its agents run, and --no-kill survives failed nodes.
            if rec.get("PreemptTime", "None") not in ("None", ""):
                state = "PREEMPTED"
            elif rec.get("Reason") == "TimeLimit":
                state = "TIMEOUT"
            else:
                return f"the Slurm allocation {job_id} was cancelled (COMPLETING)"
    return f"the Slurm allocation {job_id} {ENDED.get(state, 'ended')} ({state})"


# -- the backend ------------------------------------------------------------------------------
@dataclass
class SlurmConfig:
    """What the launcher, the controller and each node's agent wrapper share (JSON)."""
    state_dir: str
    tag: str
    controller_url: str = ""
    token_file: str = ""
    gpus: int = 1
    heartbeat_s: float = 1.0
    log_level: str = "INFO"
    python: str = sys.executable
    sbatch_args: list[str] = field(default_factory=list)      # --partition, --time, --account ...
    agent_prefix: list[str] = field(default_factory=list)     # e.g. a container launcher
    workdir: str = "{state_dir}/machines/{machine}"
    env: dict[str, str] = field(default_factory=dict)         # for the agents (and their workers)
    agent_args: list[str] = field(default_factory=list)       # more `stalwart agent` options

    @property
    def dir(self) -> str:
        return os.path.join(self.state_dir, "slurm")

    @property
    def path(self) -> str:
        return os.path.join(self.dir, "backend.json")

    @property
    def name(self) -> str:
        return f"stalwart-{self.tag}"

    def save(self) -> str:
        os.makedirs(self.dir, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"kind": "slurm", **asdict(self)}, f, indent=1)
        os.replace(tmp, self.path)
        return self.path

    @classmethod
    def load(cls, path: str) -> "SlurmConfig":
        with open(path) as f:
            d = json.load(f)
        d.pop("kind", None)
        return cls(**d)


class SlurmBackend(Backend):
    kind = "slurm"

    def __init__(self, cfg: SlurmConfig):
        self.cfg = cfg
        os.makedirs(os.path.join(cfg.dir, "logs"), exist_ok=True)
        self.state = BackendState(cfg.dir, {"main": None, "next": 0, "allocations": []})

    @classmethod
    def from_config(cls, d: dict[str, Any]) -> "SlurmBackend":
        d = {k: v for k, v in d.items() if k != "kind"}
        try:
            return cls(SlurmConfig(**d))
        except TypeError as e:
            raise ValueError(f"slurm backend config: {e}") from None

    # -- allocations ----------------------------------------------------------------------------
    def agent_command(self, first: int) -> list[str]:
        return list(self.cfg.agent_prefix) + [self.cfg.python, "-m", "stalwart.backends.slurm_agent",
                                              "--config", self.cfg.path, "--first", str(first)]

    def batch_script(self, first: int) -> str:
        """The allocation's batch script: one agent per node, a node's failure kills no other."""
        env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(self.cfg.env.items()))
        return ("#!/bin/sh\n# stalwart's agents: one per node of this allocation (generated)\n" + env +
                "exec srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 " +
                " ".join(shlex.quote(a) for a in self.agent_command(first)) + "\n")

    def sbatch_argv(self, nodes: int, script: str) -> list[str]:
        return (["sbatch", "--parsable", "--no-kill", "--exclusive", f"--nodes={nodes}",
                 f"--job-name={self.cfg.name}", f"--output={self.cfg.dir}/logs/slurm-%j.out"]
                + list(self.cfg.sbatch_args) + [script])

    def _submit(self, nodes: int, first: int, main: bool) -> str:
        script = os.path.join(self.cfg.dir, f"agents-{first}.sh")
        with open(script, "w") as f:
            f.write(self.batch_script(first))
        os.chmod(script, 0o755)
        job_id = run_cli(self.sbatch_argv(nodes, script)).strip().split(";")[0]

        def note(st: dict[str, Any]) -> None:
            st["allocations"].append(job_id)
            if main:
                st["main"] = job_id
        self.state.read(note)
        log.info("Slurm allocation %s: %d node(s) for m%d..m%d", job_id, nodes, first, first + nodes - 1)
        return job_id

    def start_agents(self, controller_url: str, count: int) -> list[str]:
        if controller_url != self.cfg.controller_url:
            self.cfg.controller_url = controller_url
            self.cfg.save()
        names = self.state.take_names(count)
        self._submit(count, int(names[0][1:]), main=True)
        return names

    def main_allocation(self) -> str | None:
        return self.state.read().get("main")

    def labels(self, node: str) -> dict[str, str]:
        return node_labels(node)

    def evict(self, machine: str, reason: str, labels: dict[str, str]) -> None:
        node = labels.get("slurm.node")
        if not node:
            log.warning("cannot drain %s: its agent did not say which Slurm node it runs on", machine)
            return
        run_cli(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"])
        log.info("drained Slurm node %s (%s): %s", node, machine, reason)

    def request(self, count: int) -> list[str]:
        names = []
        for _ in range(count):
            name = self.state.take_names(1)[0]
            self._submit(1, int(name[1:]), main=False)
            names.append(name)
        return names

    def ended(self) -> str | None:
        job = self.main_allocation()
        if job is None:
            return None
        try:
            out = run_cli(["scontrol", "-o", "show", "job", job])
        except SlurmError as e:
            if "Invalid job id" in str(e):
                return ended_reason(job, None)
            raise
        return ended_reason(job, parse_record(out.splitlines()[0]) if out.strip() else None)

    def allocation_state(self, job_id: str) -> tuple[str, str]:
        """(state, reason) of an allocation, e.g. ("PENDING", "Resources")."""
        rec = parse_record(run_cli(["scontrol", "-o", "show", "job", job_id]).splitlines()[0])
        return rec.get("JobState", "?"), rec.get("Reason", "")

    def release(self) -> None:
        jobs = self.state.read().get("allocations", [])
        if jobs:
            try:
                run_cli(["scancel", "--quiet"] + list(jobs))
            except SlurmError as e:
                log.warning("could not cancel the allocations %s: %s", ", ".join(jobs), e)
