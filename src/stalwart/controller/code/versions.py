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

The table is declared on ``stalwart.controller.store.db.META``: import this module before creating the
``Store`` and ``META.create_all`` creates it. ``Versions(store)`` also creates it if it is missing
(a store created before this module was imported).
"""
from __future__ import annotations

import builtins
import os
from typing import Any, Iterable, Mapping

import sqlalchemy as sa

from stalwart.controller.code.tree import remove_tree, snapshot
from stalwart.controller.store.db import META

STATUSES = ("stable", "pending", "urgent", "applied", "rolled-back", "failed", "superseded")
MODES = ("lazy", "urgent", "window")
WAITING = ("pending", "urgent")
RUNNING = ("applied", "stable")
PROMOTE_AFTER_STEPS = 20

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


def marked(row: Mapping[str, Any], status: str, reason: str | None, now: float,
           step: int | None = None) -> dict:
    """`row` moved to `status` (only along ``TRANSITIONS``) with a reason; ``applied`` records
    ``applied_at`` = now and ``applied_step`` = step. A new dict; ValueError for a bad move."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)} (got {status!r})")
    old = row["status"]
    if status not in TRANSITIONS[old]:
        allowed = ", ".join(TRANSITIONS[old]) or "nothing (final)"
        raise ValueError(f"code version {row['id']} is {old}; it can become {allowed}, not {status}")
    out = dict(row, status=status, reason=reason)
    if status == "applied":
        out.update(applied_at=now, applied_step=step)
    elif status == "urgent":
        out.update(mode="urgent")
    return out


def applied_rows(rows: Iterable[Mapping[str, Any]], version_id: int, now: float, step: int | None,
                 reason: str) -> list[dict]:
    """The rows that change when a waiting version is applied: it (``applied``) and every older
    waiting version (``superseded``: a snapshot is the whole code, the newer one holds them)."""
    rows = _by_id(rows)
    target = next((r for r in rows if r["id"] == version_id), None)
    if target is None:
        raise ValueError(f"no code version {version_id}")
    out = [marked(target, "applied", reason, now, step)]
    out += [marked(r, "superseded", f"superseded by version {version_id}", now)
            for r in rows if r["id"] < version_id and r["status"] in WAITING]
    return out


def rolled_back_rows(rows: Iterable[Mapping[str, Any]], reason: str, now: float) -> tuple[dict, dict]:
    """(the current version marked ``rolled-back``, the last stable version to run again).
    ValueError when there is nothing to roll back to."""
    rows = list(rows)
    cur = current_version(rows)
    if cur is None:
        raise ValueError("no running code version to roll back")
    target = last_stable_version([v for v in rows if v["id"] != cur["id"]])
    if target is None:
        raise ValueError("no stable code version to roll back to")
    return marked(cur, "rolled-back", reason, now), dict(target)


def promoted_row(rows: Iterable[Mapping[str, Any]], step: int, now: float,
                 n: int = PROMOTE_AFTER_STEPS) -> dict | None:
    """The current version marked ``stable`` once it has run `n` steps since it was applied, or
    None when nothing changes."""
    cur = current_version(list(rows))
    if not is_healthy(cur, step, n):
        return None
    assert cur is not None
    return marked(cur, "stable", f"{step - cur['applied_step']} steps completed since applied", now)


# -- the store side -------------------------------------------------------------------------------

