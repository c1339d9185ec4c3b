"""The flight-recorder hook: a side thread in every worker process an agent starts.

An agent cannot call into a plain training script, yet telling a hung job from a slow one, and the
rank that holds the others up, needs each rank's collectives: which it entered, which finished.
torch's Flight Recorder keeps them (``TORCH_FR_BUFFER_SIZE``, which the agent sets before the
process group exists) and ``_dump_fr_trace_json()`` reads them in a few milliseconds from any
thread, also while the main thread is blocked in a collective (environment.md).

``hookdir/sitecustomize.py`` loads this file at interpreter start-up (the agent puts that directory
first on the workers' PYTHONPATH) and calls :func:`start`: one daemon thread that, every
``STALWART_FR_PERIOD`` seconds once ``torch.distributed`` has a process group, dumps the recorder
and writes a summary to ``STALWART_FR_DIR/<pid>.json`` (atomically): the last entries of every
process group seen so far, how many collectives the process entered, and whether it is inside one
now, and the collectives entered since the previous summary (``trace``: kind, group, duration,
bytes, gap; `Tracer`). The agent reads these files for progress (agent/progress.py), forwards the
traces to the controller's trace detector, and sends the summaries with a hang's stacks, where
``analyzer.flightrec.laggards`` names the ranks that never entered the stuck collective.

Why a file every period rather than a dump on request: a SIGSTOPped or frozen rank answers no
request, and the summary it wrote just before it stopped is exactly the evidence needed; the other
ranks' summaries are at most a period old, while a hang means nothing moved for far longer. Why not a
signal: Python runs signal handlers on the main thread, which is blocked inside the collective.

The hook also bounds how long a worker outlives its agent (a plain script has no link to notice
it): while the agent named in `<work directory>/agent.lock` is gone for STALWART_RELINK_S
seconds, the process exits with code 70. A restarted agent writes its own pid there and adopts
the worker (agent/adopt.py) well within that.

Standard library only (the worker's interpreter need not have stalwart installed); the thread never
imports torch (a script that does not use torch.distributed pays one dict lookup per period) and
never raises into the training script.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Iterable

# protocol.Env.FR_DIR / FR_PERIOD (this file cannot import stalwart; a unit test keeps them equal)
DIR_ENV = "STALWART_FR_DIR"
PERIOD_ENV = "STALWART_FR_PERIOD"
RUN_ENV = "STALWART_RUN"
SOCK_ENV = "STALWART_AGENT_SOCK"    # protocol.Env.AGENT_SOCK: the agent's work directory holds it
RELINK_ENV = "STALWART_RELINK_S"    # protocol.Env.RELINK_S
LOCK = "agent.lock"                 # agent/workdir.py: "agent pid N (machine M)"
KEEP = 3                       # entries kept per process group: the stuck one and the two before
TRACE_MAX = 128                # collectives a summary's trace holds: the newest since the last one
FIELDS = ("pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "is_p2p", "profiling_name",
          "retired", "record_id", "state", "time_created_ns", "input_sizes")
DTYPE_BYTES = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Int": 4, "Long": 8, "Char": 1, "Byte": 1,
               "Bool": 1, "Short": 2, "Float8_e4m3fn": 1, "Float8_e5m2": 1}


def group_key(entry: dict) -> str:
    """A process group's identity across ranks: its name (``process_group[0]``), not ``pg_id``.

    ``pg_id`` counts the groups each process created: with ``new_group(...,
    use_local_synchronization=True)`` a rank creates only its own groups, so two different data-
    parallel groups both have pg_id 2; their names (a hash of the members) differ."""
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg and pg[0] not in (None, ""):
        return str(pg[0])
    return str(entry.get("pg_id", ""))


class Recorder:
    """What one process' summaries are built from: the last entries of every group seen so far.

    Groups used rarely keep their last entries here after they left the recorder's ring buffer, so
    the summary always has every group's newest collective (the one a hang is stuck in)."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.groups: dict[str, dict[int, dict]] = {}       # group -> record_id -> entry

    def update(self, entries: Iterable[dict]) -> dict[str, Any]:
        """Merge one dump's entries and return the summary: ``entries`` (the kept ones, oldest
        first, with FIELDS only), ``entered`` (collectives plus point-to-point ops entered over all
        groups: grows with every new one) and ``in_collective`` (the newest entry has not
        finished)."""
        newest: dict | None = None
        for e in entries:
            slim = {k: e[k] for k in FIELDS if k in e}
            rid = int(slim.get("record_id", -1))
            self.groups.setdefault(group_key(slim), {})[rid] = slim
            if newest is None or rid > int(newest.get("record_id", -1)):
                newest = slim
        entered = 0
        kept: list[dict] = []
        for key, by_id in self.groups.items():
            ids = sorted(by_id)[-self.keep:]
            self.groups[key] = {i: by_id[i] for i in ids}
            entered += max((int(e.get("collective_seq_id") or 0) for e in self.groups[key].values()), default=0)
            entered += max((int(e.get("p2p_seq_id") or 0) for e in self.groups[key].values()), default=0)
            kept.extend(self.groups[key].values())
        if newest is None and kept:
            newest = max(kept, key=lambda e: int(e.get("record_id", -1)))
        kept.sort(key=lambda e: int(e.get("record_id", -1)))
        return {"entries": kept, "entered": entered,
                "in_collective": newest is not None and not newest.get("retired", True)}


