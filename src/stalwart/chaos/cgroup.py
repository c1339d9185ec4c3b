"""Process faults through cgroups: freeze (a realistic hang) and CPU throttling (fail-slow).

Works on both layouts: cgroup v1 (``/sys/fs/cgroup/freezer/...`` with ``freezer.state``,
``/sys/fs/cgroup/cpu/...`` with ``cpu.cfs_quota_us``) and cgroup v2 (one tree with
``cgroup.controllers``, ``cgroup.freeze`` and ``cpu.max``); on a hybrid host each
controller is taken from wherever it is mounted. Each `CgroupChaos` owns one child cgroup
``stalwart-<name>`` per controller; `destroy` thaws, lifts limits, moves the processes back
to the cgroups they came from and removes the directories. Processes are never left frozen.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from stalwart.chaos.net import ChaosUnavailable

CGROUP_ROOT = Path("/sys/fs/cgroup")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_WAIT_S = 5.0


@dataclass(frozen=True)
class CgroupLayout:
    """Where the freezer and cpu controllers live: version "v1", "v2" or None, and their root dir."""

    freezer: str | None
    freezer_root: Path | None
    cpu: str | None
    cpu_root: Path | None


def detect_layout(root: Path | str = CGROUP_ROOT) -> CgroupLayout:
    """Find the freezer and cpu controllers under `root` (v1 hierarchies win over v2)."""
    root = Path(root)
    freezer = freezer_root = cpu = cpu_root = None
    if (root / "freezer" / "cgroup.procs").exists() and not (root / "freezer" / "cgroup.controllers").exists():
        freezer, freezer_root = "v1", root / "freezer"
    for d in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        if (root / d / "cpu.cfs_quota_us").exists():
            cpu, cpu_root = "v1", root / d
            break
    controllers_file = root / "cgroup.controllers"
    if controllers_file.exists():
        controllers = controllers_file.read_text().split()
        if freezer is None:  # the v2 freezer is core (cgroup.freeze), no controller to enable
            freezer, freezer_root = "v2", root
        if cpu is None and "cpu" in controllers:
            cpu, cpu_root = "v2", root
    return CgroupLayout(freezer, freezer_root, cpu, cpu_root)


def cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """Map controller name -> cgroup path from /proc/<pid>/cgroup text; v2 is under key "" (pure)."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for ctrl in parts[1].split(",") if parts[1] else [""]:
            paths[ctrl] = parts[2]
    return paths


def cpu_limit(fraction: float, period_us: int = 100_000) -> tuple[int, int]:
    """(quota_us, period_us) giving `fraction` of one core (may exceed 1 for several cores) (pure)."""
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1024:
        raise ValueError(f"cpu fraction must be in (0, 1024], got {fraction!r}")
    if not isinstance(period_us, int) or not 1_000 <= period_us <= 1_000_000:
        raise ValueError(f"cpu period must be 1000..1000000 us, got {period_us!r}")
    return max(1_000, int(round(fraction * period_us))), period_us


