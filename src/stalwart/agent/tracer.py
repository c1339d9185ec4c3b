"""On-demand stack capture of every training process on this machine (ByteRobust §5).

For each worker pid and every descendant (data-loader workers, checkpoint helpers, other
children; found with psutil), ``py-spy dump --json --nonblocking --pid P`` runs under a
timeout, all in parallel threads.  ``--nonblocking`` reads the process memory without
pausing it, which is what works on a SIGSTOP-ed process and on a cgroup-frozen one
(environment.md: the default mode fails on the first and hangs on the second).

The records are the input of :func:`stalwart.controller.rules.hangstacks.decide_hang` (and of
:func:`stalwart.analyzer.stacks.from_pyspy`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import psutil

_DATALOADER_MARKS = ("pt_data_worker", "pt_data_pin", "dataloader", "data_loader")
_CKPT_MARKS = ("ckpt", "checkpoint")


def find_pyspy() -> str:
    """Path of the py-spy binary: next to ``sys.executable`` (the venv), else on PATH.

    Raises FileNotFoundError with the places looked at when it is in neither.
    """
    local = Path(sys.executable).parent / "py-spy"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("py-spy")
    if found:
        return found
    raise FileNotFoundError(f"py-spy not found: not at {local} and not on PATH "
                            f"(pip install py-spy into the agent's environment)")


def role_of(name: str, cmdline: list[str] | None, is_worker: bool) -> str:
    """Role of a captured process: "worker" for the rank's own process, "dataloader" when its
    name or command line says so (torch names its workers ``pt_data_worker``), "ckpt" for a
    checkpoint helper, "child" otherwise (pure)."""
    if is_worker:
        return "worker"
    text = " ".join([name or ""] + list(cmdline or [])).lower()
    if any(m in text for m in _DATALOADER_MARKS):
        return "dataloader"
    if any(m in text for m in _CKPT_MARKS):
        return "ckpt"
    return "child"


def _process_tree(rank: int, pid: int) -> list[tuple[int, int, bool]]:
    """(rank, pid, is_worker) for the worker and all of its descendants that exist now."""
    out = [(rank, pid, True)]
    try:
        children = psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return out
    return out + [(rank, c.pid, False) for c in children]


def _describe(pid: int) -> tuple[str, list[str]]:
    try:
        p = psutil.Process(pid)
        return p.name(), p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "", []


def dump_one(pid: int, pyspy: str, timeout_s: float) -> tuple[list[dict], str | None]:
    """One ``py-spy dump --json --nonblocking`` of ``pid``: (threads, error or None)."""
    cmd = [pyspy, "dump", "--json", "--nonblocking", "--pid", str(pid)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [], f"py-spy timed out after {timeout_s:g} s"
    except OSError as e:
        return [], f"py-spy could not run: {e}"
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        return [], f"py-spy exit {res.returncode}: {msg[-1] if msg else 'no output'}"[:500]
    try:
        threads = json.loads(res.stdout)
    except ValueError as e:
        return [], f"py-spy output is not JSON: {e}"
    if not isinstance(threads, list):
        return [], "py-spy JSON is not a list of threads"
    return threads, None


def capture(pids_by_rank: Mapping[int, int], timeout_s: float = 5.0, machine: Any = None,
            max_threads: int = 32) -> list[dict]:
    """Stacks of every worker in ``pids_by_rank`` (global rank -> pid) and of all their
    descendants, captured in parallel.

    Returns one record per process, workers first in rank order:
    ``{rank, pid, role, machine, threads, error, name, elapsed_s}`` where ``threads`` is
    py-spy's JSON (empty on error), ``error`` None or a one-line reason (process gone,
    py-spy failed or timed out) and ``machine`` the value passed in.  Each py-spy call is
    bounded by ``timeout_s``; the whole capture takes about that long at worst per
    ``max_threads`` processes.  Raises FileNotFoundError when py-spy is missing.
    """
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 (got {timeout_s!r})")
    targets: list[tuple[int, int, bool]] = []
    for rank, pid in sorted(pids_by_rank.items()):
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"pid of rank {rank} must be a positive integer (got {pid!r})")
        targets += _process_tree(rank, pid)
    pyspy = find_pyspy()
    seen: set[int] = set()
    unique = []
    for t in targets:               # a pid listed twice (shared child) is dumped once
        if t[1] not in seen:
            seen.add(t[1])
            unique.append(t)

    def one(target: tuple[int, int, bool]) -> dict:
        rank, pid, is_worker = target
        start = time.monotonic()
        name, cmdline = _describe(pid)
        if not psutil.pid_exists(pid):
            threads, error = [], "process does not exist"
        else:
            threads, error = dump_one(pid, pyspy, timeout_s)
            if error and not psutil.pid_exists(pid):
                error = "process exited during capture"
        return {"rank": rank, "pid": pid, "role": role_of(name, cmdline, is_worker),
                "machine": machine, "threads": threads, "error": error, "name": name,
                "elapsed_s": round(time.monotonic() - start, 4)}

    if not unique:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(max_threads, len(unique))),
                            thread_name_prefix="stalwart-tracer") as pool:
        return list(pool.map(one, unique))


def trace_workers(pids_by_rank: Mapping[int, int], timeout_s: float, machine: Any,
                  flight_recorder: Callable[[dict[int, set[int]]], dict[int, dict]] | None = None) -> list[dict]:
    """What a machine answers a `trace` command with: the stacks of every training process
    (:func:`capture`) with each process' state (a stopped or frozen worker is itself evidence), and
    each worker's flight-recorder summary where it has one (``flight_recorder(trees)``: rank ->
    summary, given each rank's process-tree pids). Without py-spy the states alone still tell a lot."""
    try:
        records = capture(pids_by_rank, timeout_s=timeout_s, machine=machine)
    except FileNotFoundError as e:
        records = [{"rank": r, "pid": p, "role": "worker", "machine": machine, "threads": [], "error": str(e)}
                   for r, p in pids_by_rank.items()]
    trees: dict[int, set[int]] = {}
    for rec in records:
        try:
            rec["status"] = psutil.Process(rec["pid"]).status()
        except psutil.Error:
            rec["status"] = "gone"
        if rec.get("rank") is not None:
            trees.setdefault(rec["rank"], set()).add(rec["pid"])
    summaries = flight_recorder(trees) if flight_recorder is not None else {}
    for rec in records:
        if rec.get("role") == "worker" and rec.get("rank") in summaries:
            rec["flight_recorder"] = summaries[rec["rank"]]
    return records
