"""`stalwart slurm submit`: a job on Slurm nodes, with the controller on the submitting host (which
must stay up for the job's whole life: `stalwart slurm sbatch` runs it inside the allocation).

    stalwart slurm submit --nodes 4 --standby 1 --gpus-per-node 8 --partition gpu --time 24:00:00 \\
        -- python train.py

starts a controller here (listening on every address, advertised as `--advertise`, default this
host's address), asks Slurm for one `--no-kill` allocation of N + S + P nodes whose batch script
`srun`s one agent per node, waits for the agents, submits the job, follows it like `stalwart run`
and, when it ends (or on Ctrl-C), cancels the job's allocations and stops the controller. Evicted
nodes are drained with the incident as the reason; the standby pool refills with single-node
allocations; a preempted, timed-out or cancelled allocation ends the job, recorded with that reason.
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import time

from stalwart.backends.local import LocalCluster
from stalwart.backends.slurm import SlurmBackend, SlurmConfig, SlurmError
from stalwart.client import ControllerUnreachable


def default_advertise() -> str:
    """This host's address as the cluster's nodes reach it (its name's address)."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
    return addr


class SlurmCluster(LocalCluster):
    """A controller on this host (supervised and restarted like the local cluster's) and agents on
    Slurm nodes (`SlurmBackend`)."""

    listen_host = "0.0.0.0"

    def __init__(self, state_dir: str, nodes: int, gpus_per_node: int, advertise: str,
                 heartbeat_s: float = 1.0, missed_beats: int = 3, log_level: str = "INFO",
                 sbatch_args: list[str] | None = None, agent_prefix: list[str] | None = None,
                 env: dict[str, str] | None = None, agent_args: list[str] | None = None,
                 srun_args: list[str] | None = None):
        super().__init__(state_dir, nodes, gpus_per_node, heartbeat_s=heartbeat_s, missed_beats=missed_beats,
                         log_level=log_level, network="loopback")
        self.advertise = advertise
        self.cfg = SlurmConfig(state_dir=self.state_dir, tag=os.urandom(3).hex(), token_file=self.token_file,
                               gpus=gpus_per_node, heartbeat_s=heartbeat_s, log_level=log_level,
                               sbatch_args=list(sbatch_args or []), agent_prefix=list(agent_prefix or []),
                               env=dict(env or {}), agent_args=list(agent_args or []),
                               srun_args=list(srun_args or []))
        self.backend = SlurmBackend(self.cfg)
        self.names: list[str] = []
        self.on_wait = None          # called with (registered, wanted, allocation state) while waiting

    def _start_network(self) -> str:
        return self.advertise           # the nodes are Slurm's: workers reach the store here

    def controller_args(self) -> list[str]:
        self.cfg.save()
        return ["--backend", self.cfg.path, "--advertise", self.advertise]

    def agents_url(self) -> str:
        return f"http://{self.advertise}:{(self.url or '').rsplit(':', 1)[-1]}"

    def start_agents(self, controller_url: str, count: int) -> list[str]:
        self.names = self.backend.start_agents(self.agents_url(), count)
        return self.names

    def wait_registered(self, timeout: float) -> None:
        """Wait for every node's agent; the allocation may queue first (`timeout` counts from
        when it runs)."""
        client = self.client()
        job = self.backend.main_allocation()
        deadline = None
        while True:
            try:
                alive = {m["id"] for m in client.get("/api/machines")["machines"] if m.get("alive")}
            except ControllerUnreachable:
                alive = set()
            if set(self.names) <= alive:
                return
            state, reason = self.backend.allocation_state(job) if job else ("?", "")
            if self.on_wait:
                self.on_wait(len(set(self.names) & alive), len(self.names), f"{state} {reason}".strip())
            if state not in ("PENDING", "CONFIGURING", "RUNNING"):
                raise RuntimeError(f"the Slurm allocation {job} is {state} ({reason}); see "
                                   f"{self.cfg.dir}/logs/slurm-{job}.out")
            if state == "RUNNING" and deadline is None:
                deadline = time.monotonic() + timeout
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"the agents of Slurm allocation {job} did not register within "
                                   f"{timeout:.0f}s; see {self.cfg.dir}/logs/slurm-{job}.out")
            time.sleep(0.2)

    def stop(self) -> None:
        try:
            self.backend.release()
        finally:
            super().stop()


