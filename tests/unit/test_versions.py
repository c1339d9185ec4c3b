"""Unit tests of code versions: snapshots, the code_versions table (SQLite in tmp_path), and the
pure hot-update / rollback / promotion decisions with an explicit clock."""

from __future__ import annotations

import os
import stat

import pytest
import sqlalchemy as sa

from stalwart.controller.code import versions as V
from stalwart.controller.store.db import Store
from stalwart.controller.code.tree import remove_tree, snapshot, tree_hash
from stalwart.controller.code.versions import (Versions, after_failure, current_version, due_update, to_prewarm,
                                          is_due, is_healthy, last_stable_version, rollback_reason)

T = 1_700_000_000.0
DAY = 86400.0


def write(root, files: dict[str, bytes | str]) -> str:
    for rel, data in files.items():
        p = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    return str(root)


@pytest.fixture
def dirs(tmp_path):
    """(code dir, state dir); snapshots are read-only, so they are made removable afterwards."""
    code, state = tmp_path / "code", tmp_path / "state"
    code.mkdir()
    write(code, {"train.py": "print('v1')\n", "pkg/model.py": "W = 1\n"})
    try:
        yield str(code), str(state)
    finally:
        remove_tree(str(state))


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def job(store):
    return store.create_job("j", {"command": "x"}, now=T)


# -- hashing and snapshots ------------------------------------------------------------------------

def test_hash_is_stable_across_copies_and_ignores_caches(dirs, tmp_path):
    code, state = dirs
    other = tmp_path / "other"
    write(other, {"pkg/model.py": "W = 1\n", "train.py": "print('v1')\n"})    # other write order
    write(other, {"pkg/__pycache__/model.cpython-311.pyc": b"\0junk", ".git/HEAD": "ref\n",
                  "stale.pyc": b"x"})
    assert tree_hash(code) == tree_hash(str(other))
    h, path, _ = snapshot(code, state)
    assert h == tree_hash(code) == tree_hash(path)
    assert path == os.path.join(state, "versions", h)
    assert not os.path.exists(os.path.join(path, "pkg", "__pycache__"))


def test_hash_sees_content_and_names(dirs, tmp_path):
    code, _ = dirs
    h0 = tree_hash(code)
    write(code, {"pkg/model.py": "W = 2\n"})
    h1 = tree_hash(code)
    os.rename(os.path.join(code, "pkg", "model.py"), os.path.join(code, "pkg", "model2.py"))
    h2 = tree_hash(code)
    assert len({h0, h1, h2}) == 3


def test_snapshot_identical_content_is_reused(dirs):
    code, state = dirs
    h1, p1, _ = snapshot(code, state)
    h2, p2, _ = snapshot(code, state)
    assert (h1, p1) == (h2, p2)
    assert sorted(os.listdir(os.path.join(state, "versions"))) == [h1]     # no temp dir left


def test_snapshot_is_read_only_and_independent_of_source(dirs):
    code, state = dirs
    os.chmod(os.path.join(code, "train.py"), 0o755)
    h, path, _ = snapshot(code, state)
    for dirpath, _, files in os.walk(path):
        assert not os.stat(dirpath).st_mode & 0o222
        for f in files:
            assert not os.stat(os.path.join(dirpath, f)).st_mode & 0o222
    assert os.stat(os.path.join(path, "train.py")).st_mode & stat.S_IXUSR      # exec bit kept
    if os.geteuid() != 0:                                                       # root ignores modes
        with pytest.raises(PermissionError):
            open(os.path.join(path, "train.py"), "w")
    write(code, {"train.py": "print('v2')\n"})
    with open(os.path.join(path, "train.py")) as f:
        assert f.read() == "print('v1')\n"
    assert tree_hash(path) == h


def test_snapshot_keeps_symlinks_as_links(dirs):
    code, state = dirs
    os.symlink("pkg/model.py", os.path.join(code, "alias.py"))
    os.symlink("pkg", os.path.join(code, "pkgdir"))
    h, path, _ = snapshot(code, state)
    assert os.readlink(os.path.join(path, "alias.py")) == "pkg/model.py"
    assert os.readlink(os.path.join(path, "pkgdir")) == "pkg"
    assert tree_hash(path) == h


def test_snapshot_leaves_out_a_state_dir_inside_the_code_dir(dirs):
    code, _ = dirs
    state = os.path.join(code, ".stalwart")
    try:
        write(state, {"stalwart.db": "data"})
        h, path, _ = snapshot(code, state)
        assert not os.path.exists(os.path.join(path, ".stalwart"))
        h2, _, _ = snapshot(code, state)                  # the versions/ it now holds changes nothing
        assert h2 == h
    finally:
        remove_tree(state)


