"""Progress of a machine's workers without step reports: CPU time, log growth, flight recorder.

A plain training script (no SDK) reports no steps, yet the controller's hang timer must tell one
that computes from one that is stuck. Every period this sampler reads, for each worker of the run:

- the CPU seconds of its process tree (the worker and its children: data loaders) and the size of
  its log files;
- the summary its flight-recorder hook wrote (`worker/frhook.py`, in `<workdir>/fr/<pid>.json`):
  how many collectives it entered and whether it is inside one now, and the collectives entered
  since the hook's previous summary (its trace: forwarded to the controller's trace detector);
- with a `TcpSampler` (agent/tcpstats.py), the kernel's figures of the workers' TCP connections to
  the other machines, per peer address (forwarded to the controller's link detector).

`analyzer.activity.progressed` judges each worker (a new collective is progress; outside a collective, CPU
or log growth is; inside one, neither is: NCCL's wait spins), and one `activity` event per period
tells the controller which ranks progressed and, for ranks without the SDK, their collective counts
when those grew, and every rank's new trace operations. Ranks whose SDK reported a step since the last
sample are left out of `ranks` (their step said it).

The same summaries go with a hang's stacks (`summaries`), where the controller's flight-recorder
analysis names the ranks that never entered the stuck collective.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

import psutil

from stalwart import protocol as p
from stalwart.agent import scriptsteps
from stalwart.agent.tcpstats import TcpSampler
from stalwart.agent.workers import Worker, process_tree
from stalwart.analyzer.activity import ActivitySample, progressed

FR_BUFFER = 256          # recorder entries per process: a dump and its parse take ~4 ms (2,000: ~40 ms)
MIN_CPU_SHARE = 0.04     # of a core over a period, outside a collective, to count as computing


def hook_dir() -> str:
    """The directory holding the workers' start-up hook (`sitecustomize.py`)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "hookdir")


