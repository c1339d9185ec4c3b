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

The command itself (its arguments, a user's mistakes, what it prints) is in `cli/slurm.py`.
"""
from __future__ import annotations

import os
import socket
import time

from stalwart.backends.local import LocalCluster
from stalwart.backends.slurm import SlurmBackend, SlurmConfig
from stalwart.transport.client import ControllerUnreachable


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
                         log_level=log_level, network="host")
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

    @staticmethod
    def alive(client) -> set[str]:
        """The machines whose agents the controller hears (none while it does not answer)."""
        try:
            return {m["id"] for m in client.get("/api/machines")["machines"] if m.get("alive")}
        except ControllerUnreachable:
            return set()

    def wait_registered(self, timeout: float) -> None:
        """Wait for every node's agent; the allocation may queue first (`timeout` counts from
        when it runs)."""
        client = self.client()
        job = self.backend.main_allocation()
        deadline = None
        while True:
            alive = self.alive(client)
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