@pytest.mark.parametrize("case, msg", [("missing", "does not exist"), ("file", "not a directory"),
                                       ("empty", "holds no files"), ("only_cache", "holds no files")])
def test_snapshot_bad_dirs(tmp_path, case, msg):
    src = tmp_path / "src"
    if case == "file":
        src.write_text("x")
    elif case == "empty":
        src.mkdir()
    elif case == "only_cache":
        write(src, {"__pycache__/a.pyc": b"x", "b.pyc": b"y"})
    with pytest.raises(ValueError, match=msg):
        snapshot(str(src), str(tmp_path / "state"))
    with pytest.raises(ValueError, match=msg):
        tree_hash(str(src))


def test_snapshot_refuses_state_dir_equal_to_code_dir(dirs):
    code, _ = dirs
    with pytest.raises(ValueError, match="code directory itself"):
        snapshot(code, code)


# -- the table ------------------------------------------------------------------------------------

def test_table_is_created_by_the_store(store):
    assert "code_versions" in sa.inspect(store.engine).get_table_names()
    cols = {c["name"] for c in sa.inspect(store.engine).get_columns("code_versions")}
    assert {"id", "job_id", "hash", "path", "source", "status", "mode", "window_s", "created_at",
            "applied_at", "reason"} <= cols


def test_register_first_is_stable_then_pending_and_urgent(store, job, dirs):
    code, state = dirs
    vs = Versions(store)
    v1 = vs.register(job, code, state, "lazy", DAY, now=T)
    assert (v1["status"], v1["mode"], v1["applied_at"], v1["source"]) == ("stable", "lazy", T, code)
    assert vs.current(job)["id"] == vs.last_stable(job)["id"] == v1["id"]
    write(code, {"train.py": "print('v2')\n"})
    v2 = vs.register(job, code, state, "lazy", DAY, now=T + 10)
    write(code, {"train.py": "print('v3')\n"})
    v3 = vs.register(job, code, state, "urgent", None, now=T + 20)
    assert (v2["status"], v3["status"], v3["mode"]) == ("pending", "urgent", "urgent")
    assert [v["id"] for v in vs.list(job)] == [v1["id"], v2["id"], v3["id"]]
    assert vs.current(job)["id"] == v1["id"]                     # nothing applied yet
    assert vs.get(v2["id"])["path"] == os.path.join(state, "versions", v2["hash"])


def test_register_identical_content_is_the_same_version(store, job, dirs):
    code, state = dirs
    vs = Versions(store)
    v1 = vs.register(job, code, state, "lazy", DAY, now=T)
    assert vs.register(job, code, state, "urgent", None, now=T + 5)["id"] == v1["id"]
    write(code, {"train.py": "print('v2')\n"})
    v2 = vs.register(job, code, state, "lazy", DAY, now=T + 10)
    again = vs.register(job, code, state, "urgent", None, now=T + 20)
    assert again["id"] == v2["id"] and again["status"] == "urgent"
    assert vs.get(v2["id"])["status"] == "urgent"
    assert len(vs.list(job)) == 2


@pytest.mark.parametrize("mode, window, msg", [("soon", DAY, "mode must be"), ("lazy", -1, "window_s"),
                                               ("lazy", "1h", "window_s"), ("window", None, "needs window_s")])
def test_register_bad_input(store, job, dirs, mode, window, msg):
    code, state = dirs
    with pytest.raises(ValueError, match=msg):
        Versions(store).register(job, code, state, mode, window, now=T)


def test_versions_creates_its_table_on_an_older_store(tmp_path, dirs):
    store = Store(f"sqlite:///{tmp_path / 'old.sqlite'}")
    try:
        V.code_versions.drop(store.engine)       # as if the store predates this module
        assert "code_versions" not in sa.inspect(store.engine).get_table_names()
        vs = Versions(store)
        job = store.create_job("j", {}, now=T)
        assert vs.register(job, dirs[0], dirs[1], "lazy", DAY, now=T)["status"] == "stable"
    finally:
        store.close()


