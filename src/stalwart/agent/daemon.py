"""The agent: owns one machine. Registers, heartbeats, obeys commands, reports everything.

Threads: heartbeat (every `heartbeat_s`), commands (pushed over the agent's channel, else a long
poll), event sender, the local socket server for the workers (one reader per worker), and one exit
watcher per worker; the line to the controller is `agent/link.py` (one WebSocket, HTTP requests
where the controller has none). The agent makes no job-level decision; it reports and obeys, and
it re-registers when the controller comes back.
"""
from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time

import msgspec

from stalwart import protocol as p
from stalwart.agent.ckpt import ANNOUNCE_EVERY_S, CkptManager
from stalwart.agent.link import Link
from stalwart.agent.paths import claim
from stalwart.agent.diagnose import Diagnoser
from stalwart.agent.metrics import MetricsSampler
from stalwart.agent.monitor import Monitor
from stalwart.agent.outbox import EVENT_LINGER_S, STEP_GATHER_S, STEP_PACE_S, Outbox, retry_delay
from stalwart.agent.armed import ChaosCommands
from stalwart.agent.probes.gpu import make_gpu_source
from stalwart.agent.probeset import machine_probes
from stalwart.agent.forkclient import ForkServers
from stalwart.agent.progress import ProgressWatch, hook_dir, hook_env
from stalwart.agent.tracer import trace_workers
from stalwart.agent.workdir import hold
from stalwart.agent.adopt import AdoptedProcess
from stalwart.agent.succession import Succession
from stalwart.agent.workers import Worker, WorkerSet, renice, take_run_names, warm_nice
from stalwart.chaos.machine import MachineChaos
from stalwart.transport.client import ApiError, Client, ControllerUnreachable
from stalwart.devices.netns import Machine
from stalwart.devices.simgpu import SimGpu
from stalwart.transport.jsonlines import JsonLineSocket

log = logging.getLogger("stalwart.agent")
PLAIN_REFILL_AFTER_S = 60.0     # a run without step reports gets its spares this long after its start

