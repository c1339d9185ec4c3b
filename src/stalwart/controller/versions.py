"""Code versions of a job, for hot update and rollback (DESIGN.md "Hot update", papers.md §1.7.1).

A code version is an immutable snapshot of the job's code directory, named by a content hash and
kept read-only under ``<state_dir>/versions/<hash>/``. Every version of every job is a row of the
``code_versions`` table, so each modification stays traceable and reproducible.

Life of a version (``status``):

- ``stable``      trusted: the first version of a job (registered by the job runner at submit), or
                  an applied version that completed ``n`` healthy steps (``promote_if_healthy``);
- ``pending``     registered, waiting: mode ``lazy`` (applied at the next failure's restart, or when
                  its window expires) or ``window`` (applied only when its window expires);
- ``urgent``      registered with mode ``urgent``: due at once (stop and apply);
- ``applied``     the workers run it now, not yet proven healthy;
- ``rolled-back`` it was running and the job went back to the last stable version;
- ``failed``      it could not be applied (or was abandoned while running);
- ``superseded``  a newer version was applied before it (a snapshot is the whole code, so the newer
                  one already holds it: the "aggregated" update of the paper).

Decision logic is pure (``is_due``, ``due_update``, ``rollback_reason``, ``after_failure``,
``is_healthy``, ``current_version``, ``last_stable_version``): plain dicts and an explicit ``now``.
``Versions`` is the store side; ``snapshot`` the file-system side.

The table is declared on ``stalwart.controller.store.META``: import this module before creating the
``Store`` and ``META.create_all`` creates it. ``Versions(store)`` also creates it if it is missing
(a store created before this module was imported).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from typing import Any, Iterable, Mapping

import sqlalchemy as sa

from stalwart.controller.store import META

STATUSES = ("stable", "pending", "urgent", "applied", "rolled-back", "failed", "superseded")
MODES = ("lazy", "urgent", "window")
WAITING = ("pending", "urgent")
RUNNING = ("applied", "stable")
PROMOTE_AFTER_STEPS = 20
IGNORED_DIRS = frozenset({"__pycache__", ".git"})
IGNORED_SUFFIXES = (".pyc",)

# status -> statuses it may move to with `mark`
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "pending": ("applied", "failed", "superseded", "urgent"),
    "urgent": ("applied", "failed", "superseded"),
    "applied": ("stable", "rolled-back", "failed"),
    "stable": ("rolled-back",),
    "rolled-back": (),
    "failed": (),
    "superseded": (),
}

code_versions = sa.Table(
    "code_versions", META,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False, index=True),
    sa.Column("hash", sa.String(64), nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("source", sa.Text, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("mode", sa.String(16), nullable=False),
    sa.Column("window_s", sa.Float),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("applied_at", sa.Float),
    sa.Column("applied_step", sa.Integer),
    sa.Column("reason", sa.Text),
)


# -- snapshots (file system) ----------------------------------------------------------------------

def _entries(root: str, exclude: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(relative posix path, absolute path) of every file and symlink under root, sorted, ignored
    names and the `exclude` directories (absolute paths) left out. Symlinks are kept as links
    (never followed), so a link loop cannot hang us."""
    skip = {os.path.abspath(e) for e in exclude}
    out: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if d in IGNORED_DIRS or full in skip:
                continue
            if os.path.islink(full):            # a symlinked directory: recorded as a link
                filenames.append(d)
            else:
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            if f.endswith(IGNORED_SUFFIXES):
                continue
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            out.append((rel, full))
    out.sort()
    return out


def _file_digest(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.digest()


def _entry_digest(full: str, rel: str) -> bytes:
    """Digest of one entry's bytes: a regular file's content or a symlink's target text."""
    st = os.lstat(full)
    if stat.S_ISLNK(st.st_mode):
        return hashlib.sha256(b"symlink\0" + os.readlink(full).encode()).digest()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{rel} is neither a file nor a symlink; a code directory holds only those")
    return _file_digest(full)


def _check_dir(src_dir: str) -> str:
    if not isinstance(src_dir, (str, os.PathLike)) or not str(src_dir):
        raise ValueError(f"code directory must be a path (got {src_dir!r})")
    src = os.path.abspath(os.path.expanduser(os.fspath(src_dir)))
    if not os.path.exists(src):
        raise ValueError(f"code directory {src} does not exist")
    if not os.path.isdir(src):
        raise ValueError(f"code directory {src} is not a directory")
    return src


def tree_hash(directory: str, exclude: Iterable[str] = ()) -> str:
    """sha256 (hex) over the sorted relative paths and the bytes of every file under `directory`,
    ignoring __pycache__, .git, *.pyc and the `exclude` directories; a symlink counts by its target
    text. Equal for a source directory and its snapshot. ValueError for a missing or empty one."""
    root = _check_dir(directory)
    entries = _entries(root, exclude)
    if not entries:
        raise ValueError(f"code directory {root} holds no files (after ignoring __pycache__, .git, *.pyc)")
    h = hashlib.sha256()
    for rel, full in entries:
        h.update(rel.encode() + b"\0" + _entry_digest(full, rel))
    return h.hexdigest()


def _make_read_only(root: str) -> None:
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for f in filenames:
            full = os.path.join(dirpath, f)
            if not os.path.islink(full):
                mode = os.lstat(full).st_mode
                os.chmod(full, 0o555 if mode & stat.S_IXUSR else 0o444)
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, 0o555)
    os.chmod(root, 0o555)


