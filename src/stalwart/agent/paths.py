"""Where a machine keeps what must not outlive it (light: no torch import).

A machine's checkpoint memory lives in shared memory (`/dev/shm/stalwart-<hash of its workdir>`)
so that it survives its agent. The agent writes its workdir into `owner` there: memory whose
workdir is gone belongs to nobody (a killed test or `stalwart run` whose directory was removed)
and `stalwart cleanup --orphans` frees it.
"""
from __future__ import annotations

import glob
import hashlib
import os

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
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, OWNER + ".tmp")
    with open(tmp, "w") as f:
        f.write(os.path.abspath(workdir))
    os.replace(tmp, os.path.join(root, OWNER))
    return root


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
