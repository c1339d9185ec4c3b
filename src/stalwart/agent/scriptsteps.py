"""The agent's side of the step hook (worker/stephook.py): read what each plain worker wrote.

Every period the progress watch hands the run's workers (rank -> the pids of its process tree) to
:func:`collect`, which reads the hook's files of those processes in the order they were written,
deletes them, and returns one `protocol.Script` event per rank with its records in order. Files of
processes that are no worker of the run (a stopped run's, an SDK worker's) are deleted unread.
"""
from __future__ import annotations

import json
import os

from stalwart import protocol as p

SUFFIX = ".steps"          # worker/stephook.SUFFIX (that file cannot import stalwart)


def _name(name: str) -> tuple[int, int] | None:
    """(pid, seq) of a hook file's name, None for anything else."""
    if not name.endswith(SUFFIX):
        return None
    pid, sep, seq = name[:-len(SUFFIX)].partition("-")
    if not sep or not pid.isdigit() or not seq.isdigit():
        return None
    return int(pid), int(seq)


def _records(raw: object) -> list[p.ScriptRecord]:
    out = []
    if not isinstance(raw, list):
        return out
    for r in raw:
        if not isinstance(r, list) or len(r) < 3 or r[0] not in ("s", "save", "load", "move"):
            continue
        try:
            n, t = int(r[1]), float(r[2])
        except (TypeError, ValueError):
            continue
        path = str(r[3]) if len(r) > 3 and r[0] != "s" else ""
        dest = str(r[4]) if len(r) > 4 and r[0] == "move" else ""
        held = r[4] if len(r) > 4 and r[0] == "load" and isinstance(r[4], int) else None
        out.append(p.ScriptRecord(kind="step" if r[0] == "s" else r[0], n=n, t=t, path=path, dest=dest, steps=held))
    return out


def collect(directory: str, trees: dict[int, set[int]], run: int, skip: set[int] | frozenset = frozenset(),
            keep_others: bool = False) -> list[p.Script]:
    """The `script` events of the run's ranks from `directory`, one per rank with news;
    `skip`: pids whose steps the SDK reports (their files are dropped); files of other processes
    are dropped too unless `keep_others` (a look at some of the workers only)."""
    owner = {pid: rank for rank, pids in trees.items() for pid in pids}
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    files: dict[int, list[tuple[int, int, str]]] = {}
    for name in names:
        key = _name(name)
        if key is None:
            continue
        path = os.path.join(directory, name)
        rank = owner.get(key[0])
        if key[0] in skip or (rank is None and not keep_others):
            _unlink(path)
        if rank is None or key[0] in skip:
            continue
        files.setdefault(rank, []).append((key[0], key[1], path))
    out = []
    for rank, found in sorted(files.items()):
        records: list[p.ScriptRecord] = []
        for _, _, path in sorted(found):
            try:
                with open(path) as f:
                    records += _records(json.load(f))
            except (OSError, ValueError):
                pass
            _unlink(path)
        if records:
            out.append(p.Script(run=run, rank=rank, records=records))
    return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