def hook_env(env: dict[str, str], fr_dir: str, period_s: float) -> dict[str, str]:
    """A worker's environment with the flight-recorder hook: the hook first on PYTHONPATH, where it
    writes and how often, and the recorder switched on unless the job chose its size (0: off)."""
    env = dict(env)
    env[p.Env.FR_DIR] = fr_dir
    env.setdefault(p.Env.FR_PERIOD, f"{period_s:g}")
    env.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER))
    env["PYTHONPATH"] = hook_dir() + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class ProgressWatch:
    """Samples the run's workers every `period_s` and emits `activity` events.

    `workers()` gives the run's workers, `has_sdk(pid)` whether a worker talks to the agent
    through the SDK, `last_steps()` the last step each rank's SDK reported, `run()` the run."""

    def __init__(self, fr_dir: str, workers: Callable[[], list[Worker]], has_sdk: Callable[[int], bool],
                 last_steps: Callable[[], dict[int, int]], run: Callable[[], int | None],
                 emit: Callable[[p.Event], None], period_s: float = 1.0, tcp: TcpSampler | None = None):
        self.fr_dir = fr_dir
        self.tcp = tcp
        self.workers, self.has_sdk, self.last_steps, self.run = workers, has_sdk, last_steps, run
        self.emit = emit
        self.period_s = period_s
        self._prev: dict[int, ActivitySample] = {}       # rank -> last sample
        self._steps: dict[int, int] = {}                 # rank -> last step seen at the last sample
        self._sent: dict[int, int] = {}                  # rank -> collective count last sent
        self._traced: dict[tuple[int, int], int] = {}    # (rank, pid) -> last trace record id sent
        self.script_run: int | None = None              # the last run whose step hook reported here
        self._lock = threading.Lock()
        self._stop = threading.Event()
        os.makedirs(fr_dir, exist_ok=True)

    def start(self) -> None:
        threading.Thread(target=self._loop, name="progress", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def reset(self) -> None:
        """A new run: forget the old run's samples and its workers' summaries."""
        with self._lock:
            self._prev.clear()
            self._steps.clear()
            self._sent.clear()
            self._traced.clear()
            for name in os.listdir(self.fr_dir):
                try:
                    os.unlink(os.path.join(self.fr_dir, name))
                except OSError:
                    pass

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                for script in self.script_events():
                    self.emit(script)
                ev = self.sample(time.time())
            except Exception:       # a worker that vanished mid-sample: next period
                continue
            if ev is not None:
                self.emit(ev)

    def script_events(self, only: list[Worker] | None = None) -> list[p.Script]:
        """The step hook's records of the run's workers (agent/scriptsteps.py), one `script` event
        per rank; `only`: just these workers (one that ended: its last records before its exit)."""
        run = self.run()
        if run is None:
            return []
        workers = [w for w in (only if only is not None else self.workers()) if w.rank is not None and w.run == run]
        trees: dict[int, set[int]] = {}
        for w in workers:
            assert w.rank is not None
            trees[w.rank] = {w.proc.pid} | {proc.pid for proc in process_tree(w.proc.pid)}
        sdk = {w.proc.pid for w in workers if self.has_sdk(w.proc.pid)}
        with self._lock:
            events = scriptsteps.collect(self.fr_dir, trees, run, skip=sdk, keep_others=only is not None)
        if events:
            self.script_run = run
        return events

    def summaries(self, trees: dict[int, set[int]]) -> dict[int, dict]:
        """The newest flight-recorder summary of each worker (rank -> summary), given each rank's
        process-tree pids (the hook may run in a child of the process the agent started)."""
        owner = {pid: rank for rank, pids in trees.items() for pid in pids}
        out: dict[int, dict] = {}
        try:
            names = os.listdir(self.fr_dir)
        except OSError:
            return out
        for name in names:
            if not name.endswith(".json") or not name[:-5].isdigit() or int(name[:-5]) not in owner:
                continue
            try:
                with open(os.path.join(self.fr_dir, name)) as f:
                    summary = json.load(f)
            except (OSError, ValueError):
                continue
            rank = owner[int(name[:-5])]
            if isinstance(summary, dict) and (rank not in out or summary.get("t", 0) > out[rank].get("t", 0)):
                out[rank] = summary
        return out

    def sample(self, now: float) -> p.Activity | None:
        """One sample of every live worker of the run; the `activity` event to send, or None."""
        run = self.run()
        live = [w for w in self.workers() if w.rank is not None and w.run == run and w.proc.poll() is None]
        if run is None or not live:
            return None
        trees = {w.rank: process_tree(w.proc.pid) for w in live}
        fr = self.summaries({r: {proc.pid for proc in procs} for r, procs in trees.items() if r is not None})
        steps = self.last_steps()
        ranks: list[int] = []
        counts: dict[int, int] = {}
        traces: dict[int, list[p.TraceOp]] = {}
        with self._lock:
            for w in live:
                rank = w.rank
                assert rank is not None
                sdk = self.has_sdk(w.proc.pid)
                summary = fr.get(rank) or {}
                entered = summary.get("entered")
                cur = ActivitySample(cpu_s=_cpu_s(trees[rank]), log_bytes=_size(w.out_path) + _size(w.err_path),
                                     collectives=entered if isinstance(entered, int) else None,
                                     in_collective=bool(summary.get("in_collective")))
                prev = self._prev.get(rank)
                self._prev[rank] = cur
                stepped = rank in steps and steps[rank] != self._steps.get(rank)
                if rank in steps:
                    self._steps[rank] = steps[rank]
                if not stepped and progressed(prev, cur, min_cpu_s=MIN_CPU_SHARE * self.period_s):
                    ranks.append(rank)
                if not sdk and cur.collectives is not None and cur.collectives != self._sent.get(rank):
                    counts[rank] = self._sent[rank] = cur.collectives
                ops = self._new_ops(rank, summary)
                if ops:
                    traces[rank] = ops
        links = self.tcp.sample(proc.pid for procs in trees.values() for proc in procs) if self.tcp else []
        if not ranks and not counts and not traces and not links:
            return None
        return p.Activity(run=run, ranks=sorted(ranks), collectives=counts, traces=traces, links=links, t=now)

    def _new_ops(self, rank: int, summary: dict) -> list[p.TraceOp]:
        """The trace operations of `summary` not sent yet (a summary is read until the next replaces
        it); malformed ones are skipped."""
        raw, pid = summary.get("trace"), summary.get("pid")
        if not isinstance(raw, list) or not isinstance(pid, int):
            return []
        last = self._traced.get((rank, pid), -1)
        out: list[p.TraceOp] = []
        for op in raw:
            try:
                t = p.TraceOp(str(op[0]), str(op[1]), str(op[2]), op[3], op[4], op[5], int(op[6]))
            except (TypeError, ValueError, IndexError):
                continue
            if t.seq > last:
                out.append(t)
        if out:
            self._traced[(rank, pid)] = max(o.seq for o in out)
        return out
