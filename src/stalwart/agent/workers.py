"""Worker processes of one machine: spawn with a torchrun-compatible environment, watch, kill.

Each worker runs in its own session (so its whole tree can be signalled), writes stdout and stderr
to its own files, and has a watcher thread that reports its exit code or signal the moment it ends.
Stopping kills the whole process tree, stopped and frozen processes included: SIGCONT first, then
SIGKILL after a short grace — never a 30 s wait.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil

from stalwart.agent.adopt import AdoptedProcess, WorkerRecord
from stalwart.agent.forkclient import ForkedProcess, ForkServers

log = logging.getLogger("stalwart.agent")

# a worker started by the agent, forked (or exec'd) by a fork server, or adopted from an earlier agent
Proc = subprocess.Popen | ForkedProcess | AdoptedProcess


def die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the parent dies (a worker that no fork or exec
    server started cannot be adopted by a restarted agent: it goes with its agent). Linux ties this
    to the forking *thread*: spawn only from long-lived threads."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def warm_nice() -> int:
    """Niceness of warm workers while they wait: they yield the CPU to training. Only as root: an
    activated worker must get its priority back, and only root may lower a niceness."""
    return 10 if os.geteuid() == 0 else 0


def into_background(nice: int) -> None:
    """In a warm worker's child before exec: niceness `nice`, and the SCHED_IDLE class where the
    kernel allows it. A niced process still gets about a tenth of a busy core beside a training
    process (scheduler weight 110 against 1024): on a loaded machine the spares' imports took CPU
    from the training; a SCHED_IDLE one (weight 3) runs only where a core has nothing else to do.
    `renice` brings both back."""
    os.nice(nice)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        pass


def renice(pid: int, value: int = 0) -> bool:
    """Set the niceness of every thread of `pid` (Linux nice values are per thread), back in the
    normal scheduling class (SCHED_OTHER) if `into_background` took it out."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                if os.sched_getscheduler(int(tid)) != os.SCHED_OTHER:
                    os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            except PermissionError:
                pass          # (not root: nothing left SCHED_OTHER, see `into_background`'s callers)
            os.setpriority(os.PRIO_PROCESS, int(tid), value)
        return True
    except (OSError, ValueError):
        return False


def _exited(proc: Proc) -> bool:
    """Has the process ended (reaped or not)? `Popen.poll()` cannot tell while another thread
    waits on it (it then answers None), so ask the kernel without reaping (WNOWAIT)."""
    if proc.returncode is not None:
        return True
    if isinstance(proc, (ForkedProcess, AdoptedProcess)):   # (not our child: its fork server reaps it)
        return proc.exited()
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


PF_EXITING = 0x4                    # /proc/PID/stat flags: the process has begun to exit
_FATAL = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)


def _dying(pid: int) -> bool:
    """Is the process on its way out of its own accord: a fatal signal pending, or its exit begun?

    A SIGKILLed worker with a large address space takes tens of milliseconds to become a zombie,
    and its sockets close before that: its peers fail, the controller stops the run, and the stop
    must not take the crash for its own doing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
        if flags & PF_EXITING:
            return True
        pending = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")):
                    pending |= int(line.split()[1], 16)
        return any(pending & (1 << (int(s) - 1)) for s in _FATAL)
    except (OSError, ValueError, IndexError):
        return False        # gone already (then `_exited` says so) or unreadable


def ended_on_its_own(proc: Proc) -> bool:
    """Has the process ended, or begun to end, without anyone stopping it?"""
    return _exited(proc) or _dying(proc.pid)


def tail(path: str, nbytes: int = 8192) -> str:
    """The last `nbytes` of a text file ('' if missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int] | None:
    """The pids of `pid`'s children from /proc/PID/task/*/children (None where the kernel has no
    such file: then psutil, which reads every process's parent, finds them)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task"):
                return []                   # the process is gone
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue                    # a thread that ended meanwhile
            return None
        except OSError:
            return None
    return out


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants. Sampled every second per worker by the metrics and
    the progress watch: the children come from /proc/PID/task/*/children, not from psutil's scan
    of every process on the host (a few ms each on a busy host)."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    procs, todo, seen = [root], [pid], {pid}
    while todo:
        kids = _children(todo.pop())
        if kids is None:                    # no children files here: psutil's way
            try:
                return [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                return []
        for k in kids:
            if k in seen:
                continue
            seen.add(k)
            try:
                procs.append(psutil.Process(k))
            except psutil.NoSuchProcess:
                continue
            todo.append(k)
    return procs


def _kill_now(procs: list[psutil.Process]) -> None:
    """SIGKILL each process (continued first: a stopped one dies only once it runs)."""
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.NoSuchProcess:
            pass


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has ended; the ones still alive at `timeout`. A zombie counts as
    ended: one whose parent died waits for init to reap it (a second or more here), and a worker
    forked by the fork server is not ours to reap (`psutil.wait_procs` waited for both)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        procs = alive
        time.sleep(0.01)


def kill_tree(pid: int, grace_s: float = 0.0) -> None:
    """Kill a process and every descendant, also when stopped (SIGSTOP) or frozen."""
    procs = process_tree(pid)
    if grace_s > 0:
        for p in procs:
            try:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        procs = wait_gone(procs, grace_s)
    _kill_now(procs)
    wait_gone(procs, 5.0)


def kill_trees_now(pids: list[int]) -> None:
    """SIGKILL several processes and all their descendants at once, waiting for none of them: what
    a machine that loses power does to its processes (`machine-down`). Killing tree after tree and
    waiting for each left the agent alive, answering the controller, for a second or two."""
    _kill_now([p for pid in pids for p in process_tree(pid)])


def take_run_names(w: "Worker") -> None:
    """A warm worker got its rank: its log files take the run's names (`run<N>_rank<R>`, where
    `stalwart logs` and the console find a rank's output); the open files go on being written."""
    for attr in ("out_path", "err_path"):
        old = getattr(w, attr)
        new = os.path.join(os.path.dirname(old), f"run{w.run}_rank{w.rank}{os.path.splitext(old)[1]}")
        try:
            os.replace(old, new)
            setattr(w, attr, new)
        except OSError:
            pass


