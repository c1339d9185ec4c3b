"""Code snapshots: an immutable, content-hashed copy of a job's code directory.

A snapshot takes code only. It skips what lives in a code directory without being code: stalwart
state dirs (they hold sockets, databases and shared-memory links of running machines), Python
virtualenvs, caches (`__pycache__`, `.git`, tool caches, `node_modules`) and anything that is
neither a regular file nor a symlink (sockets, fifos, devices), and it says what it skipped. A
directory that cannot be snapshotted is refused with one line when the job is submitted.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Iterable

from stalwart.backends.statedir import DB_NAME

CACHE_DIRS = frozenset({"__pycache__", ".git", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox",
                        "node_modules", ".ipynb_checkpoints", ".hg", ".svn"})
IGNORED_SUFFIXES = (".pyc",)
STATE_MARKER = ".stalwart-state"        # written into every state dir by the controller
MAX_FILES = 5000
MAX_BYTES = 256 << 20


@dataclass
class Tree:
    """What a snapshot of a directory takes: (relative posix path, absolute path) of every file
    and symlink, sorted, and what it left out and why."""
    entries: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def mark_state_dir(path: str) -> None:
    """Mark a directory as a stalwart state dir (snapshots never take one)."""
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(path, STATE_MARKER)
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("stalwart state directory: controller database, machines, checkpoints\n")


def _skip_dir(full: str) -> str | None:
    """Why a directory is not code, or None."""
    if os.path.exists(os.path.join(full, STATE_MARKER)) or os.path.exists(os.path.join(full, DB_NAME)):
        return "a stalwart state dir"
    if os.path.exists(os.path.join(full, "pyvenv.cfg")):
        return "a Python virtualenv"
    return None


def walk(root: str, exclude: Iterable[str] = ()) -> Tree:
    """Every file and symlink under `root` a snapshot takes (see the module docstring); the
    `exclude` directories (absolute paths) are left out too. Symlinks are kept as links (never
    followed), so a link loop cannot hang us."""
    skip = {os.path.abspath(e) for e in exclude}
    tree = Tree()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if d in CACHE_DIRS or full in skip:
                continue
            if os.path.islink(full):            # a symlinked directory: recorded as a link
                filenames.append(d)
                continue
            why = _skip_dir(full)
            if why is not None:
                tree.skipped.append(f"{rel}/ ({why})")
            else:
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            if f.endswith(IGNORED_SUFFIXES) or f == STATE_MARKER:
                continue
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            try:
                mode = os.lstat(full).st_mode
            except OSError:
                continue                        # gone while we looked
            if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                tree.entries.append((rel, full))
            else:
                tree.skipped.append(f"{rel} (neither a file nor a symlink)")
    tree.entries.sort()
    return tree


def _file_digest(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.digest()


def _entry_digest(full: str) -> bytes:
    """Digest of one entry's bytes: a regular file's content or a symlink's target text."""
    if os.path.islink(full):
        return hashlib.sha256(b"symlink\0" + os.readlink(full).encode()).digest()
    return _file_digest(full)


def check_dir(src_dir: str) -> str:
    """The absolute path of an existing directory; ValueError (one line) otherwise."""
    if not isinstance(src_dir, (str, os.PathLike)) or not str(src_dir):
        raise ValueError(f"code directory must be a path (got {src_dir!r})")
    src = os.path.abspath(os.path.expanduser(os.fspath(src_dir)))
    if not os.path.exists(src):
        raise ValueError(f"code directory {src} does not exist")
    if not os.path.isdir(src):
        raise ValueError(f"code directory {src} is not a directory")
    return src


def tree_hash(directory: str, exclude: Iterable[str] = ()) -> str:
    """sha256 (hex) over the sorted relative paths and the bytes of every file a snapshot of
    `directory` takes; a symlink counts by its target text. Equal for a source directory and its
    snapshot. ValueError for a missing or empty one."""
    root = check_dir(directory)
    entries = walk(root, exclude).entries
    if not entries:
        raise ValueError(f"code directory {root} holds no files (after ignoring caches and state dirs)")
    h = hashlib.sha256()
    for rel, full in entries:
        h.update(rel.encode() + b"\0" + _entry_digest(full))
    return h.hexdigest()


