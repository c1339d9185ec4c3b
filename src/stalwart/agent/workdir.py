"""One agent per work directory: a POSIX lock on `<workdir>/agent.lock` held for the agent's life.

Two agents on one directory would share its worker socket, its fork server and its checkpoint
memory, each undoing the other. The lock is `lockf` (a process's own: not inherited by the
workers it forks, released by the kernel when the agent dies however it dies), and the file names
the holder's pid and machine, so the second agent says which one is in the way.
"""
from __future__ import annotations

import fcntl
import os

from stalwart.errors import StalwartError

LOCK = "agent.lock"


class WorkdirInUse(StalwartError, RuntimeError):
    """Another live agent holds the work directory."""


def hold(workdir: str, machine_id: str) -> int:
    """Lock `workdir` for this agent; returns the lock's file descriptor (keep it open)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another agent"
        finally:
            os.close(fd)
        raise WorkdirInUse(f"the work directory {workdir} is in use by {holder}: stop that agent first or "
                           f"give this one another --workdir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"agent pid {os.getpid()} (machine {machine_id})\n".encode(), 0)
    return fd
