"""Where a machine keeps what must not outlive it (light: no torch import).

A machine's checkpoint memory lives in shared memory (`/dev/shm/stalwart-<hash of its workdir>`)
so that it survives its agent. The agent writes its workdir into `owner` there: memory whose
workdir is gone belongs to nobody (a killed test or `stalwart run` whose directory was removed)
and `stalwart cleanup --orphans` frees it.

The directory's name is predictable (anyone on the host can compute it), so it is made with
`mkdir` (exclusive, mode 0700) and, when it exists already (the agent restarted), used only if
it is a real directory (not a symlink) owned by this user; a looser mode of its own is tightened.
"""
from __future__ import annotations

import glob
import hashlib
import os
import stat

from stalwart.errors import StalwartError

SHM = "/dev/shm"
PREFIX = "stalwart-"
OWNER = "owner"


def ckpt_root(workdir: str, shm: str = SHM) -> str:
    """The shared-memory directory of the machine whose agent works in `workdir`."""
    base = shm if os.path.isdir(shm) else os.path.join(workdir, "shm")
    return os.path.join(base, PREFIX + hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:12])


def claim(workdir: str, shm: str = SHM) -> str:
    """Create the machine's memory directory and note its owner; returns the directory."""
    root = ckpt_root(workdir, shm)
    os.makedirs(os.path.dirname(root), exist_ok=True)
    secure_dir(root)
    tmp = os.path.join(root, OWNER + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.path.abspath(workdir))
    os.replace(tmp, os.path.join(root, OWNER))
    return root


class UnsafeDir(StalwartError, RuntimeError):
    """A checkpoint directory that someone else could read or swap (the message says why)."""


def secure_dir(path: str) -> str:
    """Make `path` a directory only this user can use: created exclusively (0700), or, when it
    exists, checked without following a symlink: a directory owned by this user (its mode
    tightened to 0700). Raises UnsafeDir otherwise."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDir(f"{path} is a symlink (to {os.readlink(path)}): refusing to keep checkpoints there")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDir(f"{path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDir(f"{path} belongs to uid {st.st_uid}, not to this agent's uid {os.geteuid()}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700, follow_symlinks=False) if os.chmod in os.supports_follow_symlinks \
            else os.chmod(path, 0o700)
    return path


def orphans(shm: str = SHM) -> list[str]:
    """Memory directories whose owner's workdir no longer exists (unknown owners are kept)."""
    out = []
    for root in sorted(glob.glob(os.path.join(shm, PREFIX + "*"))):
        try:
            with open(os.path.join(root, OWNER)) as f:
                workdir = f.read().strip()
        except OSError:
            continue
        if workdir and not os.path.isdir(workdir):
            out.append(root)
    return out