FORWARDED = {"step", "ckpt", "restored", "done", "hello", "standby_ready"}
SKIP_BEATS_FROM = 3    # missed beats the controller allows before an agent's batches stand in for beats


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
        # the line to the controller (its address and credentials: token, CA): a channel, or HTTP
        self.link = Link(client, machine_id, urls=controllers)
        # where the controller's address is published (a restarted controller may get a new port)
        self.controller_file = controller_file
        self.machine_id = machine_id
        self.workdir = os.path.abspath(workdir)
        self.address = address
        self.gpus = gpus
        self.labels = dict(labels or {})        # topology labels (switch, pod...) the controller reads
        self.heartbeat_s = heartbeat_s
        self.keep_warm = keep_warm
        os.makedirs(self.workdir, exist_ok=True)
        self.sock_path = os.path.join(self.workdir, "agent.sock")
        self.simgpu_path = os.path.join(self.workdir, "simgpu.json")
        # the machine's fork server: workers, spares and standbys forked from one process that
        # imported torch once (agent/forkclient.py); started with the first run's workers. It
        # outlives this agent while its workers run, for a restarted agent to adopt them
        # (agent/adopt.py), noting their exits in `exits_dir`.
        self.exits_dir = os.path.join(self.workdir, "logs", "exits")
        self.forks = ForkServers(os.path.join(self.workdir, "logs"), hide_paths=(hook_dir(),),
                                 exits_dir=self.exits_dir)
        self.workers = WorkerSet(os.path.join(self.workdir, "logs"), self._on_worker_exit, self.forks)
        # Warm workers: torch imported, the user's module loaded, blocked at the activation barrier.
        # A standby machine holds them for its first run; every machine keeps spares for the next
        # restart (keep_warm), so a restart never waits for `import torch`.
        self.warm = WorkerSet(os.path.join(self.workdir, "logs"), self._on_worker_exit, self.forks)
        self._warm_key: tuple | None = None
        self._refill_at: tuple[float, p.Start] | None = None   # when to top up the spares, for which run
        self._spares_for: str | None = None     # `spares` asked: report when those are all ready
        self._events = Outbox()
        self._last_step: dict[int, int] = {}    # rank -> the last step its SDK reported
        self._stop = threading.Event()
        self._failures = 0          # failed attempts to reach the controller in a row
        self._delivered_at = float("-inf")   # when the controller last took a batch of events
        self._skip_beats = False
        self._merge_steps = False
        self._conns: dict[int, JsonLineSocket] = {}      # worker pid -> connection
        self._standby_ready: list[int] = []              # pids of warm workers at the barrier
        self._lock = threading.Lock()
        self._run: int | None = None
        self._job: int | None = None
        self._start_cmd: p.Start | None = None  # the run's command (kept for a successor)
        self._missed_beats = 3                  # the controller's limit, in beats (from its reply)
        self.registered = threading.Event()
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
                                      self._has_sdk, lambda: dict(self._last_step), lambda: self._run,
                                      self.emit, period_s=heartbeat_s)
        # peers fetch backups at this machine's address (a local namespace machine's agent stays
        # in the root namespace: loopback there)
        self.ckpt = CkptManager(machine_id, claim(self.workdir), self.emit,
                                peer_host=self.address if self.netns is None else "127.0.0.1",
                                announce_every_s=ANNOUNCE_EVERY_S)
        self.metrics = MetricsSampler(self.workers.all_pids, make_gpu_source(self.simgpu_path, gpus).read,
                                      self.netns.host_ifname if self.netns is not None else None,
                                      self.emit, period_s=heartbeat_s)
        self.diagnoser = Diagnoser(machine_id, self.workdir, self.simgpu_path, self._base_env,
                                   self._prefix, self.emit, self.forks)
        self.chaos = MachineChaos(machine_id, self.workdir, self.simgpu_path, gpus, self.kmsg_path,
                                  self.disk_override, self.network, self.workers, self._send_to_rank)
        self.succession = Succession(self.workdir, machine_id, self.exits_dir, self.forks, self.workers,
                                     self.ckpt, self.emit)
        self.chaos_cmds = ChaosCommands(self.chaos.apply, self.emit, lambda: self._last_step,
                                        lambda: [pid for pid in self.workers.pids() + self.warm.pids()
                                                 + [self.diagnoser.warm_pid() or 0] if pid])

    def _load_network(self, path: str | None) -> dict | None:
        if not path:
            return None
        with open(path) as f:
            net = json.load(f)
        return {"self": net["machines"][self.machine_id], "machines": net["machines"]}

    def _has_sdk(self, pid: int) -> bool:
        with self._lock:
            return pid in self._conns

    def _refill_due(self) -> bool:
        """Spares are started once the run is through its start-up: as soon as a rank here
        reported a step (a script without the SDK reports none: a minute after the run began).
        Never for a run whose step hook reported (a plain script: it has no activation barrier, so
        a spare of it cannot wait for its ranks)."""
        if self._refill_at is None:
            return False
        if self._run is not None and self.progress.script_run == self._run:
            self._refill_at = None
            return False
        return bool(self._last_step) or time.time() - self._refill_at[0] >= PLAIN_REFILL_AFTER_S

    def _send_to_rank(self, rank: int, msg: dict) -> None:
        w = self.workers.by_rank(rank)
        with self._lock:
            conn = self._conns.get(w.proc.pid) if w else None
        if conn is None:
            raise RuntimeError(f"rank {rank} has no SDK link; {msg.get('kind')} needs the worker SDK")
        conn.send(msg)

    # -- lifecycle -----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self._adopt()                   # (first: an adopted worker's link may come back at once)
        self._start_socket_server()
        if self.keep_warm and not warm_nice():
            log.info("not root: warm workers wait at normal priority (giving an activated one its "
                     "priority back needs root)")
        self.monitor.start()
        self.metrics.start()
        self.progress.start()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._command_loop, "commands"),
                             (self._sender_loop, "events")):
            threading.Thread(target=target, name=name, daemon=True).start()
        self._stop.wait()
        self.monitor.stop()
        self.metrics.stop()
        self.progress.stop()
        self.chaos.cleanup()
        self.workers.stop()
        self.warm.stop()
        self.forks.close()
        self.diagnoser.stop()
        self.ckpt.close()
        self.link.close()
        self._save_state()
        import shutil
        shutil.rmtree(self.ckpt.root, ignore_errors=True)

    def shutdown(self) -> None:
        self._stop.set()

    # -- a restart: the workers an earlier agent left (agent/succession.py) ----------------------
    def _save_state(self) -> None:
        self.succession.save(self._job, self._run, self._start_cmd)

    def _adopt(self) -> None:
        """Before the first registration (it reports an adopted run)."""
        taken = self.succession.take_over()
        if taken is not None:
            self._job, self._run, self._start_cmd = taken.job, taken.run, taken.start
            cmd = taken.start
            if cmd is not None and self.keep_warm and cmd.spec.spares and not cmd.spec.replay:
                self._refill_at = (time.time(), cmd)     # the spares died with the predecessor
        self._save_state()

    def registration(self) -> p.Registration:
        """Who this agent is and what it runs now (a restarted controller adopts a live run)."""
        ranks = {w.rank: w.proc.pid for w in self.workers.workers
                 if w.rank is not None and w.proc.poll() is None}
        # a run may end while the controller is away: its workers' clean exits say so (their
        # steps and `done` follow from the outbox)
        done = sorted(w.rank for w in self.workers.workers
                      if w.rank is not None and w.run == self._run and w.proc.poll() == 0)
        with self._lock:
            warm = len([pid for pid in self._standby_ready if pid in set(self.warm.pids())])
        return p.Registration(address=self.address, gpus=self.gpus, hostname=socket.gethostname(),
                              pid=os.getpid(), workdir=self.workdir, peer=tuple(self.ckpt.peer_addr),
                              running_run=self._run if ranks or done else None, job=self._job, ranks=ranks,
                              done_ranks=done,
                              last_step={r: s for r, s in self._last_step.items() if r in ranks},
                              inventory=self.ckpt.inventory(), warm=warm, labels=self.labels,
                              isolated=self.netns is not None)

    def _register(self) -> None:
        reply = self.link.register(p.encode(self.registration()))
        self.heartbeat_s = float(reply.get("heartbeat_s", self.heartbeat_s))
        self.progress.period_s = self.heartbeat_s
        # beats may ride on events when the controller allows 3 missed beats or more (a
        # controller that does not say so gets every heartbeat)
        self._skip_beats = int(reply.get("missed_beats") or 0) >= SKIP_BEATS_FROM
        self._missed_beats = int(reply.get("missed_beats") or 3)
        self._merge_steps = bool(reply.get("steps_batch"))      # one step message per machine
        self.registered.set()
        log.info("registered with the controller as %s (%s, %s)", self.machine_id, reply.get("role"),
                 "over its channel" if self.link.over_channel else "HTTP requests")

    def _ensure_registered(self) -> bool:
        if self.registered.is_set():
            return True
        if self._failures:
            # where it is published, the controller may have come back on another address: knock
            # there now, not one more backoff after a failure at the old one
            self.link.find_controller(self.controller_file)
        try:
            self._register()
        except (ControllerUnreachable, ApiError) as e:
            self._failures += 1
            # a refusal is never transient: say it every time; an absence once in a while
            if isinstance(e, ApiError) or self._failures == 1 or self._failures % 20 == 0:
                log.warning("%s; retrying with backoff (attempt %d)", e, self._failures)
            return False
        if self._failures:
            log.info("controller back after %d failed attempt(s)", self._failures)
        self._failures = 0
        return True

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            if not self._ensure_registered():
                # back off (with jitter) while the controller is away: thousands of agents must
                # not knock on a restarting controller in step
                # with several controllers (an active one and standbys) the whole list is one
                # attempt: the next URL is tried at once, the backoff grows per round of the list
                n = len(self.link.urls)
                if n > 1 and self._failures % n:
                    self._stop.wait(0.05)
                else:
                    self._stop.wait(retry_delay(-(-self._failures // n), self.heartbeat_s, random.random()))
                continue
            if self._skip_beats and time.monotonic() - self._delivered_at < self.heartbeat_s / 2:
                # events went through within the last half interval and counted as a beat: one
                # request a second per machine, not two (at 2,000 machines the controller's load
                # halves). At worst 1.5 intervals pass between beats, inside the missed beats allowed
                self._stop.wait(self.heartbeat_s)
                continue
            try:
                reply = self.link.beat({"t": time.time(), "workers": self.workers.pids()},
                                       timeout=max(2.0, 3 * self.heartbeat_s))
                if reply.get("reregister"):
                    self.registered.clear()
            except ControllerUnreachable:
                self.registered.clear()
            except ApiError as e:
                log.warning("heartbeat refused: %s", e)
                self.registered.clear()
            self._stop.wait(self.heartbeat_s)

    def _command_loop(self) -> None:
        while not self._stop.is_set():
            if not self.registered.wait(0.5):
                continue
            wait = 5.0
            if self._refill_at is not None:   # spares due: until a rank here reports a step, look each second
                wait = 0.0 if self._last_step else 1.0
            try:
                cmds = self.link.commands(wait)     # (pushed over the channel, else a long poll)
            except (ControllerUnreachable, ApiError):
                self.registered.clear()
                self._stop.wait(0.2)
                continue
            except Exception:  # the command thread never dies: a dead thread is a deaf machine
                log.exception("polling the controller for commands failed; retrying")
                self._stop.wait(0.5)
                continue
            for raw in cmds:
                try:
                    self._execute(p.decode_command(raw))
                except Exception as e:  # report, never die on one bad command
                    log.exception("command %s failed", raw.get("type"))
                    self.emit(p.CommandFailed(command=str(raw.get("type")), kind=raw.get("kind"), error=str(e)))
            if self._refill_due():
                _, run_cmd = self._refill_at
                self._refill_at = None
                self._refill(run_cmd)

    def _sender_loop(self) -> None:
        """Deliver events in order; while the controller is away keep them (bounded, see Outbox).
        A batch the controller refuses (4xx) is logged and dropped: sending it again cannot help."""
        while not self._stop.is_set():
            if not self.registered.wait(0.5):       # away: keep the events, the heartbeat loop
                continue                            # knocks (with backoff) for everyone
            batch = self._events.take(timeout=0.5, linger=EVENT_LINGER_S, gather=STEP_GATHER_S,
                                      ranks=len(self.workers.workers), pace=STEP_PACE_S)
            if not batch:
                continue
            if self._merge_steps:
                batch = p.merge_steps(batch)
            try:
                reply = self.link.events(batch)
                if reply.get("taken", True) is False:       # a restarted controller: after registering
                    self._events.give_back(batch)
                    self.registered.clear()
                    continue
                self._delivered_at = time.monotonic()        # a delivered batch is a heartbeat
                if reply.get("reregister"):
                    self.registered.clear()
            except ControllerUnreachable:
                self._events.give_back(batch)
                self._stop.wait(0.2)
            except ApiError as e:
                if e.status >= 500:
                    self._events.give_back(batch)
                    self._stop.wait(0.2)
                else:
                    log.warning("controller refused %d event(s): %s", len(batch), e)

    def emit(self, event: p.Event | dict) -> None:
        """Queue an event for the controller: one of `protocol`'s events, or a worker's message
        passed on as it came (the controller decodes both into the same types)."""
        if isinstance(event, msgspec.Struct):
            event = msgspec.to_builtins(event)
        if not event.get("t"):
            event["t"] = time.time()
        event["machine"] = self.machine_id
        self._events.put(event)

    # -- the workers' local socket -----------------------------------------------------------------
    def _start_socket_server(self) -> None:
        if os.path.exists(self.sock_path):
            os.unlink(self.sock_path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.sock_path)
        srv.listen(64)
        threading.Thread(target=self._accept_loop, args=(srv,), daemon=True, name="sock").start()

    def _accept_loop(self, srv: socket.socket) -> None:
        while not self._stop.is_set():
            conn, _ = srv.accept()
            pid = socket_peer_pid(conn)
            w = next((w for w in self.workers.workers if w.proc.pid == pid), None)
            if w is not None and isinstance(w.proc, AdoptedProcess):
                log.info("rank %s (pid %d) linked again", w.rank, pid)
            jl = JsonLineSocket(conn)
            with self._lock:
                self._conns[pid] = jl
            threading.Thread(target=self._reader, args=(pid, jl), daemon=True).start()

    def _reader(self, pid: int, jl: JsonLineSocket) -> None:
        while True:
            try:
                msg = jl.recv()
            except (OSError, ValueError):
                msg = None
            if msg is None:
                with self._lock:
                    self._conns.pop(pid, None)
                return
            kind = msg.get("type")
            if kind == "standby_ready":
                with self._lock:
                    self._standby_ready.append(pid)
                self._report_spares()
            if kind == "failing":
                self._on_worker_failing(pid, msg)
            if kind == "shard" and isinstance(msg.get("rank"), int):
                self.ckpt.on_shard(msg["rank"], int(msg.get("step", -1)), str(msg.get("path", "")))
                continue
            if kind == "step" and isinstance(msg.get("rank"), int):
                self._last_step[msg["rank"]] = int(msg.get("step", -1))
                self.chaos_cmds.on_step()
            if kind in FORWARDED:
                msg["run"] = self._run
                self.emit(msg)

    # -- commands -----------------------------------------------------------------------------
    def _execute(self, cmd: p.Command) -> None:
        if isinstance(cmd, p.Start):
            self._launch(cmd)
        elif isinstance(cmd, p.Prewarm):
            self._prewarm(cmd)
        elif isinstance(cmd, p.Spares):
            self._spares(cmd)
        elif isinstance(cmd, p.Stop):
            self._stop_workers(cmd.run, cmd.grace_s)
        elif isinstance(cmd, p.Chaos):
            self.chaos_cmds.command(cmd)
        elif isinstance(cmd, p.Trace):
            self._trace(cmd)
        elif isinstance(cmd, p.Diagnose):
            # Its own thread: the checks take seconds and a stop must still get through. The thread
            # waits for its processes, so they never outlive their parent thread (PDEATHSIG).
            threading.Thread(target=self.diagnoser.run, args=(p.encode(cmd),), name="diagnose",
                             daemon=True).start()
        elif isinstance(cmd, p.Shutdown):
            self.chaos.cleanup()
            self.workers.stop()
            self.warm.stop()
            self.diagnoser.stop()
            self.shutdown()
        else:
            raise ValueError(f"unknown command {cmd!r}")

    def _prefix(self) -> list[str] | None:
        return self.netns.exec_prefix() if self.netns is not None else None

    def _base_env(self, extra: dict | None = None) -> dict[str, str]:
        """The machine's own environment for a process it starts, plus `extra` (a diagnose
        command's env, say)."""
        env = self.netns.env() if self.netns is not None else dict(os.environ)
        env.update({k: str(v) for k, v in ((extra or {}).get("env") or {}).items()})
        env[p.Env.AGENT_SOCK] = self.sock_path
        env[p.Env.SIMGPU] = self.simgpu_path
        env[p.Env.MACHINE] = self.machine_id
        env[p.Env.SHM_DIR] = self.ckpt.shm_dir
        # a worker's link waits this long for a restarted agent (past the controller's limit the
        # machine is lost anyway)
        env[p.Env.RELINK_S] = str(round(self.heartbeat_s * self._missed_beats + 5.0, 1))
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _spec_env(self, spec: p.RunSpec) -> dict[str, str]:
        """A worker's environment for a run spec (the machine's, the run's, the code version's)."""
        env = self._base_env()
        env.update(p.run_env(spec))
        path = p.python_path(spec.code_path, env.get("PYTHONPATH"))
        if path:
            env["PYTHONPATH"] = path
        # the flight-recorder hook of every worker (worker/frhook.py): hang evidence without the SDK
        return hook_env(env, self.progress.fr_dir, self.heartbeat_s)

    def _prepare_run(self, cmd: p.Start) -> list[dict[str, str]] | None:
        """Checkpoint set-up and restore shards for a run; the extra env of each worker, or None
        (reported as restore_failed) when a rank has no valid copy anywhere."""
        if cmd.spec.job != self._job:
            self.ckpt.clear_own()
            self._job = cmd.spec.job
        return self.ckpt.prepare_run(cmd, self.emit)

    def _cold_start(self, cmd: p.Start, extra: list[dict[str, str]]) -> None:
        base = self._spec_env(cmd.spec)
        envs = [dict(base, **more) for more in extra]
        self.workers.spawn(cmd.spec.command, envs, [w.rank for w in cmd.workers], self._run, cmd.spec.cwd,
                           f"run{self._run}", prefix=self._prefix())

    def _launch(self, cmd: p.Start) -> None:
        """Start a run's workers: hand the ranks to warm workers when they are ready, else cold."""
        self.workers.stop()
        self._last_step.clear()
        self._events.reset_pace()
        self.progress.reset()
        preload_before = self.forks.preload_wait_s
        extra = self._prepare_run(cmd)
        if extra is None:
            return
        self._run = cmd.spec.run
        self._start_cmd = cmd
        n = len(cmd.workers)
        # A replay (stop-time diagnostics) is a throw-away run of another shape: it starts cold and
        # leaves the job's spares alone, for the run after it.
        replay = cmd.spec.replay
        ready: list[int] = []
        if not replay and self._warm_key == cmd.spec.warm_key() and self.warm.workers:
            if warm_nice():
                # they are wanted now: a spare still importing at low priority on a busy machine
                # would hold the whole run back (every rank waits for this machine's)
                for pid in self.warm.pids():
                    renice(pid, 0)
            deadline = time.time() + cmd.wait_warm_s
            while True:
                warm_pids = set(self.warm.pids())
                with self._lock:
                    ready = [pid for pid in self._standby_ready if pid in self._conns and pid in warm_pids]
                if len(ready) >= n or time.time() >= deadline:
                    break
                time.sleep(0.02)
        if len(ready) < n:
            if not replay:
                self.warm.stop()
            self._cold_start(cmd, extra)
            warm = False
        else:
            self._hand_over(cmd, extra, ready[:n])
            warm = True
        self.emit(p.Started(run=self._run, pids=self.workers.pids(), warm=warm,
                            preload_s=round(self.forks.preload_wait_s - preload_before, 3)))
        self._save_state()
        if self.keep_warm and cmd.spec.spares and not replay:
            # Spawned from the command thread: workers die with the thread that forked them
            # (PR_SET_PDEATHSIG), so never from a short-lived one.
            self._refill_at = (time.time(), cmd)     # (started once a rank here reported a step)

    def _hand_over(self, cmd: p.Start, extra: list[dict[str, str]], pids: list[int]) -> None:
        by_pid = {w.proc.pid: w for w in self.warm.workers}
        chosen = sorted((by_pid[pid] for pid in pids), key=lambda w: w.local_rank)
        self.warm.release(chosen)
        run_env = p.run_env(cmd.spec)
        for worker, w, more in zip(chosen, cmd.workers, extra):
            env = dict(run_env, **more)
            with self._lock:
                conn = self._conns[worker.proc.pid]
                self._standby_ready.remove(worker.proc.pid)
            if warm_nice():
                renice(worker.proc.pid, 0)      # it trains now: back to normal priority
            conn.send({"type": "activate", "env": env})
            worker.rank, worker.run = w.rank, self._run
            take_run_names(worker)
        self.workers.adopt(chosen)

    def _spawn_warm(self, spec: p.RunSpec, n: int) -> None:
        base = self._spec_env(msgspec.structs.replace(spec, run=None, master=None))
        base[p.Env.STANDBY] = "1"
        self._warm_key = spec.warm_key()
        self.warm.spawn(spec.command, [dict(base, LOCAL_RANK=str(i)) for i in range(n)],
                        [None] * n, None, spec.cwd, f"warm{int(time.time() * 1000) % 10**9}",
                        prefix=self._prefix(), nice=warm_nice())

    def _prewarm(self, cmd: p.Prewarm) -> None:
        self.workers.stop()
        self.warm.stop()
        self._spawn_warm(cmd.spec, cmd.count)
        self.emit(p.Prewarmed(pids=self.warm.pids()))

    def _spares(self, cmd: p.Spares) -> None:
        """Spares for another command (a new code version) while the run goes on: the current
        spares make way, and `spares_ready` says when the new ones wait at the barrier, so the
        controller stops the run only once the restart can be warm."""
        self._refill_at = None
        if self._warm_key != cmd.spec.warm_key():
            self.warm.stop()
            self._spawn_warm(cmd.spec, cmd.count)
        elif len(self.warm.workers) < cmd.count:      # asked again after a restart took some of them
            self._spawn_warm(cmd.spec, cmd.count - len(self.warm.workers))
        self._spares_for = cmd.spec.code_path or cmd.spec.cwd or ""
        self._report_spares()

    def _report_spares(self) -> None:
        with self._lock:
            if self._spares_for is None or not self.warm.workers:
                return
            if not set(self.warm.pids()) <= set(self._standby_ready):
                return
            key, self._spares_for = self._spares_for, None
        self.emit(p.SparesReady(key=key, pids=self.warm.pids()))

    def _refill(self, cmd: p.Start) -> None:
        missing = len(cmd.workers) - len(self.warm.workers)
        if self._warm_key not in (None, cmd.spec.warm_key()) and self.warm.workers:
            return      # the spares wait for another command (a new code version)
        if missing > 0 and self._run == cmd.spec.run:
            self._spawn_warm(cmd.spec, missing)
        if self._run == cmd.spec.run:
            self.diagnoser.prewarm()   # the stop-time checks of the next failure start warm too

    def _stop_workers(self, run: int | None, grace_s: float) -> None:
        self._refill_at = None
        self.chaos.cleanup()   # thaw first: a frozen process cannot die
        log.info("stopping the workers of run %s", run)
        self.workers.stop(grace_s)
        if run is None:        # the job is over (or this machine left it): no spares either
            self.warm.stop()
            self.diagnoser.stop()
            self._warm_key = None
        self.ckpt.workers_stopped()
        self._save_state()
        self.emit(p.Stopped(run=run, inventory=self.ckpt.inventory()))

    def _trace(self, cmd: p.Trace) -> None:
        """Stacks, process states and flight-recorder summaries of this machine's workers."""
        pids = {w.rank: w.proc.pid for w in self.workers.workers if w.proc.poll() is None and w.rank is not None}
        records = trace_workers(pids, cmd.timeout_s, self.machine_id, self.progress.summaries)
        self.emit(p.Stacks(run=cmd.run, records=records))

    # -- worker exits ----------------------------------------------------------------------------
    def _on_worker_failing(self, pid: int, msg: dict) -> None:
        """A worker's SDK says it is going down with an exception: report the failure now, with
        its traceback, rather than when the process is gone (interpreter teardown takes ~0.5 s)."""
        w = next((w for w in self.workers.workers if w.proc.pid == pid), None)
        if w is None or w.expected_exit or w.failure_reported:
            return
        w.failure_reported = True
        self._report_exit(w, None, False, "\n" + str(msg.get("traceback") or ""))

    def _on_worker_exit(self, w: Worker) -> None:
        try:        # a plain script's last steps (its step hook wrote them at exit) before its exit
            for ev in self.progress.script_events([w]):
                self.emit(ev)
        except Exception:      # noqa: BLE001 - the exit matters more than its last steps
            log.exception("reading the step hook of rank %s", w.rank)
        if w.failure_reported:
            return             # reported when its SDK said it was failing
        # `expected` as it was at the exit: a stop may come during the sweep
        self._report_exit(w, w.exit_code, w.expected_exit)

    def _report_exit(self, w: Worker, code: int | None, expected: bool, more_log: str = "") -> None:
        """One `worker_exit` event (code None: failing, not gone yet); for a failure, after a
        sweep of the probes, so that a dead GPU is reported before the crash it caused."""
        if not expected and code != 0:
            self.monitor.sweep()
        sig = -code if code is not None and code < 0 else None
        log.info("rank %s (pid %d) %s with code %s%s", w.rank, w.proc.pid,
                 "is failing" if code is None else "exited", code, " (stopped)" if expected else "")
        self.emit(p.WorkerExit(run=w.run, rank=w.rank, local_rank=w.local_rank, code=code, signal=sig,
                               expected=expected, pid=w.proc.pid,
                               log_tail="" if expected else w.log_tail() + more_log))


def socket_peer_pid(conn: socket.socket) -> int:
    import struct
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]