def cmd_slurm_submit(a) -> int:
    from stalwart.backends.launch import run_job
    from stalwart.cli.common import UserError, spec_from_args
    from stalwart.controller.pool import standby_count
    spec = spec_from_args(a)
    if a.spare < 0:
        raise UserError(f"--spare must be >= 0 (got {a.spare})")
    from stalwart.backends.slurm_alloc import gpu_request
    sbatch = gpu_request(a, spec.gpus_per_machine) + list(a.sbatch_arg or [])
    if a.partition:
        sbatch.append(f"--partition={a.partition}")
    if a.time:
        sbatch.append(f"--time={a.time}")
    total = spec.machines + standby_count(spec) + a.spare
    cluster = SlurmCluster(a.state_dir, total, spec.gpus_per_machine, a.advertise or default_advertise(),
                           heartbeat_s=spec.policy.heartbeat_s, missed_beats=spec.policy.missed_beats,
                           log_level=a.log_level, sbatch_args=sbatch, agent_prefix=shlex.split(a.agent_prefix or ""),
                           agent_args=list(a.agent_arg), srun_args=list(a.srun_arg))
    cluster.cfg.drain = a.drain
    if a.dry_run:
        print("# " + " ".join(shlex.quote(x) for x in cluster.backend.sbatch_argv(total, "agents.sh")))
        print(cluster.backend.batch_script(0), end="")
        return 0
    print(f"stalwart: controller here ({cluster.advertise}); asking Slurm for {total} nodes "
          f"({spec.machines} active, {standby_count(spec)} standby, {a.spare} spare)", flush=True)
    shown: list[str] = []

    def waiting(got: int, want: int, state: str) -> None:
        line = f"stalwart: {got}/{want} agents up (allocation {cluster.backend.main_allocation()} {state})"
        if not shown or shown[-1] != line:
            print(line, flush=True)
            shown.append(line)
    cluster.on_wait = waiting

    def start() -> None:
        try:
            cluster.start(timeout=a.start_timeout)
        except SlurmError as e:
            raise UserError(str(e)) from None
        print(f"stalwart: Slurm allocation {cluster.backend.main_allocation()}; machines "
              f"{', '.join(cluster.names)}", flush=True)
    return run_job(cluster, spec, start)


def add_parser(sub, job_options) -> None:
    s = sub.add_parser("slurm", help="run jobs on a Slurm cluster", conflict_handler="resolve").add_subparsers(
        dest="slurm_cmd", required=True)
    from stalwart.backends import slurm_alloc
    slurm_alloc.add_parsers(s, job_options)
    p = s.add_parser("submit", help="a job on Slurm nodes, the controller here until the job ends (slurm sbatch "
                                    "runs it in the allocation instead)")
    job_options(p)
    p.add_argument("--nodes", dest="machines", type=int, help="active nodes (the job's machines)")
    p.add_argument("--gpus-per-node", dest="gpus_per_machine", type=int,
                   help="GPUs per node: the job's, and sbatch --gpus-per-node unless --gres says otherwise")
    p.add_argument("--gres", help="sbatch --gres instead of --gpus-per-node, e.g. gpu:h100:8")
    p.add_argument("--no-gpu-request", action="store_true", help="ask Slurm for no GPUs (CPU nodes, simulated GPUs)")
    p.add_argument("--srun-arg", action="append", default=[],
                   help="one more option for the agents' srun, e.g. --srun-arg=--container-image=IMAGE (repeatable)")
    p.add_argument("--drain", choices=("auto", "never"), default="auto",
                   help="auto (default): drain an evicted node, or exclude it from refills where Slurm refuses; "
                        "never: only exclude it")
    p.add_argument("--spare", type=int, default=0, help="more idle nodes in the allocation (default 0)")
    p.add_argument("--partition", help="sbatch --partition")
    p.add_argument("--time", help="sbatch --time (the allocation's time limit)")
    p.add_argument("--sbatch-arg", action="append", help="one more sbatch option, e.g. --account=ml (repeatable)")
    p.add_argument("--agent-prefix", help="a command line the agent runs under on each node (a container "
                                          "launcher, numactl...)")
    p.add_argument("--agent-arg", action="append", default=[],
                   help="one more option for every node's agent, e.g. --nic=ib0, or --shared-host where several "
                        "Slurm nodes share one host (repeatable)")
    p.add_argument("--advertise", help="this host's address as the nodes reach it (default: its name's)")
    p.add_argument("--start-timeout", type=float, default=120.0,
                   help="seconds for the agents to register once the allocation runs (default 120)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch command and batch script, do nothing")
    p.add_argument("--state-dir", default=".stalwart")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    p.set_defaults(fn=cmd_slurm_submit)