@dataclass
class Worker:
    local_rank: int
    rank: int | None
    proc: Proc
    out_path: str
    err_path: str
    run: int | None
    started_at: float = field(default_factory=time.time)
    exit_code: int | None = None
    failure_reported: bool = False      # the SDK said "failing" before the process ended
    expected_exit: bool = False

    def log_tail(self, nbytes: int = 8192) -> str:
        return tail(self.err_path, nbytes) + tail(self.out_path, nbytes // 4)


class WorkerSet:
    """The workers of one machine for the current run (or the warm standbys waiting for one)."""

    def __init__(self, log_dir: str, on_exit: Callable[[Worker], None], forks: ForkServers | None = None):
        """`forks`: the machine's fork and exec servers, which start every worker they can (see
        agent/forkclient.py); the others, or all without them, start as this process's children."""
        self.log_dir = log_dir
        self.on_exit = on_exit
        self.forks = forks
        self.workers: list[Worker] = []
        self._lock = threading.Lock()

    def spawn(self, command: list[str], envs: list[dict[str, str]], ranks: list[int | None],
              run: int | None, cwd: str | None, tag: str, prefix: list[str] | None = None,
              nice: int = 0) -> None:
        """Start one process per entry of `envs` (each a complete environment); `nice`: in the
        background (`into_background`) at that niceness."""
        def pre_exec() -> None:
            die_with_parent()
            if nice:
                into_background(nice)

        os.makedirs(self.log_dir, exist_ok=True)
        with self._lock:
            for i, (env, rank) in enumerate(zip(envs, ranks)):
                name = f"{tag}_rank{rank}" if rank is not None else f"{tag}_local{i}"
                out_path = os.path.join(self.log_dir, f"{name}.out")
                err_path = os.path.join(self.log_dir, f"{name}.err")
                proc: Proc | None = None
                if self.forks is not None:
                    proc = self.forks.spawn(command, env, cwd, out_path, err_path, prefix, nice)
                if proc is None:
                    with open(out_path, "ab") as out, open(err_path, "ab") as err:
                        proc = subprocess.Popen((prefix or []) + command, env=env, cwd=cwd, stdout=out,
                                                stderr=err, stdin=subprocess.DEVNULL,
                                                start_new_session=True, preexec_fn=pre_exec)
                    if self.forks is not None:
                        log.warning("%s (pid %d) started as the agent's own child (no fork or exec server "
                                    "could start it): it dies with the agent", name, proc.pid)
                w = Worker(local_rank=i, rank=rank, proc=proc, out_path=out_path, err_path=err_path,
                           run=run)
                self.workers.append(w)
                threading.Thread(target=self._watch, args=(w,), daemon=True,
                                 name=f"watch-{name}").start()

    def _watch(self, w: Worker) -> None:
        code = w.proc.wait()
        w.exit_code = code
        self.on_exit(w)

    def take(self, records: list[WorkerRecord], run: int, exits_dir: str) -> None:
        """Watch workers an earlier agent started (agent/adopt.py) as this set's own."""
        with self._lock:
            for r in records:
                w = Worker(local_rank=r.local_rank, rank=r.rank, proc=AdoptedProcess(r.pid, exits_dir),
                           out_path=r.out_path, err_path=r.err_path, run=run)
                self.workers.append(w)
                threading.Thread(target=self._watch, args=(w,), daemon=True, name=f"watch-adopted{r.rank}").start()

    def adopt(self, workers: list[Worker]) -> None:
        """Take over workers started by another set (warm workers handed their ranks)."""
        with self._lock:
            self.workers.extend(workers)

    def release(self, workers: list[Worker]) -> None:
        """Forget workers without stopping them (they move to another set)."""
        with self._lock:
            self.workers = [w for w in self.workers if w not in workers]

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc.poll() is None]

    def all_pids(self) -> list[int]:
        """Every live process of every worker's tree (for stacks, cgroups, chaos)."""
        out = []
        for pid in self.pids():
            out.extend(p.pid for p in process_tree(pid))
        return out

    def by_rank(self, rank: int) -> Worker | None:
        return next((w for w in self.workers if w.rank == rank), None)

    def stop(self, grace_s: float = 0.0) -> None:
        """Kill every worker's tree and forget them."""
        with self._lock:
            workers, self.workers = self.workers, []
        for w in workers:
            # one that died, or is dying, on its own (its exit may still be on its way) was no
            # stop's doing
            if not ended_on_its_own(w.proc):
                w.expected_exit = True
        threads = []
        for w in workers:
            t = threading.Thread(target=kill_tree, args=(w.proc.pid, grace_s), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        for w in workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
