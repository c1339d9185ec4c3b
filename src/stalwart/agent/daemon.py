"""The agent: owns one machine. Registers, heartbeats, obeys commands, reports everything.

`Agent` builds the machine's parts and owns their lifecycle; each role is a part of its own:

- the controller session (agent/session.py): registration, heartbeats, the command loop and the
  event sender, over `agent/link.py` (one WebSocket, HTTP requests where the controller has none);
- the worker server (agent/workerserver.py): the workers' local socket, one reader per worker,
  their typed messages routed;
- the command executor (agent/executor.py): starting, warming, stopping and tracing workers;
- exit reports (agent/exits.py), probes (agent/monitor.py), progress (agent/progress.py), metrics,
  checkpoints (agent/ckpt.py), chaos (agent/armed.py, chaos/machine.py), the successor's hand-over
  (agent/succession.py).

Threads: heartbeat, commands, events (the session), the socket server and one reader per worker,
and one exit watcher per worker. The agent makes no job-level decision; it reports and obeys, and
it re-registers when the controller comes back.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading

from stalwart import protocol as p
from stalwart.agent.adopt import AdoptedProcess
from stalwart.agent.armed import ChaosCommands
from stalwart.agent.ckpt import ANNOUNCE_EVERY_S, CkptManager
from stalwart.agent.diagnose import Diagnoser
from stalwart.agent.executor import CommandExecutor
from stalwart.agent.exits import ExitReports
from stalwart.agent.forkclient import ForkServers
from stalwart.agent.link import Link
from stalwart.agent.metrics import MetricsSampler
from stalwart.agent.monitor import Monitor
from stalwart.agent.paths import claim
from stalwart.agent.probes.gpu import make_gpu_source
from stalwart.agent.probeset import machine_probes
from stalwart.agent.progress import ProgressWatch, hook_dir
from stalwart.agent.tcpstats import TcpSampler
from stalwart.agent.runstate import RunState
from stalwart.agent.session import ControllerSession
from stalwart.agent.succession import Succession
from stalwart.agent.workdir import hold
from stalwart.agent.workerenv import WorkerEnv
from stalwart.agent.workers import WorkerSet, warm_nice
from stalwart.agent.workerserver import WorkerRoutes, WorkerServer
from stalwart.chaos.machine import MachineChaos
from stalwart.devices.netns import Machine
from stalwart.devices.simgpu import SimGpu
from stalwart.transport.client import Client

log = logging.getLogger("stalwart.agent")


class Agent:
    def __init__(self, client: Client, machine_id: str, workdir: str, address: str = "127.0.0.1",
                 gpus: int = 1, heartbeat_s: float = 1.0, network_file: str | None = None,
                 kmsg: str | None = None, min_free_bytes: int = 64 << 20, keep_warm: bool = True,
                 controller_file: str | None = None, labels: dict[str, str] | None = None,
                 nic: list[str] | None = None, shared_host: bool = False, controllers: list[str] | None = None):
        """`kmsg`: the host kernel log to follow (None: /dev/kmsg when readable; "off"); `nic`: the
        interfaces to watch (None: the default route's and every RDMA port); `shared_host`: other
        agents share this host (host-wide probes off; see agent/probeset.py). A probe option that
        cannot work here raises probeset.ProbeSetupError; a work directory another live agent
        holds raises workdir.WorkdirInUse (before anything in it is touched). `controllers`: the
        URLs of an active controller and its standbys (the agent follows whichever answers)."""
        self._workdir_lock = hold(os.path.abspath(workdir), machine_id)
        self.machine_id = machine_id
        self.workdir = os.path.abspath(workdir)
        self.address = address
        self.gpus = gpus
        self.labels = dict(labels or {})        # topology labels (switch, pod...) the controller reads
        self.keep_warm = keep_warm
        self._stop = threading.Event()
        self.state = RunState()
        # the line to the controller (its address and credentials: token, CA): a channel, or HTTP
        self.session = ControllerSession(Link(client, machine_id, urls=controllers), machine_id, self.registration,
                                         lambda: self.workers.pids(), lambda: len(self.workers.workers),
                                         self._stop, heartbeat_s, controller_file, self._heartbeat_changed)
        self.emit = self.session.emit
        os.makedirs(self.workdir, exist_ok=True)
        self.simgpu_path = os.path.join(self.workdir, "simgpu.json")
        self.server = WorkerServer(os.path.join(self.workdir, "agent.sock"), self._stop)
        # the machine's fork server: workers, spares and standbys forked from one process that
        # imported torch once (agent/forkclient.py); started with the first run's workers. It
        # outlives this agent while its workers run, for a restarted agent to adopt them
        # (agent/adopt.py), noting their exits in `exits_dir`.
        self.exits_dir = os.path.join(self.workdir, "logs", "exits")
        self.forks = ForkServers(os.path.join(self.workdir, "logs"), hide_paths=(hook_dir(),),
                                 exits_dir=self.exits_dir)
        self.workers = WorkerSet(os.path.join(self.workdir, "logs"), lambda w: self.exits.exited(w), self.forks)
        # Warm workers: torch imported, the user's module loaded, blocked at the activation barrier.
        # A standby machine holds them for its first run; every machine keeps spares for the next
        # restart (keep_warm), so a restart never waits for `import torch`.
        self.warm = WorkerSet(os.path.join(self.workdir, "logs"), lambda w: self.exits.exited(w), self.forks)
        self.network = self._load_network(network_file)
        self.netns = None
        if self.network:
            self.netns = Machine(**self.network["self"])
            self.address = self.netns.address
        self.kmsg_path = os.path.join(self.workdir, "kmsg.log")
        self.disk_override = os.path.join(self.workdir, "disk_free_override")
        for stale in (self.disk_override,):
            if os.path.exists(stale):
                os.unlink(stale)
        if os.path.exists(self.simgpu_path):
            os.unlink(self.simgpu_path)       # a fresh machine has healthy GPUs
        SimGpu(self.simgpu_path, self.gpus)
        probes = machine_probes(self.workdir, self.simgpu_path, gpus, self.kmsg_path, self.disk_override,
                                min_free_bytes, nic=nic, kmsg=kmsg, shared_host=shared_host,
                                netns_ifname=self.netns.host_ifname if self.netns is not None else None)
        self.monitor = Monitor(probes, self.emit, certain_kinds=frozenset({"disk_full"}))
        self.progress = ProgressWatch(os.path.join(self.workdir, "fr"), lambda: list(self.workers.workers),
                                      self.server.has_link, lambda: dict(self.state.last_step),
                                      lambda: self.state.run, self.emit, period_s=heartbeat_s, tcp=TcpSampler())
        self.exits = ExitReports(lambda: self.workers.workers, self.monitor.sweep, self.progress.script_events,
                                 self.emit)
        # peers fetch backups at this machine's address (a local namespace machine's agent stays
        # in the root namespace: loopback there)
        self.ckpt = CkptManager(machine_id, claim(self.workdir), self.emit,
                                peer_host=self.address if self.netns is None else "127.0.0.1",
                                announce_every_s=ANNOUNCE_EVERY_S)
        self.metrics = MetricsSampler(self.workers.all_pids, make_gpu_source(self.simgpu_path, gpus).read,
                                      self.netns.host_ifname if self.netns is not None else None,
                                      self.emit, period_s=heartbeat_s)
        self.env = WorkerEnv(machine_id, self.server.path, self.simgpu_path, self.ckpt.shm_dir,
                             self.progress.fr_dir, self.netns, lambda: self.session.heartbeat_s,
                             lambda: self.session.relink_s, gpus=gpus)
        self.diagnoser = Diagnoser(machine_id, self.workdir, self.simgpu_path, self.env.base,
                                   self.env.prefix, self.emit, self.forks)
        self.chaos = MachineChaos(machine_id, self.workdir, self.simgpu_path, gpus, self.kmsg_path,
                                  self.disk_override, self.network, self.workers, self._send_to_rank)
        self.succession = Succession(self.workdir, machine_id, self.exits_dir, self.forks, self.workers,
                                     self.ckpt, self.emit)
        self.chaos_cmds = ChaosCommands(self.chaos.apply, self.emit, lambda: self.state.last_step,
                                        lambda: [pid for pid in self.workers.pids() + self.warm.pids()
                                                 + [self.diagnoser.warm_pid() or 0] if pid])
        self.executor = CommandExecutor(machine_id, self.state, self.workers, self.warm, self.forks, self.server,
                                        self.env, self.ckpt, self.progress, self.chaos, self.chaos_cmds,
                                        self.diagnoser, self.emit, self.session.reset_pace, self._save_state,
                                        self.shutdown, keep_warm=keep_warm)

    @property
    def registered(self) -> threading.Event:
        return self.session.registered

    def _load_network(self, path: str | None) -> dict | None:
        if not path:
            return None
        with open(path) as f:
            net = json.load(f)
        return {"self": net["machines"][self.machine_id], "machines": net["machines"]}

    def _heartbeat_changed(self, heartbeat_s: float) -> None:
        self.progress.period_s = heartbeat_s

    # -- the workers' messages: where each kind goes -----------------------------------------------
    def _routes(self) -> WorkerRoutes:
        def step(msg: p.Step) -> None:
            self.state.last_step[msg.rank] = msg.step
            self.chaos_cmds.on_step()

        def forward(msg: p.Forwarded) -> None:
            msg.run = self.state.run
            self.emit(msg)

        return WorkerRoutes(linked=self._linked, standby_ready=lambda pid: self.executor.report_spares(),
                            failing=self.exits.failing,
                            shard=lambda msg: self.ckpt.on_shard(msg.rank, msg.step, msg.path),
                            step=step, forward=forward)

    def _linked(self, pid: int) -> None:
        w = next((w for w in self.workers.workers if w.proc.pid == pid), None)
        if w is not None and isinstance(w.proc, AdoptedProcess):
            log.info("rank %s (pid %d) linked again", w.rank, pid)

    def _send_to_rank(self, rank: int, msg: p.ToWorker) -> None:
        w = self.workers.by_rank(rank)
        if w is None or not self.server.send(w.proc.pid, msg):
            kind = getattr(msg, "kind", type(msg).__name__)
            raise RuntimeError(f"rank {rank} has no SDK link; {kind} needs the worker SDK")

    # -- lifecycle -----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self._adopt()                   # (first: an adopted worker's link may come back at once)
        self.server.start(self._routes())
        if self.keep_warm and not warm_nice():
            log.info("not root: warm workers wait at normal priority (giving an activated one its "
                     "priority back needs root)")
        self.monitor.start()
        self.metrics.start()
        self.progress.start()
        self.session.start(self.executor)
        self._stop.wait()
        self.monitor.stop()
        self.metrics.stop()
        self.progress.stop()
        self.chaos.cleanup()
        self.workers.stop()
        self.warm.stop()
        self.server.close()
        self.forks.close()
        self.diagnoser.stop()
        self.ckpt.close()
        self.session.link.close()
        self._save_state()
        shutil.rmtree(self.ckpt.root, ignore_errors=True)

    def shutdown(self) -> None:
        self._stop.set()

    # -- a restart: the workers an earlier agent left (agent/succession.py) ----------------------
    def _save_state(self) -> None:
        self.succession.save(self.state.job, self.state.run, self.state.start)

    def _adopt(self) -> None:
        """Before the first registration (it reports an adopted run)."""
        taken = self.succession.take_over()
        if taken is not None:
            self.state.job, self.state.run, self.state.start = taken.job, taken.run, taken.start
            if taken.start is not None:
                self.executor.adopted(taken.start)     # the spares died with the predecessor
        self._save_state()

    def registration(self) -> p.Registration:
        """Who this agent is and what it runs now (a restarted controller adopts a live run)."""
        ranks = {w.rank: w.proc.pid for w in self.workers.workers
                 if w.rank is not None and w.proc.poll() is None}
        # a run may end while the controller is away: its workers' clean exits say so (their
        # steps and `done` follow from the outbox)
        done = sorted(w.rank for w in self.workers.workers
                      if w.rank is not None and w.run == self.state.run and w.proc.poll() == 0)
        warm_pids = set(self.warm.pids())
        warm = len([pid for pid in self.server.standbys() if pid in warm_pids])
        return p.Registration(address=self.address, gpus=self.gpus, hostname=socket.gethostname(),
                              pid=os.getpid(), workdir=self.workdir, peer=self.ckpt.peer_addr,
                              running_run=self.state.run if ranks or done else None, job=self.state.job,
                              ranks=ranks, done_ranks=done,
                              last_step={r: s for r, s in self.state.last_step.items() if r in ranks},
                              inventory=self.ckpt.inventory(), warm=warm, labels=self.labels,
                              isolated=self.netns is not None)
