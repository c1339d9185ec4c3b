"""Hot update plumbing for the job runner: is a code dir versionable, and the env a version runs in.

The decisions (when a version is due, when to roll back, when it is proven) are pure functions in
`versions.py`; the snapshots and the table live there too.
"""
from __future__ import annotations

import os
import time

from stalwart.controller import versions

SKIP_DIRS = {"__pycache__", ".git"}
MAX_FILES = 5000
MAX_BYTES = 256 << 20


def versionable(src: str | None, state_dir: str, max_files: int = MAX_FILES,
                max_bytes: int = MAX_BYTES) -> str | None:
    """None when `src` can be snapshotted as a code version, else why not (one line).

    A code dir that holds a virtualenv or data sets is not code: snapshotting it at every
    version would copy gigabytes, so hot update is switched off for such a job and says so.
    """
    if not src or not os.path.isdir(src):
        return f"code dir {src!r} does not exist"
    state = os.path.abspath(state_dir)
    files = size = 0
    for root, dirs, names in os.walk(src):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and os.path.abspath(os.path.join(root, d)) != state]
        for n in names:
            files += 1
            try:
                size += os.lstat(os.path.join(root, n)).st_size
            except OSError:
                pass
            if files > max_files or size > max_bytes:
                return (f"code dir {src} is too large to version (more than {max_files} files or "
                        f"{max_bytes >> 20} MiB; a virtualenv or data inside?): pass --code DIR with "
                        f"just the training code to enable hot update")
    return None if files else f"code dir {src} is empty"


def version_env(path: str, version_id: int | None) -> dict[str, str]:
    """Environment of workers running the code version at `path`."""
    env = {"PYTHONPATH": path + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    if version_id is not None:
        env["STALWART_CODE_VERSION"] = str(version_id)
    return env


class HotUpdateFlow:
    """Hot update in the job runner (a mixin of `JobRunner`): versions registered by `stalwart
    update`, applied in place from the in-memory checkpoint (urgent: now; lazy: at the next
    failure's restart or when the window expires), rolled back by `_localize` when they fail."""

    def _use_version(self, row: dict) -> None:
        self.version, self.code_path = row, row["path"]

    def register_version(self, src: str, mode: str, window_s: float | None) -> dict:
        """`stalwart update`: snapshot a new code version (called from the API thread)."""
        if self.versioning_off:
            raise ValueError(f"hot update is off for this job: {self.versioning_off}")
        row = self.versions.register(self.job_id, src, self.ctl.state_dir, mode, window_s, time.time())
        self.event("version_registered", {"version": row["id"], "mode": mode, "hash": row["hash"]})
        return row

    def _due_version(self, now: float, at_failure: bool) -> dict | None:
        return versions.due_update(self.versions.list(self.job_id), now, at_failure)

    def _apply_update(self, inc: dict, now: float) -> None:
        """A planned restart: the same machines, the new code, the in-memory checkpoint."""
        due = self._due_version(now, at_failure=False)
        self.incident = None
        self.awaiting_resume.append(inc["id"])
        if due is not None:
            self._use_version(self.versions.apply(due["id"], now, self.steps_done,
                                                  f"{due['mode']} hot update"))
        self.store.update_incident(inc["id"], mechanism="hot_update", localized_at=now, suspects=[],
                                   cause=f"hot update to version {self.version['id']} "
                                         f"({self.version['hash'][:12]}, {self.version['mode']})")
        self.event("incident_localized", {"incident": inc["id"], "mechanism": "hot_update"}, t=now)
        self.event("version_applied", {"version": self.version["id"], "incident": inc["id"]})
        self._restart()