def available(layout: CgroupLayout | None = None) -> tuple[bool, str]:
    """Whether freezing and throttling both work here: (True, "ok") or (False, why)."""
    if os.geteuid() != 0:
        return False, f"needs root (uid {os.geteuid()})"
    layout = layout or detect_layout()
    missing = [c for c, v in (("freezer", layout.freezer), ("cpu", layout.cpu)) if v is None]
    if missing:
        return False, f"no cgroup {' or '.join(missing)} controller under {CGROUP_ROOT}"
    return True, "ok"


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class CgroupChaos:
    """Freeze or throttle a set of processes inside cgroups named ``stalwart-<name>``."""

    name: str
    root: Path | str = CGROUP_ROOT
    layout: CgroupLayout = field(init=False)
    _origins: dict[int, dict[str, str]] = field(default_factory=dict, init=False)
    _frozen: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"cgroup chaos name {self.name!r} must be 1-64 characters of [A-Za-z0-9_.-]")
        self.root = Path(self.root)
        self.layout = detect_layout(self.root)

    def available(self) -> tuple[bool, str]:
        """Whether freeze and throttle_cpu both work here: (True, "ok") or (False, why)."""
        return available(self.layout)

    # ----- paths ----------------------------------------------------------------------------
    @property
    def freezer_dir(self) -> Path | None:
        """This chaos' freezer cgroup directory (None without a freezer controller)."""
        return self.layout.freezer_root / f"stalwart-{self.name}" if self.layout.freezer_root else None

    @property
    def cpu_dir(self) -> Path | None:
        """This chaos' cpu cgroup directory (None without a cpu controller)."""
        return self.layout.cpu_root / f"stalwart-{self.name}" if self.layout.cpu_root else None

    def _need(self, controller: str) -> Path:
        if os.geteuid() != 0:
            raise ChaosUnavailable(f"needs root (uid {os.geteuid()})")
        version = getattr(self.layout, controller)
        if version is None:
            raise ChaosUnavailable(f"no cgroup {controller} controller under {self.root}")
        d = self.freezer_dir if controller == "freezer" else self.cpu_dir
        if version == "v2" and controller == "cpu":
            sub = self.layout.cpu_root / "cgroup.subtree_control"
            if "cpu" not in sub.read_text().split():
                _write(sub, "+cpu")
        d.mkdir(exist_ok=True)
        return d

    def _enter(self, d: Path, controller: str, pids: Iterable[int]) -> None:
        key = "" if getattr(self.layout, controller) == "v2" else controller
        pids = list(pids)
        if not pids:
            raise ValueError("no pids given")
        for pid in pids:
            if not isinstance(pid, int) or pid <= 0:
                raise ValueError(f"pid must be a positive int, got {pid!r}")
            try:
                origin = cgroup_paths(Path(f"/proc/{pid}/cgroup").read_text()).get(key, "/")
            except FileNotFoundError as exc:
                raise ValueError(f"no process {pid}") from exc
            if not origin.startswith(f"/stalwart-{self.name}"):
                self._origins.setdefault(pid, {})[controller] = origin
            try:
                _write(d / "cgroup.procs", str(pid))
            except ProcessLookupError as exc:
                raise ValueError(f"no process {pid}") from exc

    # ----- freezer --------------------------------------------------------------------------
    def _freezer_state(self) -> bool:
        d = self.freezer_dir
        if self.layout.freezer == "v1":
            return (d / "freezer.state").read_text().strip() == "FROZEN"
        return "frozen 1" in (d / "cgroup.events").read_text()

    def freeze(self, pids: Iterable[int]) -> None:
        """Move `pids` into the freezer cgroup and freeze it; returns once the kernel says FROZEN."""
        d = self._need("freezer")
        self._enter(d, "freezer", pids)
        self._frozen = True
        if self.layout.freezer == "v1":
            _write(d / "freezer.state", "FROZEN")
        else:
            _write(d / "cgroup.freeze", "1")
        deadline = time.monotonic() + _WAIT_S
        while not self._freezer_state():
            if time.monotonic() > deadline:
                self.thaw()
                raise RuntimeError(f"cgroup {d} not frozen after {_WAIT_S} s; thawed it again")
            time.sleep(0.01)

    def thaw(self) -> None:
        """Thaw the freezer cgroup (processes stay in it until `destroy`); idempotent."""
        d = self.freezer_dir
        if d is None or not d.exists():
            self._frozen = False
            return
        if self.layout.freezer == "v1":
            _write(d / "freezer.state", "THAWED")
        else:
            _write(d / "cgroup.freeze", "0")
        deadline = time.monotonic() + _WAIT_S
        while self._freezer_state() or (
            self.layout.freezer == "v1" and (d / "freezer.state").read_text().strip() != "THAWED"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"cgroup {d} still frozen {_WAIT_S} s after thaw")
            time.sleep(0.01)
        self._frozen = False

    @property
    def frozen(self) -> bool:
        """Whether this chaos has frozen its processes (and not thawed them yet)."""
        return self._frozen

    # ----- cpu ------------------------------------------------------------------------------
    def throttle_cpu(self, pids: Iterable[int], fraction: float = 0.1, period_us: int = 100_000) -> None:
        """Limit `pids` together to `fraction` of one core (CFS quota)."""
        quota, period = cpu_limit(fraction, period_us)
        d = self._need("cpu")
        self._enter(d, "cpu", pids)
        if self.layout.cpu == "v1":
            _write(d / "cpu.cfs_quota_us", "-1")  # period may only change while unlimited or larger
            _write(d / "cpu.cfs_period_us", str(period))
            _write(d / "cpu.cfs_quota_us", str(quota))
        else:
            _write(d / "cpu.max", f"{quota} {period}")

    def _unlimit(self) -> None:
        d = self.cpu_dir
        if d is None or not d.exists():
            return
        if self.layout.cpu == "v1":
            _write(d / "cpu.cfs_quota_us", "-1")
        else:
            _write(d / "cpu.max", "max")

    def restore(self) -> None:
        """Thaw and lift the CPU limit; processes stay in the cgroups until `destroy`."""
        self.thaw()
        self._unlimit()

    # ----- teardown -------------------------------------------------------------------------
    def destroy(self) -> None:
        """Thaw, lift limits, move every process back where it came from, remove the dirs; idempotent."""
        self.restore()
        for controller, d in (("freezer", self.freezer_dir), ("cpu", self.cpu_dir)):
            if d is None or not d.exists():
                continue
            deadline = time.monotonic() + _WAIT_S
            while True:
                for pid in (d / "cgroup.procs").read_text().split():
                    self._leave(int(pid), controller)
                try:
                    d.rmdir()
                    break
                except OSError as exc:
                    if exc.errno == errno.ENOENT:
                        break
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise RuntimeError(f"cannot remove cgroup {d}: {exc}") from exc
                    time.sleep(0.01)
        self._origins.clear()

    def _leave(self, pid: int, controller: str) -> None:
        hierarchy = self.layout.freezer_root if controller == "freezer" else self.layout.cpu_root
        origin = self._origins.get(pid, {}).get(controller, "/")
        for target in (hierarchy / origin.lstrip("/"), hierarchy):
            try:
                _write(target / "cgroup.procs", str(pid))
                return
            except ProcessLookupError:
                return
            except OSError:
                continue
        raise RuntimeError(f"cannot move pid {pid} out of {hierarchy}/stalwart-{self.name}")

    def __enter__(self) -> "CgroupChaos":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


__all__ = ["CgroupChaos", "CgroupLayout", "ChaosUnavailable", "available", "cgroup_paths", "cpu_limit", "detect_layout"]
