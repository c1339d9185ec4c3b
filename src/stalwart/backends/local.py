"""The embedded default backend: a controller and one agent per machine, all on this host.

Machines are named m0 … m{N+S-1} (the N active ones first, then the S standbys), with synthetic
topology labels (`synthetic_labels`: a switch per 4 machines, a pod per 16). The cluster
watches the controller it started and restarts it on the same database when it dies (on the same
port when it can; agents re-read `controller.json` when the address changes), so a killed
controller costs seconds, never the job.

The machines share the host's network by default (`network="host"`): a job run as root reaches
what it reaches without stalwart (DNS, a dataset server, an experiment tracker). Isolated
(`network="isolated"`, `stalwart run --isolate-network`, root only), each machine's workers live
in their own network namespace with their own address on a bridge (the agent stays in the root
namespace, like a management network), so NIC faults, slow links and partitions are real; the
namespaces have no DNS and no route out. `network="auto"` isolates where it can (root, `ip`).
Network chaos on machines that share the host's network is refused with the reason. Every process is
started in its own session and recorded in `<state_dir>/pids.json`, so `stalwart cleanup` (and the
next start) can remove what a crashed `stalwart run` left behind.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from stalwart.agent.adopt import leftovers
from stalwart.agent.paths import ckpt_root
from stalwart.agent.workers import die_with_parent, kill_tree
from stalwart.backends.base import Backend
from stalwart.backends.statedir import db_url as statedir_db_url
from stalwart.devices import netns
from stalwart.errors import StalwartError
from stalwart.security import auth, identity
from stalwart.transport.client import Client, ControllerUnreachable

log = logging.getLogger("stalwart.local")


# Synthetic topology labels (`placement`): a leaf switch per 4 machines (8-GPU machines with one NIC
# per GPU fill a 32-port leaf with 4 machines) and a pod per 4 switches (16 machines).
MACHINES_PER_SWITCH = 4
SWITCHES_PER_POD = 4


def synthetic_labels(index: int) -> dict[str, str]:
    """The labels of local machine m{index}: switch=s{index // 4}, pod=p{index // 16}."""
    switch = index // MACHINES_PER_SWITCH
    return {"switch": f"s{switch}", "pod": f"p{switch // SWITCHES_PER_POD}"}


def _python() -> list[str]:
    return [sys.executable, "-m", "stalwart.cli"]


NETWORK_MODES = ("host", "isolated", "auto")


class NetworkUnavailable(StalwartError, RuntimeError):
    """Isolated machines were asked for where network namespaces cannot be made (not root, no `ip`)."""


def require_isolation() -> None:
    """Raise `NetworkUnavailable`, saying why, where isolated machines cannot be made."""
    ok, why = netns.available()
    if not ok:
        raise NetworkUnavailable(f"--isolate-network: machines with their own network are unavailable here: {why}")


class LocalCluster(Backend):
    """The local backend: a fixed set of machines on this host, started with the cluster (N
    active, S standby, P spare): `request` has none to add, the pool refills from the spares, and
    an evicted machine stays up (its role keeps it out; its logs and state stay for a look)."""

    kind = "local"
    listen_host = "127.0.0.1"        # where the controller listens (a Slurm cluster's: every address)

    def __init__(self, state_dir: str, machines: int, gpus_per_machine: int,
                 heartbeat_s: float = 1.0, missed_beats: int = 3, db_url: str | None = None,
                 log_level: str = "INFO", network: str = "host", controller_chaos: bool = False):
        if network not in NETWORK_MODES:
            raise ValueError(f"network must be one of {', '.join(NETWORK_MODES)} (got {network!r})")
        self.state_dir = os.path.abspath(state_dir)
        self.n = machines
        self.gpus = gpus_per_machine
        self.heartbeat_s = heartbeat_s
        self.missed_beats = missed_beats
        self.db_url = db_url or statedir_db_url(self.state_dir)
        self.log_level = log_level
        self.controller: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}
        self.url: str | None = None
        self.token: str | None = None
        self.network_mode = network
        self.controller_chaos = controller_chaos      # the controller kills itself on cue (chaos/controller.py)
        self.net = None                    # devices.netns.Network when machines have their own network
        self.network_file: str | None = None
        self._netns_machines: dict[str, dict] = {}      # machine -> its namespace (network.json)
        self.store_host = "127.0.0.1"
        self.controller_restarts = 0
        self.on_controller_restart: Callable[[str], None] | None = None   # told what happened
        self._stopping = threading.Event()
        self._ctl_lock = threading.Lock()

    @property
    def controller_file(self) -> str:
        return os.path.join(self.state_dir, "controller.json")

    @property
    def token_file(self) -> str:
        return os.path.join(self.state_dir, auth.TOKEN_FILE)

    def client(self, timeout: float = 10.0) -> Client:
        """A client of this cluster's controller, with its token."""
        if self.url is None:
            raise RuntimeError("the cluster is not started")
        return Client(self.url, timeout=timeout, token=self.token)

    # -- processes ------------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        os.makedirs(os.path.join(self.state_dir, "logs"), exist_ok=True)
        with open(os.path.join(self.state_dir, "logs", log_name), "ab") as out:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            # die with whoever started the cluster (a killed `stalwart run` or test leaves nothing)
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=env, preexec_fn=die_with_parent)
        self._record_pids(p.pid)
        return p

    def _record_pids(self, new_pid: int) -> None:
        pids = ([self.controller.pid] if self.controller else []) + [p.pid for p in self.agents.values()]
        pids.append(new_pid)
        with open(os.path.join(self.state_dir, "pids.json"), "w") as f:
            json.dump(pids, f)

    def start(self, timeout: float = 60.0) -> str:
        os.makedirs(self.state_dir, exist_ok=True)
        cleanup_stale(self.state_dir)
        # the API's token: the controller reads the same file (its state dir's), agents get its path
        self.token = auth.create_token_file(self.token_file)
        self.store_host = self._start_network()
        self._stopping.clear()
        # a fresh cluster: jobs an earlier one left in this state dir cannot be resumed
        self._start_controller(f"{self.listen_host}:0", timeout, extra=["--abandon-running"])
        self.start_agents(self.url, self.n)
        self.wait_registered(timeout)
        threading.Thread(target=self._supervise, name="controller-supervisor", daemon=True).start()
        return self.url

    def _start_controller(self, listen: str, timeout: float, extra: list[str] = ()) -> None:
        port_file = os.path.join(self.state_dir, "controller.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        proc = self._spawn(
            _python() + ["controller", "--db", self.db_url, "--listen", listen,
                         "--state-dir", self.state_dir, "--port-file", port_file, "--store-host", self.store_host,
                         "--heartbeat", str(self.heartbeat_s), "--missed-beats", str(self.missed_beats),
                         "--log-level", self.log_level] + self.controller_args() + list(extra)
            + (["--chaos-self-kill"] if self.controller_chaos else []), "controller.log")
        self.controller = proc
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file):
            if proc.poll() is not None:
                raise RuntimeError(f"the controller exited at start (code {proc.returncode});"
                                   f" see {self.state_dir}/logs/controller.log")
            if time.monotonic() > deadline:
                raise RuntimeError("the controller did not start within %.0fs" % timeout)
            time.sleep(0.05)
        with open(port_file) as f:       # (the controller wrote controller.json before it)
            self.url = f"http://127.0.0.1:{int(f.read().strip())}"

    def _supervise(self) -> None:
        """Restart the controller when it dies (not when we stop it): same database, same port
        when it is free, else a new one that the agents find in controller.json."""
        while not self._stopping.wait(0.2):
            with self._ctl_lock:
                proc = self.controller
                if proc is None or proc.poll() is None or self._stopping.is_set():
                    continue
                code, t0 = proc.returncode, time.monotonic()
                port = (self.url or "").rsplit(":", 1)[-1]
                try:
                    try:
                        self._start_controller(f"{self.listen_host}:{port}", 60.0)
                    except RuntimeError:          # the port was taken meanwhile
                        self._start_controller(f"{self.listen_host}:0", 60.0)
                except RuntimeError as e:
                    log.error("could not restart the controller: %s", e)
                    if self.on_controller_restart:
                        self.on_controller_restart(f"the controller died (code {code}) and could not be "
                                                   f"restarted: {e}")
                    return
                self.controller_restarts += 1
                why = f"signal {-code}" if code < 0 else f"exit code {code}"
                msg = (f"the controller died ({why}); restarted in {time.monotonic() - t0:.1f}s at "
                       f"{self.url} (pid {self.controller.pid})")
                log.warning(msg)
                if self.on_controller_restart:
                    self.on_controller_restart(msg)

    def _start_network(self) -> str:
        """Create the machines' namespaces when wanted and possible; returns the store host."""
        if self.network_mode == "host":
            return "127.0.0.1"
        if self.network_mode == "isolated":
            require_isolation()
        elif not netns.available()[0]:
            return "127.0.0.1"
        prefix = "sw" + os.urandom(3).hex()
        self.net = netns.Network(prefix, state_dir=os.path.join(self.state_dir, "netns"))
        self.net.create()
        self.network_file = os.path.join(self.state_dir, "network.json")
        for i in range(self.n):
            self._add_namespace(i)
        return self.net.gateway

    def _add_namespace(self, i: int) -> None:
        """Machine `i`'s namespace, recorded in the network file its agent reads at start."""
        assert self.net is not None and self.network_file is not None
        m = self.net.add_machine(i)
        self._netns_machines[f"m{i}"] = {k: getattr(m, k) for k in ("name", "index", "ns", "ifname",
                                                                      "host_ifname", "address", "gateway",
                                                                      "prefix")}
        tmp = self.network_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"prefix": self.net.prefix, "gateway": self.net.gateway, "machines": self._netns_machines}, f)
        os.replace(tmp, self.network_file)

    # -- machines coming and going while the cluster runs ----------------------------------------
    def add_machine(self, timeout: float = 60.0) -> str:
        """One more machine (the next free name), registered idle: what a cluster's provisioning
        hands back (a repaired or a new host); a running job's standby pool refills from it."""
        with self._ctl_lock:
            i, self.n = self.n, self.n + 1
            machine = f"m{i}"
            if self.net is not None:
                self._add_namespace(i)
            self.start_agent(machine)
        self.wait_registered(timeout)
        return machine

    def retire_machine(self, machine: str) -> None:
        """Stop a machine's agent and workers and remove its namespace (an evicted machine handed
        back to the cluster); the controller calls it lost if a job still held it."""
        with self._ctl_lock:
            proc = self.agents.pop(machine, None)
        if proc is not None:
            kill_tree(proc.pid)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.net is not None and machine in self._netns_machines:
            self.net.remove_machine(int(self._netns_machines.pop(machine)["index"]))

    def controller_args(self) -> list[str]:
        """More options for the controller (a backend's config)."""
        return []

    # -- the backend interface ----------------------------------------------------------------------
    def start_agents(self, controller_url: str, count: int) -> list[str]:
        names = [f"m{len(self.agents) + i}" for i in range(count)]
        for m in names:
            self.start_agent(m)
        return names

    def evict(self, machine: str, reason: str, labels: dict[str, str]) -> None:
        """Nothing to tell: the controller's role keeps an evicted local machine out."""

    def request(self, count: int) -> list[str]:
        return []           # a fixed cluster: its standby pool refills from its --spare machines

    def release(self) -> None:
        self.stop()

    def restart_agent(self, machine: str) -> subprocess.Popen:
        """Kill a machine's agent process alone (SIGKILL: a crash; its workers go on) and start
        it again on the same work directory, as a supervisor would: it adopts the workers it
        finds there (agent/adopt.py). Returns the new agent's process."""
        with self._ctl_lock:
            old = self.agents[machine]
            if old.poll() is None:
                os.kill(old.pid, signal.SIGKILL)
                old.wait(timeout=10)
            self.start_agent(machine, fresh=False)
            return self.agents[machine]

    def start_agent(self, machine: str, fresh: bool = True) -> None:
        """Start `machine`'s agent (`fresh`: a new machine; else its agent restarts and keeps
        what its work directory and memory hold)."""
        # a machine that starts here is new: memory at its path is a killed earlier cluster's
        # (same state dir path), never this machine's checkpoints
        if fresh:
            shutil.rmtree(ckpt_root(os.path.join(self.state_dir, "machines", machine)), ignore_errors=True)
        extra = ["--network-file", self.network_file] if self.network_file else []
        if machine[1:].isdigit():
            for key, value in synthetic_labels(int(machine[1:])).items():
                extra += ["--label", f"{key}={value}"]
        # each agent enrolls with a join token made for its machine (its credential then speaks
        # for that machine alone; the operator's token stays with the operator)
        workdir = os.path.join(self.state_dir, "machines", machine)
        os.makedirs(workdir, exist_ok=True)
        join_file = os.path.join(workdir, "join.token")
        fd = os.open(join_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(identity.join_token(auth.controller_secret(self.state_dir), machine) + "\n")
        self.agents[machine] = self._spawn(
            _python() + ["agent", "--controller", self.url, "--machine-id", machine,
                         "--join-token-file", join_file,
                         "--controller-file", self.controller_file] + extra + [
                         "--workdir", workdir,
                         "--gpus-per-machine", str(self.gpus), "--heartbeat", str(self.heartbeat_s), "--shared-host",
                         "--log-level", self.log_level], f"agent-{machine}.log")

    def wait_registered(self, timeout: float) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                alive = {m["id"] for m in client.get("/api/machines")["machines"] if m.get("alive")}
            except ControllerUnreachable:
                alive = set()
            if set(self.agents) <= alive:
                return
            time.sleep(0.1)
        raise RuntimeError(f"machines did not register within {timeout:.0f}s; see "
                           f"{self.state_dir}/logs/agent-*.log")

    def stop(self) -> None:
        """Stop every process this cluster started (agents with their workers, then the controller)."""
        self._stopping.set()
        for p in list(self.agents.values()):
            kill_tree(p.pid)
        # a restarted agent's adopted workers are not its children (nor are their fork servers)
        kill_leftovers(self.state_dir)
        with self._ctl_lock:
            if self.controller is not None:
                kill_tree(self.controller.pid, grace_s=3.0)
        for p in list(self.agents.values()) + ([self.controller] if self.controller else []):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.agents.clear()
        self.controller = None
        pid_file = os.path.join(self.state_dir, "pids.json")
        if os.path.exists(pid_file):
            os.unlink(pid_file)
        if self.net is not None:
            self.net.destroy()
            self.net = None
        remove_machine_memory(self.state_dir)

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def remove_machine_memory(state_dir: str) -> None:
    """Free the shared memory (checkpoint shards) of every machine of this state dir: agents that
    were killed (machine-down, a stopped cluster) never free their own."""
    machines = os.path.join(state_dir, "machines")
    for m in os.listdir(machines) if os.path.isdir(machines) else []:
        shutil.rmtree(ckpt_root(os.path.join(machines, m)), ignore_errors=True)


def kill_leftovers(state_dir: str) -> list[int]:
    """Kill what the machines' agents left running (agent/adopt.py: workers an agent killed alone
    left to a successor, and the fork servers keeping them); their pids."""
    killed = []
    machines = os.path.join(state_dir, "machines")
    for m in os.listdir(machines) if os.path.isdir(machines) else []:
        for pid in leftovers(os.path.join(machines, m)):
            kill_tree(pid)
            killed.append(pid)
    return killed


def cleanup_stale(state_dir: str) -> list[int]:
    """Kill processes a crashed `stalwart run` left behind (recorded in pids.json), and remove
    the network namespaces, links and nft tables it created."""
    pid_file = os.path.join(state_dir, "pids.json")
    killed = []
    netns_dir = os.path.join(state_dir, "netns")
    if os.path.isdir(netns_dir):
        netns.cleanup_stale(Path(netns_dir))
    if not os.path.exists(pid_file):
        return killed
    try:
        with open(pid_file) as f:
            pids = json.load(f)
    except (OSError, ValueError):
        pids = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if "stalwart" in " ".join(p.cmdline()):
                kill_tree(pid)
                killed.append(pid)
        except psutil.Error:
            pass
    # workers that outlived their killed agents (and the fork servers that keep them)
    killed += kill_leftovers(state_dir)
    os.unlink(pid_file)
    remove_machine_memory(state_dir)
    return killed