def test_mark_follows_transitions(store, job, dirs):
    code, state = dirs
    vs = Versions(store)
    v1 = vs.register(job, code, state, "lazy", DAY, now=T)
    with pytest.raises(ValueError, match="can become rolled-back, not applied"):
        vs.mark(v1["id"], "applied", "again", now=T + 1)
    with pytest.raises(ValueError, match="status must be"):
        vs.mark(v1["id"], "weird", None, now=T + 1)
    with pytest.raises(ValueError, match="no code version 999"):
        vs.mark(999, "failed", None, now=T + 1)
    write(code, {"train.py": "print('v2')\n"})
    v2 = vs.register(job, code, state, "lazy", DAY, now=T + 10)
    failed = vs.mark(v2["id"], "failed", "restart failed: ImportError", now=T + 11)
    assert (failed["status"], failed["reason"]) == ("failed", "restart failed: ImportError")
    with pytest.raises(ValueError, match="nothing \\(final\\)"):
        vs.mark(v2["id"], "applied", None, now=T + 12)


def test_apply_supersedes_older_waiting_versions(store, job, dirs):
    code, state = dirs
    vs = Versions(store)
    vs.register(job, code, state, "lazy", DAY, now=T)
    ids = []
    for i in range(2, 5):
        write(code, {"train.py": f"print('v{i}')\n"})
        ids.append(vs.register(job, code, state, "lazy", DAY, now=T + i)["id"])
    applied = vs.apply(ids[1], now=T + 100, step=40)
    assert (applied["status"], applied["applied_at"], applied["applied_step"]) == ("applied", T + 100, 40)
    status = {v["id"]: v["status"] for v in vs.list(job)}
    assert (status[ids[0]], status[ids[1]], status[ids[2]]) == ("superseded", "applied", "pending")
    assert vs.current(job)["id"] == ids[1]


def test_rollback_returns_to_last_stable_and_records_why(store, job, dirs):
    code, state = dirs
    vs = Versions(store)
    v1 = vs.register(job, code, state, "lazy", DAY, now=T)
    write(code, {"train.py": "print('v2')\n"})
    v2 = vs.apply(vs.register(job, code, state, "urgent", None, now=T + 10)["id"], now=T + 11, step=5)
    assert vs.promote_if_healthy(job, step=24, now=T + 30) is None          # 19 steps: not yet
    promoted = vs.promote_if_healthy(job, step=25, now=T + 31)
    assert promoted["status"] == "stable" and promoted["id"] == v2["id"]
    write(code, {"train.py": "print('v3')\n"})
    v3 = vs.apply(vs.register(job, code, state, "lazy", DAY, now=T + 40)["id"], now=T + 50, step=30)
    assert vs.current(job)["id"] == v3["id"]
    target = vs.rollback(job, "user-code error after version 3", now=T + 60)
    assert target["id"] == v2["id"]
    assert vs.current(job)["id"] == vs.last_stable(job)["id"] == v2["id"]
    row = vs.get(v3["id"])
    assert (row["status"], row["reason"]) == ("rolled-back", "user-code error after version 3")
    assert vs.rollback(job, "operator asked", now=T + 70)["id"] == v1["id"]   # stable -> previous
    with pytest.raises(ValueError, match="no stable code version"):
        vs.rollback(job, "again", now=T + 80)


def test_rollback_without_versions(store, job):
    with pytest.raises(ValueError, match="no running code version"):
        Versions(store).rollback(job, "why", now=T)


# -- pure decisions -------------------------------------------------------------------------------

def ver(id, status="pending", mode="lazy", window_s=DAY, created_at=T, applied_at=None,
        applied_step=None, hash="ab" * 32):
    return dict(id=id, status=status, mode=mode, window_s=window_s, created_at=created_at,
                applied_at=applied_at, applied_step=applied_step, hash=hash)


def inc(t, category="explicit", mechanism="reattempt", evicted=(), cause="worker crashed", id=0):
    return dict(id=id, detected_at=t, category=category, mechanism=mechanism, evicted=list(evicted),
                symptom="worker_crash", cause=cause)


@pytest.mark.parametrize("v, now, at_failure, due", [
    (ver(2, "urgent", "urgent", None), T, False, True),              # urgent: at once
    (ver(2, mode="lazy"), T + 10, True, True),                       # lazy: at the next failure
    (ver(2, mode="lazy"), T + 10, False, False),                     # ... not before
    (ver(2, mode="lazy"), T + DAY, False, True),                     # ... or when the window ends
    (ver(2, mode="lazy", window_s=None), T + 9 * DAY, False, False),  # no window: only failures
    (ver(2, mode="window", window_s=3600), T + 3599, True, False),   # window: not at a failure
    (ver(2, mode="window", window_s=3600), T + 3600, False, True),   # ... only at its end
    (ver(2, mode="lazy", window_s=0), T, False, True),               # window 0: at once
    (ver(2, "applied"), T + DAY, True, False),                       # not waiting
    (ver(2, "stable"), T + DAY, True, False),
])
def test_is_due(v, now, at_failure, due):
    assert is_due(v, now, at_failure) is due


