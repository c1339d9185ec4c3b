"""The environment of the processes an agent starts: the machine's own (its network namespace's,
where it has one), what every worker needs to find its agent (socket, simulated GPU, shared
memory), and a run's (`protocol.env`, the code version's path, the flight-recorder hook)."""
from __future__ import annotations

import os
from typing import Callable

from stalwart import protocol as p
from stalwart.agent.progress import hook_env
from stalwart.devices.netns import Machine


class WorkerEnv:
    def __init__(self, machine_id: str, sock_path: str, simgpu_path: str, shm_dir: str, fr_dir: str,
                 netns: Machine | None, heartbeat_s: Callable[[], float], relink_s: Callable[[], float],
                 gpus: int = 1):
        """`heartbeat_s`, `relink_s`: as the controller asked last (they change at registration);
        `gpus`: the machine's worker slots."""
        self.gpus = gpus
        self.machine_id = machine_id
        self.sock_path = sock_path
        self.simgpu_path = simgpu_path
        self.shm_dir = shm_dir
        self.fr_dir = fr_dir
        self.netns = netns
        self.heartbeat_s = heartbeat_s
        self.relink_s = relink_s

    def prefix(self) -> list[str] | None:
        """What a command runs behind (entering the machine's network namespace), or None."""
        return self.netns.exec_prefix() if self.netns is not None else None

    def base(self, extra: dict | None = None) -> dict[str, str]:
        """The machine's own environment for a process it starts, plus `extra` (a diagnose
        command's env, say)."""
        env = self.netns.env() if self.netns is not None else dict(os.environ)
        env.update({k: str(v) for k, v in ((extra or {}).get("env") or {}).items()})
        env[p.Env.AGENT_SOCK] = self.sock_path
        env[p.Env.SIMGPU] = self.simgpu_path
        env[p.Env.MACHINE] = self.machine_id
        env[p.Env.SHM_DIR] = self.shm_dir
        # a worker's link waits this long for a restarted agent (past the controller's limit the
        # machine is lost anyway)
        env[p.Env.RELINK_S] = str(self.relink_s())
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.gpus > 1:
            # as torchrun does for more than one process a machine: each process's intra-op pool
            # would take every core, and the ranks' threads would fight for them (a CPU job of two
            # ranks a machine ran its steps 10-30x slower than under torchrun)
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def for_spec(self, spec: p.RunSpec) -> dict[str, str]:
        """A worker's environment for a run spec (the machine's, the run's, the code version's)."""
        env = self.base()
        env.update(p.run_env(spec))
        path = p.python_path(spec.code_path, env.get("PYTHONPATH"))
        if path:
            env["PYTHONPATH"] = path
        # the flight-recorder hook of every worker (worker/frhook.py): hang evidence without the SDK
        return hook_env(env, self.fr_dir, self.heartbeat_s())
