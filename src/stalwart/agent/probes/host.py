"""Host probe: memory pressure and CPU overload.

Reads `<proc>/meminfo` (MemTotal, MemAvailable — what psutil's `available` is) and
`<proc>/loadavg` (proc = /proc; tests pass a temp dir). Both findings are warnings,
debounced over `warn_after` consecutive checks, never machine-certain:

- host_memory_low: MemAvailable below min(`min_available_bytes`, `min_available_ratio` of
  MemTotal) — the kernel OOM killer is near (CPU OOM is 10% of ByteRobust's incidents).
- host_overload: 1-minute load average per CPU above `max_load_per_cpu` (CPU overload,
  11% of incidents, slows every rank of the job).
- cpu_oom (with `oom_kills=True`): the kernel's OOM killer killed a process since the last check
  (`oom_kill` of `<proc>/vmstat`, Linux 4.13+), reported at once. The kernel-log probe reports the
  same kill with the victim's pid and name from /dev/kmsg, so the agent turns this on only where it
  cannot read /dev/kmsg: one kill is one alert.
"""

from __future__ import annotations

import os

from stalwart.agent.probes.base import Debounce, HealthEvent, Probe

GiB = 1 << 30


def read_meminfo(path: str) -> dict[str, int]:
    """Parse a /proc/meminfo file into byte counts ("MemTotal" -> bytes)."""
    out: dict[str, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                out[key.strip()] = int(parts[0]) * scale
    return out


def read_vmstat(path: str, key: str) -> int | None:
    """One counter of a /proc/vmstat file (None when the kernel has no such counter)."""
    with open(path, encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return None


def read_loadavg(path: str) -> float:
    """The 1-minute load average from a /proc/loadavg file."""
    with open(path, encoding="ascii") as f:
        return float(f.read().split()[0])


class HostProbe(Probe):
    """Watches host memory and load every `interval_s`."""

    name = "host"

    def __init__(
        self,
        proc_root: str = "/proc",
        min_available_bytes: int = GiB,
        min_available_ratio: float = 0.05,
        max_load_per_cpu: float = 4.0,
        cpus: int | None = None,
        interval_s: float = 5.0,
        warn_after: int = 2,
        oom_kills: bool = False,
    ) -> None:
        super().__init__()
        if min_available_bytes < 0 or not 0 <= min_available_ratio < 1:
            raise ValueError("host memory thresholds must be >= 0 bytes and a ratio in [0, 1)")
        if max_load_per_cpu <= 0:
            raise ValueError(f"max_load_per_cpu must be > 0, got {max_load_per_cpu}")
        if interval_s <= 0:
            raise ValueError(f"host probe interval must be > 0 s, got {interval_s}")
        self.proc_root = proc_root
        self.min_available_bytes = min_available_bytes
        self.min_available_ratio = min_available_ratio
        self.max_load_per_cpu = max_load_per_cpu
        self.cpus = cpus or os.cpu_count() or 1
        self.interval_s = interval_s
        self._debounce = Debounce(warn_after)
        self.oom_kills = oom_kills
        self._oom: int | None = None

    def check(self, now: float) -> list[HealthEvent]:
        """Read memory and load once; warn on conditions that persisted `warn_after` checks."""
        mem = read_meminfo(os.path.join(self.proc_root, "meminfo"))
        total = mem.get("MemTotal", 0)
        available = mem.get("MemAvailable", mem.get("MemFree", 0))
        load = read_loadavg(os.path.join(self.proc_root, "loadavg"))
        findings = {}
        if available < min(self.min_available_bytes, self.min_available_ratio * total):
            findings["host_memory_low"] = {"available_bytes": available, "total_bytes": total}
        if load / self.cpus > self.max_load_per_cpu:
            findings["host_overload"] = {"load1": load, "cpus": self.cpus}
        fired = self._debounce.observe_all(set(findings))
        events = [self.event(kind, "warn", False, now, **findings[kind]) for kind in sorted(fired)]
        if self.oom_kills:
            kills = read_vmstat(os.path.join(self.proc_root, "vmstat"), "oom_kill")
            if kills is not None and self._oom is not None and kills > self._oom:
                events.append(self.event("cpu_oom", "warn", False, now, kills=kills - self._oom,
                                         source="/proc/vmstat"))
            self._oom = kills
        return events