def test_due_update_picks_the_newest_due_version():
    vs = [ver(1, "stable", applied_at=T), ver(2, mode="lazy"), ver(3, mode="lazy"),
          ver(4, mode="window", window_s=3600)]
    assert due_update(vs, T + 60, at_failure=False) is None
    assert due_update(vs, T + 60, at_failure=True)["id"] == 3        # aggregates 2 and 3
    assert due_update(vs, T + 3600, at_failure=False)["id"] == 4
    assert due_update(list(reversed(vs)), T + 60, at_failure=True)["id"] == 3
    assert due_update(vs + [ver(5, "urgent", "urgent", None)], T + 60, False)["id"] == 5
    assert due_update([], T, True) is None


def test_to_prewarm_warms_what_the_next_restart_or_a_near_window_will_apply():
    lazy, window = ver(2, mode="lazy"), ver(3, mode="window", window_s=3600)
    assert to_prewarm([ver(1, "stable", applied_at=T)], T, 120) is None
    assert to_prewarm([lazy], T, 120)["id"] == 2                   # any restart applies it
    assert to_prewarm([ver(4, "urgent", "urgent", None)], T, 120)["id"] == 4
    # a window version only shortly before its window ends: until then restarts run the old code
    assert to_prewarm([window], T + 60, 120) is None
    assert to_prewarm([window], T + 3600 - 120, 120)["id"] == 3
    assert to_prewarm([lazy, window], T + 3500, 120)["id"] == 3   # the newest of them
    assert to_prewarm([ver(5, "applied", "urgent", None)], T, 120) is None
    assert to_prewarm([ver(6, mode="window", window_s=None)], T + 10**6, 120) is None


def test_current_and_last_stable_from_plain_rows():
    rows = [ver(1, "stable", applied_at=T), ver(2, "stable", applied_at=T + 10),
            ver(3, "rolled-back", applied_at=T + 20), ver(4, "pending")]
    assert current_version(rows)["id"] == 2
    assert last_stable_version(rows)["id"] == 2
    rows.append(ver(5, "applied", applied_at=T + 30))
    assert current_version(rows)["id"] == 5 and last_stable_version(rows)["id"] == 2
    assert current_version([ver(1, "pending")]) is None and last_stable_version([]) is None


APPLIED = ver(3, "applied", applied_at=T + 100, applied_step=50)


@pytest.mark.parametrize("current, history, want", [
    (APPLIED, [inc(T + 200, "user_code", "fail", cause="ZeroDivisionError in train.py:9")],
     "user-code error"),
    (APPLIED, [inc(T + 200), inc(T + 300)], "failed again after a reattempt"),
    (APPLIED, [inc(T + 200)], None),                                            # first crash: reattempt
    (APPLIED, [inc(T + 200), inc(T + 300, mechanism="evict_restart", evicted=["m3"])], None),  # machine
    (APPLIED, [inc(T + 50), inc(T + 200)], None),                               # earlier one predates
    (APPLIED, [inc(T + 50, "user_code", "fail")], None),                        # ... the version
    (APPLIED, [inc(T + 200), inc(T + 900)], None),                              # second one after now
    (ver(1, "stable", applied_at=T), [inc(T + 200, "user_code", "fail")], None),  # stable: no rollback
    (None, [inc(T + 200, "user_code", "fail")], None),
    (APPLIED, [], None),
])
def test_after_failure(current, history, want):
    now = T + 400
    reason = rollback_reason(current, history, now)
    if want is None:
        assert reason is None and after_failure(current, history, now) is None
    else:
        assert want in reason and "version 3" in reason
        assert after_failure(current, history, now) == "rollback"


def test_rollback_reason_names_the_cause():
    reason = rollback_reason(APPLIED, [inc(T + 200, "user_code", "fail", cause="KeyError at model.py:7")],
                             T + 300)
    assert "KeyError at model.py:7" in reason


@pytest.mark.parametrize("v, step, n, want", [
    (APPLIED, 69, 20, False), (APPLIED, 70, 20, True), (APPLIED, 51, 1, True),
    (ver(1, "stable", applied_step=0), 500, 20, False),
    (ver(3, "applied", applied_step=None), 500, 20, False), (None, 5, 20, False),
])
def test_is_healthy(v, step, n, want):
    assert is_healthy(v, step, n) is want


def test_is_healthy_rejects_bad_n():
    with pytest.raises(ValueError, match=">= 1"):
        is_healthy(APPLIED, 100, 0)
