"""Hot update plumbing for the job runner: is a code dir versionable, and the env a version runs in.

The decisions (when a version is due, when to roll back, when it is proven) are pure functions in
`versions.py`; the snapshots and the table live there too.
"""
from __future__ import annotations

import logging
import os
import time

from stalwart.controller import versions

log = logging.getLogger("stalwart.controller")

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
        moved = self.run_seq > 0 and row["path"] != self.code_path
        self.version, self.code_path = row, row["path"]
        if moved:      # the standbys' warm workers hold the old code: warm them up on this one
            for m in self.standby:
                self._prewarm(m)

    # -- spares on the coming version ------------------------------------------------------------
    def _update_ready(self, now: float) -> bool:
        """Is a due code version to be applied now? Before it is, every machine of the run starts
        spare workers on it while training goes on, so the restart that applies it is warm; a
        due version waits for them at most `hot_update_prewarm_s`."""
        vs = self.versions.list(self.job_id)
        lead = self.spec.policy.hot_update_prewarm_s
        want = versions.to_prewarm(vs, now, lead) if lead > 0 else None
        p = self.spares_prep
        if want is not None and (p is None or p["version"] != want["id"] or p["run"] != self.run_seq):
            self._prepare_spares(want, now)
        due = versions.due_update(vs, now, at_failure=False)
        if due is None:
            return False
        p = self.spares_prep
        if p is None or p["version"] != due["id"]:
            return True
        if set(self.slots) <= p["ready"]:
            return True
        if now - p["sent"] >= lead:
            log.warning("job %s: spares for version %s not ready on %s after %.0fs; restarting cold",
                        self.job_id, due["id"], sorted(set(self.slots) - p["ready"]), lead)
            return True
        return False

    def _prepare_spares(self, v: dict, now: float) -> None:
        self.spares_prep = {"version": v["id"], "path": v["path"], "sent": now, "run": self.run_seq,
                            "ready": set()}
        env = self._common_env(run=None, port=None, version=v)
        for m in self.slots:
            self.ctl.send(m, {"type": "spares", "command": self.spec.command, "cwd": v["path"],
                              "count": self.G, "env": env})
        self.event("version_prewarm", {"version": v["id"], "machines": list(self.slots)}, t=now)

    def _agent_spares_ready(self, machine: str, ev: dict) -> None:
        p = self.spares_prep
        if p is None or ev.get("cwd") != p["path"] or machine in p["ready"]:
            return
        p["ready"].add(machine)
        if set(self.slots) <= p["ready"]:
            self.event("version_prewarmed", {"version": p["version"],
                                             "seconds": round(time.time() - p["sent"], 3)})

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

