"""Stop-time checks on one machine: the agent runs `stalwart.diag.worker` once per accelerator under
a time bound and reports every result (the pure verdict is the controller's `ladder`).

Each check process gets a plan file and appends one JSON line per finished check, so a process
killed at the bound still leaves what it had measured. Processes run in the machine's network
namespace (with its environment) like the workers, and are killed with their whole tree.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Callable

from stalwart.agent.workers import kill_tree

log = logging.getLogger("stalwart.agent")
START_GRACE_S = 15.0     # importing torch on a loaded machine, on top of the checks' own bound


class Diagnoser:
    def __init__(self, machine_id: str, workdir: str, simgpu_path: str,
                 env: Callable[[dict], dict[str, str]], prefix: Callable[[], list[str] | None],
                 emit: Callable[[dict], None]):
        self.machine_id, self.workdir, self.simgpu_path = machine_id, workdir, simgpu_path
        self.env, self.prefix, self.emit = env, prefix, emit

    def run(self, cmd: dict) -> None:
        """Run the checks of `cmd` (a `diagnose` command) and emit one `diag_result` event."""
        t0 = time.time()
        d = os.path.join(self.workdir, "diag", str(cmd["id"]))
        os.makedirs(d, exist_ok=True)
        bound = float(cmd.get("timeout_s", 20.0))
        n = int(cmd.get("local_world", 1))
        env = self.env(cmd)
        procs, outs = [], []
        for lr in range(n):
            plan = {"machine": self.machine_id, "local_rank": lr, "local_world": n, "device": lr,
                    "simgpu": self.simgpu_path, "checks": list(cmd.get("checks", [])),
                    "store_host": cmd.get("store_host"), "intra": cmd.get("intra"),
                    "inter": cmd.get("inter", []) if lr == 0 else [], "timeout_s": bound}
            plan_path, out = os.path.join(d, f"plan{lr}.json"), os.path.join(d, f"results{lr}.jsonl")
            with open(plan_path, "w") as f:
                json.dump(plan, f)
            open(out, "w").close()
            argv = (self.prefix() or []) + [sys.executable, "-m", "stalwart.diag.worker", plan_path, out]
            log_f = open(os.path.join(d, f"diag{lr}.log"), "wb")
            procs.append(subprocess.Popen(argv, env=env, cwd=self.workdir, stdout=log_f,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            log_f.close()
            outs.append(out)
        rounds = max(1, len(cmd.get("inter", [])))
        deadline = t0 + START_GRACE_S + bound * (2 + rounds)
        killed = []
        for lr, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                p.wait()
                killed.append(lr)
        results = []
        for out in outs:
            with open(out) as f:
                for line in f:
                    try:
                        results.append(json.loads(line))
                    except ValueError:
                        pass    # the line a killed process was writing
        self.emit({"type": "diag_result", "id": cmd["id"], "results": results, "killed": killed,
                   "seconds": round(time.time() - t0, 3)})
