"""A restarted agent takes over the workers its predecessor left running.

An agent that dies (a crash, an OOM kill, a supervisor's restart) leaves its run's workers
training: they outlive it for a bound (their link to the agent waits for it to come back, see
worker/link.py; the fork or exec server that started them keeps them and notes their exits). The
agent writes what it runs to `<workdir>/workers.json` (the machine, the job, the run, and each
worker's pid, rank, start time and log files) every time that changes. The next agent on the same
work directory reads it and decides here, purely, what it adopts:

- everything, when every recorded worker is still the same live process (pid *and* kernel start
  time, read from /proc: a recycled pid is never adopted) and the file is this machine's;
- nothing otherwise, with the reason in one line (no record, another machine's, no run, a rank
  gone): its live leftovers are then stopped and each recorded rank is reported as ended, so the
  normal path applies (the controller recovers the run as from a crash; agent/succession.py).

The adopted workers are re-registered as `running_run`/`ranks`, so the controller sees its run
still complete and books nothing.
"""
from __future__ import annotations

import os
import select
import threading
import time

import msgspec

from stalwart.agent.forkclient import ForkedProcess

STATE = "workers.json"


class WorkerRecord(msgspec.Struct, frozen=True):
    pid: int
    rank: int
    local_rank: int
    start_ticks: int            # /proc/PID/stat field 22: when the process started (clock ticks since boot)
    out_path: str
    err_path: str
    forked: bool = False        # started by a fork or exec server (which notes its exit code: see forkserver.py)


class AgentState(msgspec.Struct, frozen=True):
    machine: str
    agent_pid: int
    job: int | None = None
    run: int | None = None
    workers: tuple[WorkerRecord, ...] = ()
    start: dict | None = None           # the run's command (protocol.Start, as sent): its checkpoint plan, its spares
    fork_servers: tuple[tuple[int, int], ...] = ()    # (pid, start ticks) of the agent's fork servers


class Adoption(msgspec.Struct, frozen=True):
    adopt: tuple[WorkerRecord, ...]     # empty: nothing adopted
    strays: tuple[int, ...]             # live recorded workers not adopted (to stop)
    reason: str                         # what was decided, in one line


def decide(state: AgentState | None, machine_id: str, live: dict[int, int]) -> Adoption:
    """What a new agent of `machine_id` adopts from `state` (None: no file, or one unreadable),
    `live` being the start ticks of every recorded pid that is alive now (absent: gone)."""
    if state is None:
        return Adoption((), (), "no workers recorded in the work directory")
    same = tuple(w.pid for w in state.workers if live.get(w.pid) == w.start_ticks)
    if state.machine != machine_id:
        return Adoption((), same, f"the recorded workers are machine {state.machine}'s, not {machine_id}'s")
    if state.run is None or not state.workers:
        return Adoption((), same, "the previous agent ran no workers")
    for w in sorted(state.workers, key=lambda w: w.rank):
        if w.pid not in live:
            return Adoption((), same, f"rank {w.rank} (pid {w.pid}) of run {state.run} is gone")
        if live[w.pid] != w.start_ticks:
            return Adoption((), same, f"rank {w.rank}'s pid {w.pid} is another process now (a recycled pid)")
    return Adoption(tuple(state.workers), (), f"adopting run {state.run}: ranks "
                    + ", ".join(f"{w.rank} (pid {w.pid})" for w in sorted(state.workers, key=lambda w: w.rank)))


# -- the edges: /proc, the state file, an adopted process ---------------------------------------------------------
def start_ticks(pid: int) -> int | None:
    """The kernel's start time of `pid` (None: no such process, or a zombie that is done)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def live_of(state: AgentState | None) -> dict[int, int]:
    """The start ticks of the recorded workers still alive."""
    out = {}
    for w in state.workers if state else ():
        t = start_ticks(w.pid)
        if t is not None:
            out[w.pid] = t
    return out


def leftovers(workdir: str) -> list[int]:
    """The live processes the state file of `workdir` names (its fork servers and workers, each
    verified by its start time): what a machine's agent may have left when it was killed."""
    state = load(workdir)
    if state is None:
        return []
    pairs = list(state.fork_servers) + [(w.pid, w.start_ticks) for w in state.workers]
    return [pid for pid, t in pairs if start_ticks(pid) == t]


def load(workdir: str) -> AgentState | None:
    try:
        with open(os.path.join(workdir, STATE), "rb") as f:
            return msgspec.json.decode(f.read(), type=AgentState)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def save(workdir: str, state: AgentState) -> None:
    """Write the state file atomically (a crash mid-write leaves the previous one)."""
    path = os.path.join(workdir, STATE)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(state))
    os.replace(tmp, path)


def children(pid: int) -> list[int]:
    """The pids of `pid`'s children (none when it is gone)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    except OSError:
        return []
    return out


UNKNOWN_EXIT = -9       # an adopted worker whose exit code nobody noted (reported as killed)


class AdoptedProcess(ForkedProcess):
    """A worker started by an earlier agent, its exit noted by the fork or exec server that started it
    (`<exits_dir>/<pid>`, see forkserver.py). Waits with a pidfd: not a child of this process."""

    def __init__(self, pid: int, exits_dir: str):
        super().__init__(pid)
        self._exits_dir = exits_dir
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except OSError:
            self._fd = None
        threading.Thread(target=self._wait, name=f"adopted-{pid}", daemon=True).start()

    def _wait(self) -> None:
        if self._fd is not None:
            select.select([self._fd], [], [])
            os.close(self._fd)
        path = os.path.join(self._exits_dir, str(self.pid))
        deadline = time.monotonic() + 5.0      # its server reaps it at once (on SIGCHLD)
        code = UNKNOWN_EXIT
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    code = int(f.read().strip())
                break
            except (OSError, ValueError):
                time.sleep(0.02)
        self._set(code)

    def exited(self) -> bool:
        return self.returncode is not None or start_ticks(self.pid) is None