class Versions:
    """Records of code versions in the controller's store (SQLite or PostgreSQL)."""

    def __init__(self, store: Any):
        self.store = store
        self.engine: sa.Engine = store.engine
        code_versions.create(self.engine, checkfirst=True)

    def _select(self, query) -> list[dict]:
        return self.store.read(lambda c: [dict(r._mapping) for r in c.execute(query)])

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
        digest, path, skipped = snapshot(src_dir, state_dir)
        note = f"snapshot skipped {', '.join(skipped)}" if skipped else None
        source = os.path.abspath(os.path.expanduser(os.fspath(src_dir)))
        def go(c) -> tuple[dict | None, int | None]:
            rows = [dict(r._mapping) for r in c.execute(
                sa.select(code_versions).where(code_versions.c.job_id == job_id)
                .order_by(code_versions.c.id))]
            cur = current_version(rows)
            if cur is not None and cur["hash"] == digest:
                return dict(cur), None
            same = [r for r in rows if r["status"] in WAITING and r["hash"] == digest]
            if same:
                row = same[-1]
                if mode == "urgent" and row["status"] != "urgent":
                    c.execute(code_versions.update().where(code_versions.c.id == row["id"])
                              .values(status="urgent", mode="urgent",
                                      reason="registered again as urgent"))
                    row = {**row, "status": "urgent", "mode": "urgent",
                           "reason": "registered again as urgent"}
                return row, None
            first = not rows
            values = dict(job_id=job_id, hash=digest, path=path, source=source, mode=mode,
                          window_s=window_s, created_at=now)
            if first:
                values.update(status="stable", applied_at=now, applied_step=0,
                              reason="; ".join(filter(None, ["first version of the job", note])))
            else:
                values.update(status="urgent" if mode == "urgent" else "pending", reason=note)
            res = c.execute(code_versions.insert().values(**values))
            key = res.inserted_primary_key
            assert key is not None
            return None, int(key[0])
        found, vid = self.store.write(go)
        if found is not None:
            return found
        self.collect(state_dir)
        return self.get(vid)  # type: ignore[return-value]

    def collect(self, state_dir: str) -> "builtins.list[str]":
        """Delete the snapshots no job needs any more (one that is no job's current, last stable
        or waiting version: superseded, rolled back, failed, older stable ones); the rows stay,
        the history. Returns the paths removed."""
        rows = self.store.read(lambda c: [dict(r._mapping) for r in c.execute(sa.select(code_versions))])
        by_job: dict[int, list[dict]] = {}
        for r in rows:
            by_job.setdefault(r["job_id"], []).append(r)
        needed = set()
        for job_rows in by_job.values():
            keep = [current_version(job_rows), last_stable_version(job_rows)]
            keep += [r for r in job_rows if r["status"] in WAITING or r["status"] == "applied"]
            needed |= {os.path.abspath(r["path"]) for r in keep if r is not None}
        base = os.path.join(os.path.abspath(os.path.expanduser(os.fspath(state_dir))), "versions")
        removed = []
        for r in rows:
            path = os.path.abspath(r["path"])
            if path not in needed and os.path.dirname(path) == base and os.path.isdir(path):
                remove_tree(path)
                removed.append(path)
        return removed

    def save(self, row: Mapping[str, Any]) -> None:
        """Write a row the job core changed (status, reason, applied_at, ...)."""
        values = {k: v for k, v in row.items() if k != "id"}
        self.store.write(lambda c: c.execute(
            code_versions.update().where(code_versions.c.id == row["id"]).values(**values)))

    def mark(self, version_id: int, status: str, reason: str | None, now: float,
             step: int | None = None) -> dict:
        """Move a version to `status` (see ``marked``) and save it. Returns the updated row."""
        row = self.get(version_id)
        if row is None:
            raise ValueError(f"no code version {version_id}")
        new = marked(row, status, reason, now, step)
        self.save(new)
        return new

    def apply(self, version_id: int, now: float, step: int | None = None,
              reason: str = "hot update") -> dict:
        """Mark a waiting version ``applied`` and the older waiting ones ``superseded``."""
        row = self.get(version_id)
        if row is None:
            raise ValueError(f"no code version {version_id}")
        changed = applied_rows(self.list(row["job_id"]), version_id, now, step, reason)
        for r in changed:
            self.save(r)
        return changed[0]

    def rollback(self, job_id: int, reason: str, now: float) -> dict:
        """Mark the current version ``rolled-back``; return the last stable version, current again.
        Raises ValueError when there is nothing to roll back to."""
        try:
            old, target = rolled_back_rows(self.list(job_id), reason, now)
        except ValueError as e:
            raise ValueError(f"job {job_id}: {e}") from None
        self.save(old)
        return target

    def promote_if_healthy(self, job_id: int, step: int, now: float,
                           n: int = PROMOTE_AFTER_STEPS) -> dict | None:
        """Promote the current version to ``stable`` once it has run `n` steps since applied."""
        row = promoted_row(self.list(job_id), step, now, n)
        if row is not None:
            self.save(row)
        return row
