"""Slurm: the job's machines are the nodes of Slurm allocations, driven by Slurm's own CLI
(`backends/slurm_cli.py`).

- The cluster's machines: one `--no-kill` allocation of K nodes whose agents `srun` runs, one per
  node (`backends/slurm_agent.py` names it `m<first + SLURM_NODEID>` and gives it the node's
  topology labels). `--no-kill` keeps the allocation, and the other nodes' agents, when one node
  fails. Either the controller runs inside that allocation, on its first node (`stalwart slurm
  sbatch`, or a user's `#SBATCH` script that runs `stalwart slurm run`: `inside`), or elsewhere
  (`stalwart slurm submit`, the controller on the submitting host, which submits the allocation).
- Eviction drains the node: `scontrol update nodename=N state=drain reason="stalwart: incident 3:
  gpu_xid 79 ..."`, so Slurm hands it to nobody until an administrator resumes it. Without
  operator rights (Slurm refuses the drain), or with `drain: never`, the node is excluded from the
  job's refills (`sbatch --exclude`) and the user is told (the controller's log and
  `slurm/notes.log`, which `stalwart slurm run` prints to the job's output).
- A refill is a new single-node allocation of the same kind (`m<next>`), never on an excluded node.
- The allocation's end while the job runs (a time limit, a preemption, `scancel`) is read from
  Slurm and ends the job, cancelled with that reason, when the controller runs elsewhere. Inside
  the allocation the controller ends with it: a requeued allocation (`--requeue`, a preemption
  with PreemptMode=REQUEUE) runs `stalwart slurm run` again, which takes the job over and resumes
  it from its newest checkpoint (the durable tier, on storage every node sees).
- Every allocation is named `stalwart-<tag>`; `release` cancels them all (but the one the
  controller runs in, which ends when the controller does).

The launcher and the controller share the config (`<state-dir>/slurm/backend.json`) and the state
next to it (the main allocation's id, the next machine index, the excluded nodes), so a restarted
controller carries on.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.backends.base import Backend, BackendState
from stalwart.backends.slurm_cli import (  # noqa: F401  (re-exported: the backend's vocabulary)
    ENDED, LIVE_STATES, JobInfo, NodeInfo, SlurmError, ended_reason, hostnames, job_info, node_info, node_labels,
    parse_record, run_cli, switch_labels)

log = logging.getLogger("stalwart.slurm")
NOTES = "notes.log"          # what the user must know (a node that could not be drained), one per line


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
    sbatch_args: list[str] = field(default_factory=list)      # --partition, --time, --account, GPUs ...
    srun_args: list[str] = field(default_factory=list)        # the agents' srun: --container-image, --mpi ...
    agent_prefix: list[str] = field(default_factory=list)     # e.g. numactl
    workdir: str = "{state_dir}/machines/{machine}"
    env: dict[str, str] = field(default_factory=dict)         # for the agents (and their workers)
    agent_args: list[str] = field(default_factory=list)       # more `stalwart agent` options
    inside: bool = False          # the controller runs in the main allocation (it ends with it)
    drain: str = "auto"           # auto: drain an evicted node, exclude it where Slurm refuses; never

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
        self.state = BackendState(cfg.dir, {"main": None, "next": 0, "allocations": [], "excluded": []})

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

    def srun_argv(self, first: int, nodes: int | None = None) -> list[str]:
        """The step that starts one agent per node; a node's failure kills no other."""
        return (["srun", "--no-kill", "--kill-on-bad-exit=0", "--ntasks-per-node=1"]
                + ([f"--nodes={nodes}"] if nodes else []) + list(self.cfg.srun_args) + self.agent_command(first))

    def batch_script(self, first: int) -> str:
        """The batch script of an allocation of agents (no controller)."""
        env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(self.cfg.env.items()))
        return ("#!/bin/sh\n# stalwart's agents: one per node of this allocation (generated)\n" + env +
                "exec " + " ".join(shlex.quote(a) for a in self.srun_argv(first)) + "\n")

    def sbatch_argv(self, nodes: int, script: str) -> list[str]:
        excluded = self.state.read().get("excluded") or []
        return (["sbatch", "--parsable", "--no-kill", "--exclusive", f"--nodes={nodes}",
                 f"--job-name={self.cfg.name}", f"--output={self.cfg.dir}/logs/slurm-%j.out"]
                + list(self.cfg.sbatch_args) + ([f"--exclude={','.join(excluded)}"] if excluded else []) + [script])

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
        if self.cfg.drain != "never":
            try:
                run_cli(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"])
            except SlurmError as e:
                why = str(e)
            else:
                log.info("drained Slurm node %s (%s): %s", node, machine, reason)
                return
        else:
            why = "drain: never"

        def exclude(st: dict[str, Any]) -> None:
            st["excluded"] = sorted(set(st.get("excluded") or []) | {node})
        self.state.read(exclude)
        self.tell(f"Slurm node {node} ({machine}) is excluded from this job's refills; it was not drained "
                  f"({why}): tell your Slurm administrators. {reason}")

    def tell(self, note: str) -> None:
        """Something the user must know: the controller's log and `slurm/notes.log`."""
        log.warning("%s", note)
        with open(os.path.join(self.cfg.dir, NOTES), "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {note}\n")

    def request(self, count: int) -> list[str]:
        names = []
        for _ in range(count):
            name = self.state.take_names(1)[0]
            self._submit(1, int(name[1:]), main=False)
            names.append(name)
        return names

    def ended(self) -> str | None:
        if self.cfg.inside:
            return None         # the controller runs in the main allocation: it ends with it
        job = self.main_allocation()
        if job is None:
            return None
        return ended_reason(job, job_info(job))

    def allocation_state(self, job_id: str) -> tuple[str, str]:
        """(state, reason) of an allocation, e.g. ("PENDING", "Resources")."""
        info = job_info(job_id)
        return (info.state, info.reason) if info else ("GONE", "")

    def release(self) -> None:
        st = self.state.read()
        jobs = [j for j in st.get("allocations", []) if not (self.cfg.inside and j == st.get("main"))]
        if jobs:
            try:
                run_cli(["scancel", "--quiet"] + list(jobs))
            except SlurmError as e:
                log.warning("could not cancel the allocations %s: %s", ", ".join(jobs), e)