def versionable(src: str | None, state_dir: str, max_files: int = MAX_FILES,
                max_bytes: int = MAX_BYTES) -> str | None:
    """None when `src` can be snapshotted as a code version, else why not (one line).

    A code dir that holds data sets is not code: snapshotting it at every version would copy
    gigabytes, so hot update is switched off for such a job and says so."""
    if not src or not os.path.isdir(src):
        return f"code dir {src!r} does not exist"
    entries = walk(src, exclude=(state_dir,)).entries
    root = os.path.abspath(src)
    size = 0
    for n, (rel, full) in enumerate(entries, 1):
        try:
            st = os.lstat(full)
        except OSError:
            continue
        size += st.st_size
        if stat.S_ISLNK(st.st_mode) and not _link_inside(full, root):
            return (f"code dir {src} holds a symlink {rel} to {os.readlink(full)}, outside it (a code version "
                    f"must not change with what it points to): pass --code DIR with just the training code "
                    f"to enable hot update")
        if n > max_files or size > max_bytes:
            return (f"code dir {src} is too large to version (more than {max_files} files or "
                    f"{max_bytes >> 20} MiB; data inside?): pass --code DIR with just the training "
                    f"code to enable hot update")
    return None if entries else f"code dir {src} is empty"


def _make_read_only(root: str) -> None:
    """Take every write permission away, and nothing else: a 0600 file becomes 0400, never
    readable by others (directories keep who may list and enter them)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for f in filenames:
            full = os.path.join(dirpath, f)
            if not os.path.islink(full):
                os.chmod(full, stat.S_IMODE(os.lstat(full).st_mode) & ~0o222)
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, stat.S_IMODE(os.lstat(full).st_mode) & ~0o222)
    os.chmod(root, stat.S_IMODE(os.lstat(root).st_mode) & ~0o222)


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


def snapshot(src_dir: str, state_dir: str) -> tuple[str, str, list[str]]:
    """Copy `src_dir` into an immutable snapshot ``<state_dir>/versions/<hash>/`` (read-only files
    and directories) and return ``(hash, path, skipped)``.

    The copy is made in a temporary directory beside the target and renamed into place, so a
    snapshot either exists whole or not at all; the hash is taken over the bytes actually copied.
    A snapshot with the same hash is reused. Raises ValueError (one line) for a missing or empty
    directory or one that cannot be read."""
    src = check_dir(src_dir)
    state = os.path.abspath(os.path.expanduser(os.fspath(state_dir)))
    if state == src:
        raise ValueError(f"state directory {state} is the code directory itself; use another one")
    tree = walk(src, exclude=(state,))
    if not tree.entries:
        raise ValueError(f"code directory {src} holds no files (after ignoring caches and state dirs)")
    if len(tree.entries) > MAX_FILES:
        raise ValueError(f"code directory {src} holds {len(tree.entries)} files, more than a code version "
                         f"may ({MAX_FILES}): pass --code DIR with just the training code")
    base = os.path.join(state, "versions")
    os.makedirs(base, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=base)
    os.chmod(tmp, 0o755 & ~_umask())        # (mkdtemp's 0700: the snapshot is read like its source)
    try:
        h = hashlib.sha256()
        budget = [MAX_BYTES]
        for rel, full in tree.entries:
            h.update(rel.encode() + b"\0" + _copy_entry(full, os.path.join(tmp, *rel.split("/")), rel, src, budget))
        digest_hex = h.hexdigest()
        final = os.path.join(base, digest_hex)
        if os.path.isdir(final):
            return digest_hex, final, tree.skipped
        _make_read_only(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):        # not a concurrent snapshot of the same content
                raise
        return digest_hex, final, tree.skipped
    finally:
        remove_tree(tmp)


def _link_inside(full: str, root: str) -> bool:
    """Whether the symlink at `full` is relative and stays inside `root`."""
    target = os.readlink(full)
    inside = os.path.normpath(os.path.join(os.path.dirname(full), target))
    return not os.path.isabs(target) and (inside == root or inside.startswith(root.rstrip(os.sep) + os.sep))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _copy_entry(full: str, dst: str, rel: str, root: str, budget: list[int]) -> bytes:
    """Copy one file or symlink; return its digest. A symlink must stay inside `root` (relative,
    not climbing out: an absolute link or one out of the tree would let the "immutable" copy
    change with whatever it points to); `budget[0]`: bytes still allowed (MAX_BYTES in all)."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(full)
            if not _link_inside(full, root):
                raise ValueError(f"cannot snapshot {rel}: a symlink to {target}, outside the code directory "
                                 "(a code version must not change with what it points to)")
            os.symlink(target, dst)
            return hashlib.sha256(b"symlink\0" + target.encode()).digest()
        fh = hashlib.sha256()
        with open(full, "rb") as fin, open(dst, "wb") as fout:
            for chunk in iter(lambda: fin.read(1 << 20), b""):
                budget[0] -= len(chunk)
                if budget[0] < 0:
                    raise ValueError(f"cannot snapshot {rel}: the code directory holds more than "
                                     f"{MAX_BYTES >> 20} MiB (data inside?): pass --code DIR with just the code")
                fh.update(chunk)
                fout.write(chunk)
        os.chmod(dst, st.st_mode & 0o777)
        return fh.digest()
    except OSError as e:
        raise ValueError(f"cannot snapshot {rel}: {e.strerror or e}") from None
