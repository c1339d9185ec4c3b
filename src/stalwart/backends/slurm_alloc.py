"""Slurm with the controller inside the allocation: `stalwart slurm sbatch` and `stalwart slurm run`.

    stalwart slurm sbatch --nodes 4 --standby 1 --gpus-per-node 8 --partition gpu --time 24:00:00 \\
        --state-dir /shared/llm -- python train.py

writes the job's spec and a batch script into the state dir (which every node must see), submits
it with `sbatch` and exits: the user may log out. The batch script runs `stalwart slurm run` on the
allocation's first node, which starts the controller there, `srun`s one agent per node of the
allocation (with the `--srun-arg`s: pyxis' --container-image, --mpi, --cpu-bind...), submits the
job, prints its progress to the job's output file and exits with the job's result (0 succeeded,
1 not), ending the allocation. A user's own `#SBATCH` script runs `stalwart slurm run` the same way.

The allocation is `--requeue`able: when Slurm requeues it (a preemption with PreemptMode=REQUEUE, a
node failure, `scontrol requeue`), the batch script runs again and `stalwart slurm run` takes the
job over: the controller restarts on the same store, the agents register again, and the job goes on
from its newest checkpoint (the new nodes' memory is empty: the durable tier, under the state dir).

`stalwart status/report --slurm-job ID` find the state dir of a Slurm job from a registry of the
jobs submitted (`~/.stalwart/slurm-jobs/ID`, or `$STALWART_SLURM_JOBS`), else from the job's
comment (`stalwart:<state dir>`).

The command itself (its arguments, a user's mistakes, what it prints) is in `cli/slurm.py`.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from typing import Any

from stalwart.agent.workers import kill_tree
from stalwart.backends.local import LocalCluster
from stalwart.backends.slurm import SlurmError, job_info
from stalwart.backends.slurm_submit import SlurmCluster
from stalwart.errors import UserError
from stalwart.security import auth

REGISTRY_ENV = "STALWART_SLURM_JOBS"
COMMENT_PREFIX = "stalwart:"


# -- which state dir a Slurm job uses --------------------------------------------------------------
def registry_dir() -> str:
    return os.environ.get(REGISTRY_ENV) or os.path.join(os.path.expanduser("~"), ".stalwart", "slurm-jobs")


def remember(job_id: str, state_dir: str) -> None:
    """Note that Slurm job `job_id` runs the stalwart job of `state_dir`."""
    try:
        os.makedirs(registry_dir(), exist_ok=True)
        with open(os.path.join(registry_dir(), str(job_id)), "w") as f:
            f.write(os.path.abspath(state_dir) + "\n")
    except OSError:
        pass                 # the job's comment says it too (sbatch)


def state_dir_of(job_id: str) -> str:
    """The state dir of Slurm job `job_id` (UserError when nothing says)."""
    if not str(job_id).isdigit():
        raise UserError(f"--slurm-job takes a Slurm job id (got {job_id!r})")
    try:
        with open(os.path.join(registry_dir(), str(job_id))) as f:
            return f.read().strip()
    except OSError:
        pass
    try:
        info = job_info(str(job_id))
    except SlurmError as e:
        raise UserError(f"cannot ask Slurm about job {job_id}: {e}") from None
    if info is not None and info.comment.startswith(COMMENT_PREFIX):
        return info.comment[len(COMMENT_PREFIX):]
    raise UserError(f"Slurm job {job_id} is not a stalwart job this user submitted (no {registry_dir()}/{job_id}, "
                    f"no '{COMMENT_PREFIX}' comment): pass --state-dir")


# -- stalwart slurm run: inside the allocation ----------------------------------------------------
class InsideCluster(SlurmCluster):
    """The controller on this node (the allocation's first), restarted like the local cluster's,
    and the agents of the allocation's nodes in one `srun` step; refills are new allocations."""

    def __init__(self, state_dir: str, job_id: str, nodes: int, gpus_per_node: int, advertise: str,
                 srun_args: list[str], **kw: Any):
        super().__init__(state_dir, nodes, gpus_per_node, advertise, **kw)
        self.job_id = job_id
        self.cfg.inside = True
        self.cfg.srun_args = list(srun_args)
        self.step: subprocess.Popen | None = None
        self.requeued = False        # keep the refill allocations: their agents serve the next run

    def start(self, timeout: float = 60.0, takeover: bool = False) -> str:   # type: ignore[override]
        os.makedirs(self.state_dir, exist_ok=True)
        self.token = auth.create_token_file(self.token_file)      # (kept: a requeued run reuses it)
        self.store_host = self.advertise
        self._stopping.clear()
        self._start_controller(f"{self.listen_host}:0", timeout, extra=[] if takeover else ["--abandon-running"])
        self.start_agents(self.agents_url(), self.n)
        self.wait_registered(timeout)
        threading.Thread(target=self._supervise, name="controller-supervisor", daemon=True).start()
        return self.url or ""

    def start_agents(self, controller_url: str, count: int) -> list[str]:
        self.cfg.controller_url = controller_url
        self.cfg.save()
        job = self.job_id

        def note(st: dict[str, Any]) -> None:
            st["main"] = job
            if job not in st["allocations"]:
                st["allocations"].append(job)
            st["next"] = max(int(st.get("next", 0)), count)      # m0..m{count-1}: this allocation's
        self.backend.state.read(note)
        self.names = [f"m{i}" for i in range(count)]
        self.step = self._spawn(self.backend.srun_argv(0, count), "agents-step.log")
        return self.names

    def wait_registered(self, timeout: float) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            alive = self.alive(client)
            if set(self.names) <= alive:
                return
            if self.on_wait:
                self.on_wait(len(set(self.names) & alive), len(self.names), "RUNNING")
            if self.step is not None and self.step.poll() is not None:
                raise RuntimeError(f"the agents' srun step exited (code {self.step.returncode}); see "
                                   f"{self.state_dir}/logs/agents-step.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agents did not register within {timeout:.0f}s; see "
                                   f"{self.state_dir}/logs/agents-step.log")
            time.sleep(0.2)

    def halt_controller(self) -> None:
        """Stop the controller at once, as it is: Slurm is killing the agents for a requeue, and
        the controller must not take that for lost machines (it would start recovering, with no
        standby left). The next run's controller takes the job over from the store."""
        self._stopping.set()                    # (no restart by the supervisor)
        self.requeued = True
        proc = self.controller
        if proc is not None and proc.poll() is None:
            proc.kill()

    def stop(self) -> None:
        if self.step is not None:
            kill_tree(self.step.pid, grace_s=2.0)     # srun passes SIGTERM to the agents, then ends the step
            self.step = None
        if self.requeued:
            LocalCluster.stop(self)                   # (not SlurmCluster's: no release of the refills)
        else:
            super().stop()


# -- stalwart slurm sbatch: submit and log out ------------------------------------------------------
def batch_script(a, spec_path: str, state_dir: str, nodes: int, sbatch: list[str], name: str) -> str:
    """The batch script of `stalwart slurm sbatch`: its #SBATCH options and `stalwart slurm run`."""
    opts = [f"--job-name={name}", f"--nodes={nodes}", "--no-kill", "--requeue", "--exclusive",
            "--open-mode=append", f"--output={state_dir}/slurm/logs/slurm-%j.out"] + sbatch
    run = [sys.executable, "-m", "stalwart.cli", "slurm", "run", "--config", spec_path, "--state-dir", state_dir,
           "--log-level", a.log_level, "--drain", a.drain, "--start-timeout", str(a.start_timeout)]
    run += [f"--srun-arg={x}" for x in a.srun_arg or []] + [f"--agent-arg={x}" for x in a.agent_arg or []]
    run += [f"--sbatch-arg={x}" for x in sbatch]              # (refills ask for nodes of the same kind)
    if a.agent_prefix:
        run += ["--agent-prefix", a.agent_prefix]
    return ("#!/bin/sh\n" + "".join(f"#SBATCH {shlex.quote(o)}\n" for o in opts) +
            "# stalwart's controller runs here, on the allocation's first node; one agent per node (generated)\n"
            "exec " + " ".join(shlex.quote(x) for x in run) + "\n")


def gpu_request(a, gpus: int) -> list[str]:
    if a.gres:
        return [f"--gres={a.gres}"]
    if a.no_gpu_request or gpus <= 0:
        return []
    return [f"--gpus-per-node={gpus}"]