def remove_tree(path: str) -> None:
    """Delete a snapshot (or a half-made one), making its read-only directories writable first."""
    if not os.path.lexists(path):
        return
    for dirpath, dirnames, _ in os.walk(path):
        os.chmod(dirpath, 0o755)
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, 0o755)
    shutil.rmtree(path)


def snapshot(src_dir: str, state_dir: str) -> tuple[str, str]:
    """Copy `src_dir` into an immutable snapshot ``<state_dir>/versions/<hash>/`` (read-only files
    and directories) and return ``(hash, path)``.

    The copy is made in a temporary directory beside the target and renamed into place, so a
    snapshot either exists whole or not at all; the hash is taken over the bytes actually copied.
    A snapshot with the same hash is reused. A state dir inside the code dir (the default
    ``.stalwart`` in the working directory) is left out of the snapshot. Raises ValueError for a
    missing or empty directory."""
    src = _check_dir(src_dir)
    state = os.path.abspath(os.path.expanduser(os.fspath(state_dir)))
    if state == src:
        raise ValueError(f"state directory {state} is the code directory itself; use another one")
    entries = _entries(src, exclude=(state,))
    if not entries:
        raise ValueError(f"code directory {src} holds no files (after ignoring __pycache__, .git, *.pyc)")
    base = os.path.join(state, "versions")
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=base)
    try:
        h = hashlib.sha256()
        for rel, full in entries:
            dst = os.path.join(tmp, *rel.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(full)
                os.symlink(target, dst)
                digest = hashlib.sha256(b"symlink\0" + target.encode()).digest()
            elif stat.S_ISREG(st.st_mode):
                fh = hashlib.sha256()
                with open(full, "rb") as fin, open(dst, "wb") as fout:
                    for chunk in iter(lambda: fin.read(1 << 20), b""):
                        fh.update(chunk)
                        fout.write(chunk)
                os.chmod(dst, st.st_mode & 0o777)
                digest = fh.digest()
            else:
                raise ValueError(f"{rel} is neither a file nor a symlink; a code directory holds only those")
            h.update(rel.encode() + b"\0" + digest)
        digest_hex = h.hexdigest()
        final = os.path.join(base, digest_hex)
        if os.path.isdir(final):
            return digest_hex, final
        _make_read_only(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):        # not a concurrent snapshot of the same content
                raise
        return digest_hex, final
    finally:
        remove_tree(tmp)


# -- pure decisions -------------------------------------------------------------------------------

def _by_id(versions: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(versions, key=lambda v: v["id"])


def current_version(versions: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The version the workers run now: of the applied and stable versions, the one applied last
    (a rolled-back version drops out, so the last stable one is current again)."""
    running = [v for v in versions if v["status"] in RUNNING]
    if not running:
        return None
    return max(running, key=lambda v: (v["applied_at"] if v["applied_at"] is not None else v["created_at"],
                                       v["id"]))


def last_stable_version(versions: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The stable version applied last (the rollback target), or None."""
    stable = [v for v in versions if v["status"] == "stable"]
    return current_version(stable)


def is_due(version: Mapping[str, Any], now: float, at_failure: bool) -> bool:
    """Whether one waiting version should be applied now.

    urgent: at once; lazy: at the restart after a failure (``at_failure``) or when
    ``created_at + window_s <= now``; window: only when its window has expired. A version with no
    window (``window_s`` None) waits for a failure (lazy) or forever (window)."""
    if version["status"] not in WAITING:
        return False
    if version["status"] == "urgent" or version["mode"] == "urgent":
        return True
    if version["mode"] == "lazy" and at_failure:
        return True
    window = version["window_s"]
    return window is not None and version["created_at"] + window <= now


def due_update(versions: Iterable[Mapping[str, Any]], now: float,
               at_failure: bool) -> Mapping[str, Any] | None:
    """The waiting version to apply now, or None: the newest of the due ones (applying it
    supersedes the older waiting versions, whose changes it holds)."""
    due = [v for v in _by_id(versions) if is_due(v, now, at_failure)]
    return due[-1] if due else None


def to_prewarm(versions: Iterable[Mapping[str, Any]], now: float,
               lead_s: float) -> Mapping[str, Any] | None:
    """The waiting version whose spare workers should be warming now, or None: the newest one that
    is due or will be at the next restart (urgent, lazy) or whose window ends within `lead_s`.

    A window version is not warmed earlier: until then every restart runs the current code, and
    spares of another version would make those restarts cold."""
    def soon(v: Mapping[str, Any]) -> bool:
        if v["status"] == "urgent" or v["mode"] in ("urgent", "lazy"):
            return True
        return v["window_s"] is not None and v["created_at"] + v["window_s"] - lead_s <= now
    waiting = [v for v in _by_id(versions) if v["status"] in WAITING and soon(v)]
    return waiting[-1] if waiting else None


def _since(history: Iterable[Mapping[str, Any]], t0: float, now: float) -> list[Mapping[str, Any]]:
    out = [h for h in history if h.get("detected_at") is not None and t0 <= h["detected_at"] <= now]
    return sorted(out, key=lambda h: (h["detected_at"], h.get("id") or 0))


def rollback_reason(current: Mapping[str, Any] | None, history: Iterable[Mapping[str, Any]],
                    now: float) -> str | None:
    """Why the current version must be rolled back, or None.

    `history` holds the job's incidents as plain dicts (``detected_at``, ``category``,
    ``mechanism``, ``evicted``, ``symptom``, ``cause``), the failure being handled included.
    Roll back when the current version is ``applied`` (not yet stable) and, since it was applied,
    the latest failure is a user-code error, or it is a failure without a machine to blame that
    follows a reattempt (the crash came back on checked machines)."""
    if current is None or current["status"] != "applied":
        return None
    t0 = current["applied_at"] if current["applied_at"] is not None else current["created_at"]
    since = _since(history, t0, now)
    if not since:
        return None
    last = since[-1]
    what = last.get("cause") or last.get("symptom") or "unknown failure"
    name = f"version {current['id']} ({current['hash'][:12]})"
    if last.get("category") == "user_code":
        return f"user-code error after {name} was applied: {what}"
    if last.get("evicted"):
        return None                             # a machine fault: the code is not to blame
    if any(h.get("mechanism") == "reattempt" for h in since[:-1]):
        return f"failed again after a reattempt since {name} was applied: {what}"
    return None


def after_failure(current: Mapping[str, Any] | None, history: Iterable[Mapping[str, Any]],
                  now: float) -> str | None:
    """"rollback" when the failure just seen is to be answered by rolling the code back to the
    last stable version (see ``rollback_reason`` for the why), else None."""
    return "rollback" if rollback_reason(current, history, now) else None


def is_healthy(version: Mapping[str, Any] | None, step: int, n: int = PROMOTE_AFTER_STEPS) -> bool:
    """Whether an applied version has completed `n` steps since it was applied (at
    ``applied_step``) and so earns ``stable``."""
    if n < 1:
        raise ValueError(f"steps before promotion must be >= 1 (got {n})")
    if version is None or version["status"] != "applied" or version["applied_step"] is None:
        return False
    return step - version["applied_step"] >= n


# -- the store side -------------------------------------------------------------------------------

class Versions:
    """Records of code versions in the controller's store (SQLite or PostgreSQL)."""

    def __init__(self, store: Any):
        self.store = store
        self.engine: sa.Engine = store.engine
        code_versions.create(self.engine, checkfirst=True)

    def _select(self, query) -> list[dict]:
        with self.engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(query)]

    def get(self, version_id: int) -> dict | None:
        """One version by id, or None."""
        rows = self._select(sa.select(code_versions).where(code_versions.c.id == version_id))
        return rows[0] if rows else None

    def list(self, job_id: int) -> list[dict]:
        """Every version of a job, oldest first."""
        return self._select(sa.select(code_versions).where(code_versions.c.job_id == job_id)
                            .order_by(code_versions.c.id))

    def current(self, job_id: int) -> dict | None:
        """The version the job's workers run now (see ``current_version``)."""
        v = current_version(self.list(job_id))
        return dict(v) if v is not None else None

    def last_stable(self, job_id: int) -> dict | None:
        """The stable version applied last: the rollback target."""
        v = last_stable_version(self.list(job_id))
        return dict(v) if v is not None else None

    def register(self, job_id: int, src_dir: str, state_dir: str, mode: str,
                 window_s: float | None, now: float) -> dict:
        """Snapshot `src_dir` and record it as a version of the job; return the row.

        The job's first version is ``stable`` (applied at `now`). A later one is ``urgent`` (mode
        urgent) or ``pending`` (lazy / window, applied per ``is_due``). Content identical to the
        current version returns the current row; identical to a waiting version returns that row
        (raised to urgent if asked). Raises ValueError for a bad mode, window or directory."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
        if window_s is not None:
            if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) \
                    or window_s != window_s or window_s < 0:
                raise ValueError(f"window_s must be a number of seconds >= 0 or None (got {window_s!r})")
            window_s = float(window_s)
        if mode == "window" and window_s is None:
            raise ValueError("mode 'window' needs window_s (seconds after which the version is applied)")
        digest, path = snapshot(src_dir, state_dir)
        source = os.path.abspath(os.path.expanduser(os.fspath(src_dir)))
        with self.engine.begin() as c:
            rows = [dict(r._mapping) for r in c.execute(
                sa.select(code_versions).where(code_versions.c.job_id == job_id)
                .order_by(code_versions.c.id))]
            cur = current_version(rows)
            if cur is not None and cur["hash"] == digest:
                return dict(cur)
            same = [r for r in rows if r["status"] in WAITING and r["hash"] == digest]
            if same:
                row = same[-1]
                if mode == "urgent" and row["status"] != "urgent":
                    c.execute(code_versions.update().where(code_versions.c.id == row["id"])
                              .values(status="urgent", mode="urgent",
                                      reason="registered again as urgent"))
                    row = {**row, "status": "urgent", "mode": "urgent",
                           "reason": "registered again as urgent"}
                return row
            first = not rows
            values = dict(job_id=job_id, hash=digest, path=path, source=source, mode=mode,
                          window_s=window_s, created_at=now)
            if first:
                values.update(status="stable", applied_at=now, applied_step=0,
                              reason="first version of the job")
            else:
                values.update(status="urgent" if mode == "urgent" else "pending")
            res = c.execute(code_versions.insert().values(**values))
            vid = res.inserted_primary_key[0]
        return self.get(vid)  # type: ignore[return-value]

    def mark(self, version_id: int, status: str, reason: str | None, now: float,
             step: int | None = None) -> dict:
        """Move a version to `status` (only along ``TRANSITIONS``) with a reason; ``applied``
        records ``applied_at`` = now and ``applied_step`` = step. Returns the updated row."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)} (got {status!r})")
        with self.engine.begin() as c:
            row = c.execute(sa.select(code_versions).where(code_versions.c.id == version_id)).first()
            if row is None:
                raise ValueError(f"no code version {version_id}")
            old = row._mapping["status"]
            if status not in TRANSITIONS[old]:
                allowed = ", ".join(TRANSITIONS[old]) or "nothing (final)"
                raise ValueError(f"code version {version_id} is {old}; it can become {allowed}, not {status}")
            values: dict[str, Any] = {"status": status, "reason": reason}
            if status == "applied":
                values.update(applied_at=now, applied_step=step)
            elif status == "urgent":
                values.update(mode="urgent")
            c.execute(code_versions.update().where(code_versions.c.id == version_id).values(**values))
        return self.get(version_id)  # type: ignore[return-value]

    def apply(self, version_id: int, now: float, step: int | None = None,
              reason: str = "hot update") -> dict:
        """Mark a waiting version ``applied`` (the workers restart on it at `step`) and every older
        waiting version of the job ``superseded``. Returns the applied row."""
        row = self.mark(version_id, "applied", reason, now, step=step)
        for v in self.list(row["job_id"]):
            if v["id"] < version_id and v["status"] in WAITING:
                self.mark(v["id"], "superseded", f"superseded by version {version_id}", now)
        return row

    def rollback(self, job_id: int, reason: str, now: float) -> dict:
        """Mark the current version ``rolled-back`` with `reason`; return the last stable version,
        which is current again. Raises ValueError when there is nothing to roll back to."""
        cur = self.current(job_id)
        if cur is None:
            raise ValueError(f"job {job_id} has no running code version to roll back")
        target = last_stable_version([v for v in self.list(job_id) if v["id"] != cur["id"]])
        if target is None:
            raise ValueError(f"job {job_id} has no stable code version to roll back to")
        self.mark(cur["id"], "rolled-back", reason, now)
        return dict(target)

    def promote_if_healthy(self, job_id: int, step: int, now: float,
                           n: int = PROMOTE_AFTER_STEPS) -> dict | None:
        """Promote the current version to ``stable`` once it has run `n` steps since it was
        applied; return the promoted row, or None when nothing changed."""
        cur = self.current(job_id)
        if not is_healthy(cur, step, n):
            return None
        return self.mark(cur["id"], "stable",  # type: ignore[index]
                         f"{step - cur['applied_step']} steps completed since applied", now)
