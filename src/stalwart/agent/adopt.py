"""A restarted agent takes over the workers its predecessor left running.

An agent that dies (a crash, an OOM kill, a supervisor's restart) leaves its run's workers
training: they outlive it for a bound (their link to the agent waits for it to come back, see
worker/link.py; the fork server that forked them keeps them and notes their exits). The agent
writes what it runs to `<workdir>/workers.json` (the machine, the job, the run, and each worker's
pid, rank, start time and log files) every time that changes. The next agent on the same work
directory reads it and decides here, purely, what it adopts:

- everything, when every recorded worker is still the same live process (pid *and* kernel start
  time, read from /proc: a recycled pid is never adopted) and the file is this machine's;
- nothing otherwise, with the reason in one line (no record, another machine's, no run, a rank
  gone): its live leftovers are then stopped and the normal path applies (the controller hears a
  machine without the run and recovers as for a failed machine).

The adopted workers are re-registered as `running_run`/`ranks`, so the controller sees its run
still complete and books nothing.
"""
from __future__ import annotations

import os

import msgspec

STATE = "workers.json"


class WorkerRecord(msgspec.Struct, frozen=True):
    pid: int
    rank: int
    local_rank: int
    start_ticks: int            # /proc/PID/stat field 22: when the process started (clock ticks since boot)
    out_path: str
    err_path: str
    forked: bool = False        # forked by the fork server (which notes its exit code: see forkserver.py)


class AgentState(msgspec.Struct, frozen=True):
    machine: str
    agent_pid: int
    job: int | None = None
    run: int | None = None
    workers: tuple[WorkerRecord, ...] = ()
    last_step: dict[int, int] = {}


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


# -- the edges: /proc and the state file ---------------------------------------------------------
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
