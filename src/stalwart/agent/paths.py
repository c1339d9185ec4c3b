"""Where a machine keeps what must not outlive it (light: no torch import)."""
from __future__ import annotations

import hashlib
import os


def ckpt_root(workdir: str) -> str:
    """The shared-memory directory of the machine whose agent works in `workdir`."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.path.join(workdir, "shm")
    return os.path.join(base, "stalwart-" + hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:12])
