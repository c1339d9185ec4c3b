"""Stop-time checks on one machine: the agent runs `stalwart.diag.worker` once per accelerator under
a time bound and reports every result (the pure verdict is the controller's `ladder`).

Each check process gets a plan file and appends one JSON line per finished check, so a process
killed at the bound still leaves what it had measured. Processes run in the machine's network
namespace (with its environment) like the workers, and are killed with their whole tree.

The checkers are forked by the machine's fork server where it runs (agent/forkclient.py: torch
imported once for the workers and the checks alike). Without one, the agent keeps one warm
`stalwart.diag.worker --serve` process per machine between failures (torch imported, the checks
loaded) that forks the checkers when a `diagnose` command comes; without either they start cold.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Callable

from stalwart import protocol
from stalwart.agent.forkclient import ForkedProcess, ForkServers
from stalwart.agent.workers import die_with_parent, kill_tree, renice

log = logging.getLogger("stalwart.agent")
START_GRACE_S = 15.0     # importing torch on a loaded machine, on top of the checks' own bound
CHECKER = [sys.executable, "-m", "stalwart.diag.worker"]
WARM_NICE = 10           # the warm checker imports torch while the job trains: it yields the CPU to it


def _warm_checker_child() -> None:
    """In the warm checker's child before exec: die with the agent's thread, lower priority (no
    root needed to lower one). As root the checks get the normal priority back when they start
    (`Diagnoser.run`): a pair test measuring bandwidth at niceness 10 on a machine busy with other
    work measures the scheduler; without root they keep it (the job is stopped, the machine is
    theirs)."""
    die_with_parent()
    os.nice(WARM_NICE)


class Diagnoser:
    def __init__(self, machine_id: str, workdir: str, simgpu_path: str,
                 env: Callable[[dict], dict[str, str]], prefix: Callable[[], list[str] | None],
                 emit: Callable[[protocol.Event], None], forks: ForkServers | None = None):
        self.machine_id, self.workdir, self.simgpu_path = machine_id, workdir, simgpu_path
        self.env, self.prefix, self.emit = env, prefix, emit
        self.forks = forks if forks is not None and forks.enabled else None
        self._warm: subprocess.Popen | None = None
        self._lock = threading.Lock()

    # -- the warm checker ---------------------------------------------------------------------
    def prewarm(self) -> None:
        """Start the warm checker if none is alive (not with a fork server: it forks the checkers).
        Call from a long-lived thread (the agent's command thread): the process dies with the
        thread that forked it."""
        if self.forks is not None:
            return
        with self._lock:
            if self._warm is not None and self._warm.poll() is None:
                return
            d = os.path.join(self.workdir, "diag")
            os.makedirs(d, exist_ok=True)
            argv = (self.prefix() or []) + CHECKER + ["--serve"]
            with open(os.path.join(d, "warm.log"), "ab") as log_f:
                self._warm = subprocess.Popen(argv, env=self.env({}), cwd=self.workdir,
                                              stdin=subprocess.PIPE, stdout=log_f,
                                              stderr=subprocess.STDOUT, start_new_session=True,
                                              preexec_fn=_warm_checker_child)

    def warm_pid(self) -> int | None:
        with self._lock:
            return self._warm.pid if self._warm is not None and self._warm.poll() is None else None

    def stop(self) -> None:
        """Kill the warm checker (the job is over, or the agent leaves)."""
        warm = self._take_warm()
        if warm is not None:
            kill_tree(warm.pid)
            warm.wait()

    def _take_warm(self) -> subprocess.Popen | None:
        with self._lock:
            warm, self._warm = self._warm, None
        return warm if warm is not None and warm.poll() is None else None

    # -- a diagnose command ---------------------------------------------------------------------
    def run(self, cmd: dict) -> None:
        """Run the checks of `cmd` (a `diagnose` command) and emit one `diag_result` event."""
        t0 = time.time()
        d = os.path.join(self.workdir, "diag", str(cmd["id"]))
        os.makedirs(d, exist_ok=True)
        bound = float(cmd.get("timeout_s", 20.0))
        n = int(cmd.get("local_world", 1))
        files = []
        for lr in range(n):
            plan = {"machine": self.machine_id, "local_rank": lr, "local_world": n, "device": lr,
                    "simgpu": self.simgpu_path, "checks": list(cmd.get("checks", [])),
                    "store_host": cmd.get("store_host"), "intra": cmd.get("intra"),
                    "inter": cmd.get("inter", []) if lr == 0 else [], "timeout_s": bound}
            plan_path, out = os.path.join(d, f"plan{lr}.json"), os.path.join(d, f"results{lr}.jsonl")
            with open(plan_path, "w") as f:
                json.dump(plan, f)
            open(out, "w").close()
            files.append((plan_path, out, os.path.join(d, f"diag{lr}.log")))
        warm = self._take_warm()
        if warm is not None and os.geteuid() == 0:
            renice(warm.pid, 0)      # (its processes for the plans start from it: they inherit it)
        if warm is not None:
            try:
                warm.stdin.write((json.dumps({"plans": files, "env": cmd.get("env", {})}) + "\n").encode())
                warm.stdin.close()
                procs = [warm]
            except OSError:      # it died just now: start cold
                warm = None
        if warm is None:
            procs = [self._forked(plan_path, out, log_path, cmd) or self._cold(plan_path, out, log_path, cmd)
                     for plan_path, out, log_path in files]
        rounds = max(1, len(cmd.get("inter", [])))
        deadline = t0 + START_GRACE_S + bound * (2 + rounds)
        killed = []
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                p.wait()
                killed.extend(range(n) if warm is not None else [i])
        results = []
        for _, out, _ in files:
            with open(out) as f:
                for line in f:
                    try:
                        results.append(json.loads(line))
                    except ValueError:
                        pass    # the line a killed process was writing
        self.emit(protocol.DiagResult(id=cmd["id"], results=results, killed=killed,
                                      warm=warm is not None or any(isinstance(p, ForkedProcess) for p in procs),
                                      seconds=round(time.time() - t0, 3)))

    def _forked(self, plan_path: str, out: str, log_path: str, cmd: dict) -> ForkedProcess | None:
        if self.forks is None:
            return None
        return self.forks.spawn(CHECKER + [plan_path, out], self.env(cmd), self.workdir, log_path, log_path,
                                self.prefix())

    def _cold(self, plan_path: str, out: str, log_path: str, cmd: dict) -> subprocess.Popen:
        argv = (self.prefix() or []) + CHECKER + [plan_path, out]
        with open(log_path, "wb") as log_f:
            return subprocess.Popen(argv, env=self.env(cmd), cwd=self.workdir, stdout=log_f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
