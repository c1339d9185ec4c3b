"""The simulated GPU: NVML-like device state kept in a JSON file.

Where no GPU exists (CI, the local backend) the agent's GPU probe, the worker SDK and the
chaos tool share one JSON file per machine that stands for that machine's GPUs. Chaos
writes faults into it (`set(device, xid=[79])`), the probe reads it like NVML, and the
worker SDK asks it whether the GPU it "runs on" would make the worker crash
(`fatal`), run slow (`slowdown`) or silently corrupt results (`corrupts`).

File format (written atomically: temp file in the same directory, fsync, rename)::

    {"version": 1, "devices": [{"index": 0, "present": true, "xid": [], ...}, ...]}

Per-device fields (defaults in `default_device`):

- present: False = the GPU fell off the bus / is not visible (NVML handle errors).
- xid: list of Xid codes the driver reported (newest last).
- ecc_dbe: volatile uncorrectable (double-bit) ECC error count.
- ecc_sbe: volatile corrected (single-bit) ECC error count.
- retired_pages_pending: a page retirement waits for a reset.
- row_remap_failure: the row remapper ran out of spare rows.
- temperature: GPU core temperature in °C; slowdown_temp: where the driver throttles.
- throttle: list of active clock-throttle reasons (names as in `THROTTLE_REASONS`).
- clock_sm / clock_sm_max: current and maximum SM clock (MHz).
- pcie_width / pcie_width_max, pcie_gen / pcie_gen_max: current and maximum PCIe link.
- sdc: the GPU silently corrupts arithmetic (a "mercurial core").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from typing import Any, Iterator

# Clock-throttle reasons, named after NVML's nvmlClocksEventReason* constants.
THROTTLE_REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)
# Reasons that mean the GPU runs slower than it should (idle and app-clock settings do not).
SLOW_THROTTLE_REASONS = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    }
)

# What cudaGetErrorString() says for the errors a failing GPU produces.
CUDA_NO_DEVICE = "no CUDA-capable device is detected"
CUDA_LAUNCH_FAILURE = "unspecified launch failure"
CUDA_ILLEGAL_ADDRESS = "an illegal memory access was encountered"
CUDA_ECC_UNCORRECTABLE = "uncorrectable ECC error encountered"
CUDA_NVLINK_UNCORRECTABLE = "uncorrectable NVLink error detected during the execution"

# Xid -> the CUDA error a process running on that GPU gets. Xids absent here do not by
# themselves crash the process (e.g. 63: a row remap was recorded; 92: high single-bit
# ECC rate, which the GPU probe still treats as a reason to evict).
XID_CUDA_ERROR = {
    13: CUDA_ILLEGAL_ADDRESS,  # graphics engine exception
    31: CUDA_ILLEGAL_ADDRESS,  # GPU memory page fault
    48: CUDA_ECC_UNCORRECTABLE,  # double-bit ECC error
    62: CUDA_LAUNCH_FAILURE,  # internal micro-controller halt
    64: CUDA_ECC_UNCORRECTABLE,  # ECC page retirement / row remapper recording failure
    74: CUDA_NVLINK_UNCORRECTABLE,  # NVLink error
    79: CUDA_LAUNCH_FAILURE,  # GPU has fallen off the bus
    94: CUDA_ECC_UNCORRECTABLE,  # contained ECC error
    95: CUDA_ECC_UNCORRECTABLE,  # uncontained ECC error
    119: CUDA_LAUNCH_FAILURE,  # GSP RPC timeout
    120: CUDA_LAUNCH_FAILURE,  # GSP error
    140: CUDA_ECC_UNCORRECTABLE,  # unrecovered ECC error
}
# torch >= 2.8 raises CUDA runtime errors as torch.AcceleratorError (a RuntimeError).
CUDA_ERROR_PREFIX = "torch.AcceleratorError: CUDA error: "

# Slowdown model when the GPU is hot but no reduced clock is given: 1.5x at the slowdown
# temperature, +0.1x per °C above it, at most MAX_SLOWDOWN.
HOT_BASE_SLOWDOWN = 1.5
HOT_SLOWDOWN_PER_DEGREE = 0.1
MAX_SLOWDOWN = 10.0

_INT_FIELDS = (
    "ecc_dbe",
    "ecc_sbe",
    "temperature",
    "slowdown_temp",
    "clock_sm",
    "clock_sm_max",
    "pcie_width",
    "pcie_width_max",
    "pcie_gen",
    "pcie_gen_max",
)
_BOOL_FIELDS = ("present", "retired_pages_pending", "row_remap_failure", "sdc")


def default_device(index: int) -> dict[str, Any]:
    """A healthy simulated H100 SXM at index `index`."""
    return {
        "index": index,
        "name": "Simulated NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-5157a1a2-0000-0000-0000-{index:012d}",
        "present": True,
        "xid": [],
        "ecc_dbe": 0,
        "ecc_sbe": 0,
        "retired_pages_pending": False,
        "row_remap_failure": False,
        "temperature": 45,
        "slowdown_temp": 87,
        "throttle": [],
        "clock_sm": 1980,
        "clock_sm_max": 1980,
        "pcie_width": 16,
        "pcie_width_max": 16,
        "pcie_gen": 5,
        "pcie_gen_max": 5,
        "sdc": False,
    }


def _check_index(device: object, count: int) -> None:
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
        raise ValueError(f"no simulated GPU {device!r} (this machine has {count})")


def _validate(device: int, fields: dict[str, Any]) -> dict[str, Any]:
    known = set(default_device(0)) - {"index"}
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key not in known:
            raise ValueError(f"unknown simulated GPU field {key!r} (known: {', '.join(sorted(known))})")
        if key in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise ValueError(f"GPU {device} field {key} must be true/false, got {value!r}")
        elif key in _INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GPU {device} field {key} must be a non-negative integer, got {value!r}")
        elif key == "xid":
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value
            ):
                raise ValueError(f"GPU {device} field xid must be a list of positive Xid codes, got {value!r}")
            value = list(value)
        elif key == "throttle":
            if not isinstance(value, (list, tuple)) or any(r not in THROTTLE_REASONS for r in value):
                raise ValueError(
                    f"GPU {device} field throttle must list reasons among {', '.join(THROTTLE_REASONS)}, got {value!r}"
                )
            value = list(value)
        out[key] = value
    return out


class SimGpu:
    """The simulated GPUs of one machine, backed by the JSON file at `path`.

    `count` devices are created (healthy) when the file does not exist; when it exists,
    `count` must match it or be None (= take the file's count). Every call re-reads the
    file, so several processes (agent, workers, chaos) see each other's changes.
    """

    def __init__(self, path: str | os.PathLike[str], count: int | None = None) -> None:
        self.path = os.fspath(path)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"simulated GPU count must be a positive integer, got {count!r}")
        with self._locked():
            if os.path.exists(self.path):
                existing = len(self._load())
                if count is not None and existing != count:
                    raise ValueError(
                        f"{self.path} holds {existing} simulated GPUs, not {count}; remove it or pass count=None"
                    )
                self.count = existing
            else:
                if count is None:
                    raise ValueError(f"{self.path} does not exist: give the number of simulated GPUs to create")
                self.count = count
                self._store([default_device(i) for i in range(count)])

    # -- file access -------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialize read-modify-write between processes with a lock file beside the state."""
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd = os.open(self.path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _load(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.path} is not valid simulated-GPU JSON: {exc}") from None
        devices = data.get("devices") if isinstance(data, dict) else None
        if not isinstance(devices, list) or not devices:
            raise ValueError(f"{self.path} has no 'devices' list")
        # Fill fields added after the file was written.
        return [{**default_device(i), **d} for i, d in enumerate(devices)]

    def _store(self, devices: list[dict[str, Any]]) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(prefix=".simgpu-", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": 1, "devices": devices}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _device(self, device: int) -> dict[str, Any]:
        devices = self.read()
        _check_index(device, len(devices))
        return devices[device]

    # -- public API --------------------------------------------------------------------

    def read(self) -> list[dict[str, Any]]:
        """The state of every device, in index order (fresh copies)."""
        return self._load()

    def set(self, device: int, **fields: Any) -> dict[str, Any]:
        """Change fields of one device (validated) and write the file atomically; returns the new state."""
        with self._locked():
            devices = self._load()
            _check_index(device, len(devices))
            devices[device].update(_validate(device, fields))
            self._store(devices)
            return dict(devices[device])

    def add_xid(self, device: int, code: int) -> dict[str, Any]:
        """Append one Xid code to a device's list (what a driver error does)."""
        with self._locked():
            devices = self._load()
            _check_index(device, len(devices))
            devices[device].update(_validate(device, {"xid": [*devices[device]["xid"], code]}))
            self._store(devices)
            return dict(devices[device])

    def reset(self, device: int | None = None) -> None:
        """Make one device (or all when None) healthy again, as a GPU reset / replacement would."""
        with self._locked():
            devices = self._load()
            targets = range(len(devices)) if device is None else [device]
            for i in targets:
                _check_index(i, len(devices))
                devices[i] = default_device(i)
            self._store(devices)

    def fatal(self, device: int) -> str | None:
        """The error line a worker using this GPU would die with, or None if it can run.

        Lost GPU -> "no CUDA-capable device is detected"; uncorrectable ECC ->
        "uncorrectable ECC error encountered"; otherwise the first crashing Xid decides
        (79 -> "unspecified launch failure", 31 -> "an illegal memory access ...").
        """
        return fatal_line(self._device(device))

    def slowdown(self, device: int) -> float:
        """Factor (>= 1.0) by which this GPU's step time is stretched (hot / throttled)."""
        return slowdown_factor(self._device(device))

    def corrupts(self, device: int) -> bool:
        """True when this GPU silently corrupts results (and is still present)."""
        d = self._device(device)
        return bool(d["present"] and d["sdc"])


def fatal_line(d: dict[str, Any]) -> str | None:
    """Pure form of `SimGpu.fatal` over one device dict."""
    if not d.get("present", True):
        return CUDA_ERROR_PREFIX + CUDA_NO_DEVICE
    if d.get("ecc_dbe", 0) > 0:
        return CUDA_ERROR_PREFIX + CUDA_ECC_UNCORRECTABLE
    xids = list(d.get("xid", []))
    if 79 in xids:  # off the bus dominates whatever else was reported
        return CUDA_ERROR_PREFIX + CUDA_LAUNCH_FAILURE
    for code in xids:
        if code in XID_CUDA_ERROR:
            return CUDA_ERROR_PREFIX + XID_CUDA_ERROR[code]
    return None


def slowdown_factor(d: dict[str, Any]) -> float:
    """Pure form of `SimGpu.slowdown`: clock ratio when clocks are reduced, else a thermal model."""
    factor = 1.0
    clock, clock_max = d.get("clock_sm", 0), d.get("clock_sm_max", 0)
    if 0 < clock < clock_max:
        factor = clock_max / clock
    temp, limit = d.get("temperature", 0), d.get("slowdown_temp", 87)
    throttled = any(r in SLOW_THROTTLE_REASONS for r in d.get("throttle", []))
    if factor == 1.0 and (temp >= limit or throttled):
        factor = HOT_BASE_SLOWDOWN + HOT_SLOWDOWN_PER_DEGREE * max(0, temp - limit)
    return min(factor, MAX_SLOWDOWN)
