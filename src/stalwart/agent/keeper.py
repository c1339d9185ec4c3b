"""The agent's keeper: the process that starts the agent and starts it again when it dies.

An agent that dies leaves its workers training (their fork server outlives it), and the next
agent on the same work directory adopts them within the heartbeat limit (agent/adopt.py): the job
never notices, provided something starts that next agent at once. On a host that is systemd's job
(`Restart=always`). In a container it is not: the agent is the container's main process, its death
ends the container, and the container's end kills every process in it, workers included (on
Kubernetes the pod fails and the controller replaces the machine; under Slurm the step ends and
its cgroup goes). So the agent pods and Slurm's agent steps run the agent under this keeper:

- the keeper starts the agent as its child and, when it ends by a signal or an error, starts it
  again after a pause (0.5 s, doubling while it keeps dying at once, at most 10 s; back to 0.5 s
  after a minute of life), so a crash costs about a second, well inside the heartbeat limit;
- an agent that exits 0 (asked to stop), 2 (a usage error: it would fail again) or 137 (it
  played a lost machine, chaos `machine-down`: the machine's processes are gone, the keeper too)
  ends the keeper with its code;
- SIGTERM, SIGINT and SIGHUP are passed on to the agent, and the keeper ends with it (a pod
  deleted, a step cancelled);
- it is its descendants' reaper (`PR_SET_CHILD_SUBREAPER`; as a container's process 1 it is the
  reaper anyway): the fork server and the workers a dead agent leaves are reparented to it, and it
  reaps whatever ends, so nothing stays a zombie. A worker's exit code is still its fork server's
  to note (the fork server is its parent), so adoption sees it as without the keeper.

Standard library only, no import of stalwart: it runs in any interpreter that can run the agent.
``python -m stalwart.agent.keeper -- CMD ARGS...``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

FIRST_PAUSE_S, MAX_PAUSE_S, HEALTHY_S = 0.5, 10.0, 60.0
MACHINE_DOWN_CODE = 137         # the agent's exit when it plays a lost machine (chaos `machine-down`)
FINAL_CODES = (0, 2, MACHINE_DOWN_CODE)     # asked to stop; a usage error; the machine is gone
PR_SET_CHILD_SUBREAPER = 36


def _say(msg: str) -> None:
    sys.stderr.write(f"stalwart keeper: {msg}\n")
    sys.stderr.flush()


def subreaper() -> bool:
    """Become the reaper of this process's orphaned descendants (Linux); False where it cannot."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def next_pause(pause: float, lived_s: float) -> float:
    """The pause before the next start, after an agent that lived `lived_s` seconds and the pause
    before its own start (0: it was the first)."""
    return FIRST_PAUSE_S if lived_s >= HEALTHY_S or pause <= 0 else min(MAX_PAUSE_S, pause * 2)


def keep(argv: list[str]) -> int:
    """Run `argv` (the agent's command line) until it ends for good; returns its last exit code."""
    if not argv:
        _say("no command given")
        return 2
    subreaper()
    stopping: list[int] = []
    agent = [0]

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        if agent[0]:
            try:
                os.kill(agent[0], signum)
            except ProcessLookupError:
                pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    pause = 0.0
    while True:
        began = time.monotonic()
        try:
            agent[0] = os.posix_spawnp(argv[0], argv, os.environ)
        except OSError as e:
            _say(f"cannot start {argv[0]}: {e.strerror or e}")
            return 127
        code = None
        while code is None:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:        # (not reached while the agent runs)
                break
            if pid == agent[0]:
                code = os.waitstatus_to_exitcode(status)     # (minus the signal number)
            # else an orphan the dead agent left (its fork server, a check) ended: reaped
        agent[0] = 0
        lived = time.monotonic() - began
        if code is None or stopping or code in FINAL_CODES:
            return 1 if code is None else code
        pause = next_pause(pause, lived)
        what = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        _say(f"the agent {what} after {lived:.1f}s: starting it again in {pause:.1f}s")
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline and not stopping:
            _reap_orphans()
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if stopping:
            return 128 + stopping[0]


def _reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--"]:
        args = args[1:]
    return keep(args)


if __name__ == "__main__":
    sys.exit(main())