def _nbytes(entry: dict) -> int | None:
    """The bytes of a collective's inputs, where its sizes and dtypes are recorded."""
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if not isinstance(sizes, list) or not isinstance(dtypes, list) or len(sizes) != len(dtypes) or not sizes:
        return None
    total = 0
    for shape, dt in zip(sizes, dtypes):
        n = 1
        for d in shape if isinstance(shape, list) else []:
            n *= int(d)
        total += n * DTYPE_BYTES.get(str(dt), 4)
    return total


class Tracer:
    """The collectives a rank entered since the last call, as the controller's trace detector reads
    them (`protocol.TraceOp`, as a list): ``[kind, group, description, duration ms or None, bytes or
    None, ms since the previous collective was entered or None, record id]``. Durations exist where
    the recorder times collectives (NCCL with timing); with gloo only the entry time is recorded, and
    the gaps between entries carry the timing. At most `limit` per call, the newest: the dump is
    taken anyway, so a trace costs a pass over the new entries, and its size stays bounded."""

    def __init__(self, limit: int = TRACE_MAX):
        self.limit = limit
        self.last_id = -1
        self.last_created: int | None = None

    def ops(self, entries: Iterable[dict]) -> list[list]:
        new = sorted((e for e in entries if int(e.get("record_id", -1)) > self.last_id),
                     key=lambda e: int(e.get("record_id", -1)))
        out: list[list] = []
        for e in new:
            created = e.get("time_created_ns")
            gap = ((created - self.last_created) / 1e6 if isinstance(created, int) and self.last_created
                   and created >= self.last_created else None)
            if isinstance(created, int) and created > 0:
                self.last_created = created
            dur = e.get("duration_ms")
            pg = e.get("process_group")
            desc = str(pg[1]) if isinstance(pg, (list, tuple)) and len(pg) > 1 else ""
            out.append([str(e.get("profiling_name", "")), group_key(e), desc,
                        float(dur) if isinstance(dur, (int, float)) else None, _nbytes(e),
                        round(gap, 3) if gap is not None else None, int(e.get("record_id", -1))])
            self.last_id = max(self.last_id, int(e.get("record_id", -1)))
        return out[-self.limit:]


def _dump(c10d: Any) -> list[dict]:
    raw = c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False)
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode("utf-8", "replace")
    trace = json.loads(raw)
    return list(trace.get("entries") or []) if isinstance(trace, dict) else []


def write_summary(directory: str, summary: dict) -> str:
    """Write `summary` to DIR/<pid>.json atomically; returns the path."""
    path = os.path.join(directory, f"{os.getpid()}.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def _initialized() -> Any:
    """torch's c10d bindings once a default process group exists (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    from torch._C import _distributed_c10d as c10d
    return c10d if hasattr(c10d, "_dump_fr_trace_json") else False


def _loop(directory: str, period: float) -> None:
    rec, tracer = Recorder(), Tracer()
    while True:
        time.sleep(period)
        try:
            c10d = _initialized()
            if c10d is False:
                return                      # this torch has no flight recorder: nothing to watch
            if c10d is None:
                continue
            entries = _dump(c10d)
            summary = rec.update(entries)
            if not summary["entries"]:
                continue                    # no collective yet (or the recorder is off: size 0)
            rank = os.environ.get("RANK")
            summary.update(trace=tracer.ops(entries), pid=os.getpid(), t=time.time(),
                           rank=int(rank) if rank and rank.lstrip("-").isdigit() else None,
                           run=os.environ.get(RUN_ENV))
            write_summary(directory, summary)
        except Exception:       # never into the training script; try again next period
            continue


def agent_alive(lock_path: str) -> bool:
    """Does the agent named in its work directory's lock file run? (An unreadable file: yes.)"""
    try:
        with open(lock_path) as f:
            words = f.read().split()
        pid = int(words[words.index("pid") + 1])
    except (OSError, ValueError, IndexError):
        return True
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:
        return True


def watch_agent(lock_path: str, bound: float, period: float = 1.0, exit=os._exit) -> None:
    """Exit (code 70) once the agent has been gone for `bound` seconds."""
    gone_since: float | None = None
    while True:
        time.sleep(period)
        if agent_alive(lock_path):
            gone_since = None
            continue
        now = time.monotonic()
        gone_since = now if gone_since is None else gone_since
        if now - gone_since >= bound:
            sys.stderr.write(f"stalwart: the agent has been gone for {bound:.0f}s: this worker stops\n")
            sys.stderr.flush()
            exit(70)
            return


def start() -> threading.Thread | None:
    """Start the hook's thread when the agent asked for it (STALWART_FR_DIR set, period > 0)."""
    sock = os.environ.get(SOCK_ENV)
    try:
        bound = float(os.environ.get(RELINK_ENV) or 0)
    except ValueError:
        bound = 0.0
    if sock and bound > 0:
        threading.Thread(target=watch_agent, args=(os.path.join(os.path.dirname(sock), LOCK), bound),
                         name="stalwart-agentwatch", daemon=True).start()
    directory = os.environ.get(DIR_ENV)
    try:
        period = float(os.environ.get(PERIOD_ENV, "1"))
    except ValueError:
        return None
    if not directory or not period > 0:
        return None
    t = threading.Thread(target=_loop, args=(directory, period), name="stalwart-fr", daemon=True)
    t.start()
    return t
