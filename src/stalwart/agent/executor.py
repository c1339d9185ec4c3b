"""The agent's commands carried out: starting a run's workers (cold, or by handing the ranks to warm
spares), keeping and topping up warm spares, stopping workers, tracing them, diagnosing the
machine. Every command runs on the session's command thread (agent/session.py), which is also
the thread that forks workers: they die with the thread that forked them (PR_SET_PDEATHSIG), so
never from a short-lived one. What a command changes of the machine's run is in `RunState`; what
it reports goes out through `emit`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import msgspec

from stalwart import protocol as p
from stalwart.agent.armed import ChaosCommands
from stalwart.agent.ckpt import CkptManager
from stalwart.agent.diagnose import Diagnoser
from stalwart.agent.forkclient import ForkServers
from stalwart.agent.progress import ProgressWatch
from stalwart.agent.runstate import RunState
from stalwart.agent.tracer import trace_workers
from stalwart.agent.workerenv import WorkerEnv
from stalwart.agent.workers import WorkerSet, renice, take_run_names, warm_nice
from stalwart.agent.workerserver import WorkerServer
from stalwart.chaos.machine import MachineChaos

log = logging.getLogger("stalwart.agent")
PLAIN_REFILL_AFTER_S = 60.0     # a run without step reports gets its spares this long after its start


class CommandExecutor:
    def __init__(self, machine_id: str, state: RunState, workers: WorkerSet, warm: WorkerSet,
                 forks: ForkServers, server: WorkerServer, env: WorkerEnv, ckpt: CkptManager,
                 progress: ProgressWatch, chaos: MachineChaos, chaos_cmds: ChaosCommands, diagnoser: Diagnoser,
                 emit: Callable[[p.Event], None], reset_pace: Callable[[], None],
                 save_state: Callable[[], None], shutdown: Callable[[], None], keep_warm: bool = True):
        """`workers`: the run's; `warm`: the warm spares (torch imported, the user's module
        loaded, blocked at the activation barrier: a restart never waits for `import torch`);
        `reset_pace`: a new run's first step reports go at once; `save_state`: note the run for a
        successor; `shutdown`: end the agent; `keep_warm`: keep spares for the next restart."""
        self.machine_id = machine_id
        self.state = state
        self.workers, self.warm, self.forks, self.server, self.env = workers, warm, forks, server, env
        self.ckpt, self.progress, self.chaos, self.chaos_cmds = ckpt, progress, chaos, chaos_cmds
        self.diagnoser = diagnoser
        self.emit, self.reset_pace, self.save_state, self.shutdown = emit, reset_pace, save_state, shutdown
        self.keep_warm = keep_warm
        self._lock = threading.Lock()
        self._warm_key: tuple | None = None
        self._refill_at: tuple[float, p.Start] | None = None   # when to top up the spares, for which run
        self._spares_for: str | None = None     # `spares` asked: report when those are all ready

    def execute(self, cmd: p.Command) -> None:
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

    # -- spares due (on the command thread, between polls) -------------------------------------
    def poll_wait(self) -> float:
        if self._refill_at is not None:   # spares due: until a rank here reports a step, look each second
            return 0.0 if self.state.last_step else 1.0
        return 5.0

    def after_poll(self) -> None:
        if self._refill_due():
            assert self._refill_at is not None
            _, run_cmd = self._refill_at
            self._refill_at = None
            self._refill(run_cmd)

    def adopted(self, cmd: p.Start) -> None:
        """A run this agent took over from its predecessor: its spares died with it."""
        if self.keep_warm and cmd.spec.spares and not cmd.spec.replay:
            self._refill_at = (time.time(), cmd)

    def _refill_due(self) -> bool:
        """Spares are started once the run is through its start-up: as soon as a rank here
        reported a step (a script without the SDK reports none: a minute after the run began).
        Never for a run whose step hook reported (a plain script: it has no activation barrier, so
        a spare of it cannot wait for its ranks)."""
        if self._refill_at is None:
            return False
        if self.state.run is not None and self.progress.script_run == self.state.run:
            self._refill_at = None
            return False
        return bool(self.state.last_step) or time.time() - self._refill_at[0] >= PLAIN_REFILL_AFTER_S

    # -- a run's workers -----------------------------------------------------------------------
    def _prepare_run(self, cmd: p.Start) -> list[dict[str, str]] | None:
        """Checkpoint set-up and restore shards for a run; the extra env of each worker, or None
        (reported as restore_failed) when a rank has no valid copy anywhere."""
        if cmd.spec.job != self.state.job:
            self.ckpt.clear_own()
            self.state.job = cmd.spec.job
        return self.ckpt.prepare_run(cmd, self.emit)

    def _cold_start(self, cmd: p.Start, extra: list[dict[str, str]]) -> None:
        base = self.env.for_spec(cmd.spec)
        envs = [dict(base, **more) for more in extra]
        self.workers.spawn(cmd.spec.command, envs, [w.rank for w in cmd.workers], self.state.run, cmd.spec.cwd,
                           f"run{self.state.run}", prefix=self.env.prefix())

    def _launch(self, cmd: p.Start) -> None:
        """Start a run's workers: hand the ranks to warm workers when they are ready, else cold."""
        self.workers.stop()
        self.state.last_step.clear()
        self.reset_pace()
        self.progress.reset()
        preload_before = self.forks.preload_wait_s
        extra = self._prepare_run(cmd)
        if extra is None:
            return
        self.state.run = cmd.spec.run
        self.state.start = cmd
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
                ready = [pid for pid in self.server.standbys(linked=True) if pid in warm_pids]
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
        self.emit(p.Started(run=self.state.run, pids=self.workers.pids(), warm=warm,
                            preload_s=round(self.forks.preload_wait_s - preload_before, 3)))
        self.save_state()
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
            if warm_nice():
                renice(worker.proc.pid, 0)      # it trains now: back to normal priority
            self.server.activate(worker.proc.pid, p.Activate(env=dict(run_env, **more)))
            worker.rank, worker.run = w.rank, self.state.run
            take_run_names(worker)
        self.workers.adopt(chosen)

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
        self.save_state()
        self.emit(p.Stopped(run=run, inventory=self.ckpt.inventory()))

    def _trace(self, cmd: p.Trace) -> None:
        """Stacks, process states and flight-recorder summaries of this machine's workers."""
        pids = {w.rank: w.proc.pid for w in self.workers.workers if w.proc.poll() is None and w.rank is not None}
        records = trace_workers(pids, cmd.timeout_s, self.machine_id, self.progress.summaries)
        self.emit(p.Stacks(run=cmd.run, records=records))

    # -- warm spares ---------------------------------------------------------------------------
    def _spawn_warm(self, spec: p.RunSpec, n: int) -> None:
        base = self.env.for_spec(msgspec.structs.replace(spec, run=None, master=None))
        base[p.Env.STANDBY] = "1"
        self._warm_key = spec.warm_key()
        self.warm.spawn(spec.command, [dict(base, LOCAL_RANK=str(i)) for i in range(n)],
                        [None] * n, None, spec.cwd, f"warm{int(time.time() * 1000) % 10**9}",
                        prefix=self.env.prefix(), nice=warm_nice())

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
        self.report_spares()

    def report_spares(self) -> None:
        """`spares_ready` once every spare asked for waits at its barrier (a worker's reader
        calls this when one gets there)."""
        with self._lock:
            if self._spares_for is None or not self.warm.workers:
                return
            if not set(self.warm.pids()) <= set(self.server.standbys()):
                return
            key, self._spares_for = self._spares_for, None
        self.emit(p.SparesReady(key=key, pids=self.warm.pids()))

    def _refill(self, cmd: p.Start) -> None:
        missing = len(cmd.workers) - len(self.warm.workers)
        if self._warm_key not in (None, cmd.spec.warm_key()) and self.warm.workers:
            return      # the spares wait for another command (a new code version)
        if missing > 0 and self.state.run == cmd.spec.run:
            self._spawn_warm(cmd.spec, missing)
        if self.state.run == cmd.spec.run:
            self.diagnoser.prewarm()   # the stop-time checks of the next failure start warm too
