"""Per-machine metric samples for the controller's peer-similarity detector (Minder-style).

Every `period_s` the agent reports one row: CPU seconds per second and resident memory of all its
training processes (workers and their children), bytes per second through its NIC, and its GPUs'
mean temperature and SM clock (NVML, or the simulated GPU). Per-rank step and compute times come
from the SDK's step reports at the controller, so they are not sampled here.

`cpu_wait` is the share of the time those processes' main threads wanted a CPU that they spent
waiting for one (the scheduler's run delay over run delay plus run time, `/proc/PID/schedstat`):
near 0 on a machine whose cores are the job's, growing when other work takes them. A rank blocked
on the network is not runnable and adds nothing to either side, so a slow link leaves it as it
was; the fail-slow detector tells a busy host from a slow network with it (plain scripts report no
compute times to tell them apart).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import psutil

from stalwart import protocol


def nic_bytes(ifname: str | None) -> int | None:
    """rx + tx bytes of an interface, or None when there is none to read."""
    if not ifname:
        return None
    total = 0
    for d in ("rx_bytes", "tx_bytes"):
        try:
            with open(f"/sys/class/net/{ifname}/statistics/{d}") as f:
                total += int(f.read())
        except (OSError, ValueError):
            return None
    return total


def gpu_means(devices: list[dict[str, Any]]) -> dict[str, float]:
    """Mean temperature and SM clock over the present GPUs (pure)."""
    present = [d for d in devices if d.get("present", True)]
    out: dict[str, float] = {}
    for key, name in (("temperature", "gpu_temp"), ("clock_sm", "gpu_clock")):
        vals = [float(d[key]) for d in present if isinstance(d.get(key), (int, float))]
        if vals:
            out[name] = sum(vals) / len(vals)
    return out


def schedstat(pid: int) -> tuple[int, int] | None:
    """(nanoseconds run, nanoseconds runnable but waiting for a CPU) of a process's main thread,
    or None where the kernel keeps no scheduler statistics or the process is gone."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


def wait_share(before: dict[int, tuple[int, int]], now: dict[int, tuple[int, int]],
               min_ns: int = 10_000_000) -> float | None:
    """The share of the processes' runnable time spent waiting for a CPU between two readings of
    `schedstat` (pure); None when they wanted less than `min_ns` of CPU in all."""
    ran = waited = 0
    for pid, (r, w) in now.items():
        if pid in before:
            ran += max(0, r - before[pid][0])
            waited += max(0, w - before[pid][1])
    return waited / (ran + waited) if ran + waited >= min_ns else None


class MetricsSampler:
    def __init__(self, pids: Callable[[], list[int]], gpu_read: Callable[[], list[dict]],
                 ifname: str | None, emit: Callable[[protocol.Event], None], period_s: float = 1.0):
        self.pids, self.gpu_read, self.ifname, self.emit = pids, gpu_read, ifname, emit
        self.period_s = period_s
        self._cpu: dict[int, float] = {}
        self._sched: dict[int, tuple[int, int]] = {}
        self._last: tuple[float, int | None] | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="metrics", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                row = self.sample(time.time())
            except Exception:     # a metric that cannot be read must not stop the others
                continue
            if row is not None:
                self.emit(protocol.Metrics(t=row.pop("t"), values=row))

    def sample(self, now: float) -> dict | None:
        """One row, or None before the first interval (rates need two readings)."""
        cpu_now: dict[int, float] = {}
        sched_now: dict[int, tuple[int, int]] = {}
        rss = 0
        for pid in self.pids():
            got = schedstat(pid)
            if got is not None:
                sched_now[pid] = got
            try:
                p = psutil.Process(pid)
                t = p.cpu_times()
                cpu_now[pid] = t.user + t.system
                rss += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
                continue
        net = nic_bytes(self.ifname)
        last, self._last = self._last, (now, net)
        prev_cpu, self._cpu = self._cpu, cpu_now
        prev_sched, self._sched = self._sched, sched_now
        if last is None or now <= last[0]:
            return None
        dt = now - last[0]
        used = sum(c - prev_cpu.get(pid, c) for pid, c in cpu_now.items())
        row: dict[str, Any] = {"t": now, "cpu": max(0.0, used) / dt, "rss_mb": rss / 2 ** 20}
        if net is not None and last[1] is not None:
            row["net_mbps"] = max(0, net - last[1]) * 8 / dt / 1e6
        waiting = wait_share(prev_sched, sched_now)
        if waiting is not None:
            row["cpu_wait"] = waiting
        row.update(gpu_means(self.gpu_read()))
        return row
