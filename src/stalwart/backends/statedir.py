"""One `stalwart run` per state directory at a time.

A second `stalwart run` on a state dir whose first one still runs would start a second controller
on the same database and a second set of agents on the same machine directories (and with
`--fresh`, delete the running job's state under it). `stalwart run` holds an exclusive lock on
`<state-dir>/run.lock` for its whole life instead; the kernel drops it when the process ends, also
by a crash or SIGKILL, so a lock is never stale. The file names the holder (pid, start time,
command) for the refusal message.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time

from stalwart.errors import StalwartError

LOCK_NAME = "run.lock"
DB_NAME = "stalwart.db"         # the controller's database in a state dir (SQLite unless --db says)


def db_path(state_dir: str) -> str:
    """The absolute path of the state dir's database."""
    return os.path.abspath(os.path.join(state_dir, DB_NAME))


def db_url(state_dir: str) -> str:
    """The SQLAlchemy URL of the state dir's database."""
    return f"sqlite:///{db_path(state_dir)}"


class StateDirBusy(StalwartError, RuntimeError):
    """Another live `stalwart run` holds the state dir."""


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            info = json.load(f)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["t"]))
        return f"pid {info['pid']}, started {when}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"


class StateDirLock:
    """The exclusive lock of one state dir, held while the object lives (or until `release`)."""

    def __init__(self, state_dir: str):
        self.state_dir = os.path.abspath(state_dir)
        self.path = os.path.join(self.state_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> "StateDirLock":
        """Take the lock, or raise StateDirBusy naming the holder."""
        os.makedirs(self.state_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateDirBusy(
                f"state dir {self.state_dir} is in use by another `stalwart run` ({_holder(self.path)}); "
                "wait for it to end, stop it (Ctrl-C in its terminal), or pass another --state-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "t": time.time(), "argv": sys.argv}).encode())
        self._fd = fd
        return self

    def held_elsewhere(self) -> str | None:
        """Who holds the lock, if a live process other than this object does (without taking it)."""
        if self._fd is not None or not os.path.exists(self.path):
            return None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(self.path)
        finally:
            os.close(fd)
        return None

    def clear(self) -> None:
        """Delete everything in the state dir but the lock (`--fresh`); the lock must be held."""
        if self._fd is None:
            raise RuntimeError("clear() without the lock")
        for name in os.listdir(self.state_dir):
            if name == LOCK_NAME:
                continue
            path = os.path.join(self.state_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)           # (closing the file drops the lock)
            self._fd = None
