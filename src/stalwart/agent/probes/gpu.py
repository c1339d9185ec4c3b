"""GPU probe: NVML where a driver exists, the simulated GPU elsewhere.

Both sources return the same per-device dicts (the schema of `simgpu.default_device`),
so one pure function, `assess`, turns readings into events:

fatal, machine-certain (evict at once):
  - gpu_lost: the device is missing or its NVML handle fails (GpuIsLost, Unknown, ...).
  - gpu_xid: a new Xid in `FATAL_XIDS`.
  - ecc_dbe: volatile uncorrectable ECC errors > 0.
  - row_remap_failure: the row remapper has no spare rows left.
warn (debounced: `warn_after` consecutive bad checks, so self-healing glitches pass):
  - gpu_hot: temperature at/above the slowdown threshold, or a thermal/HW throttle reason.
  - gpu_throttle: HW slowdown / power-brake throttling or SM clock below `min_clock_ratio`.
  - pcie_downgrade: link width below max; link generation below max while not idle
    (GPUs drop the PCIe generation at idle to save power, so idle gen drops are normal).
  - retired_pages_pending: a page retirement / row remap waits for a GPU reset.
info:
  - gpu_xid for non-fatal Xids (13, 31, 43, 45, 63, ...: mostly application faults or
    follow-ups of another error).

Fatal Xid list (NVIDIA's Xid catalogue; all mean "reset or replace the GPU"):
  48 double-bit ECC error; 62 internal micro-controller halt; 64 ECC page retirement /
  row remapper recording failure; 74 NVLink error; 79 GPU fallen off the bus; 92 high
  single-bit ECC error rate (the GPU is degrading: drain it); 94 contained ECC error;
  95 uncontained ECC error; 119 GSP RPC timeout; 120 GSP error; 140 unrecovered ECC
  error; 154 GPU recovery action changed (reset / reboot required).
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from stalwart.agent.probes.base import Debounce, HealthEvent, Probe
from stalwart.devices.simgpu import SLOW_THROTTLE_REASONS, THROTTLE_REASONS, SimGpu, default_device

FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140, 154})
THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"})


class GpuSource(Protocol):
    """Anything that reads the machine's GPUs as a list of device dicts (simgpu schema)."""

    kind: str

    def read(self) -> list[dict[str, Any]]:
        """Current state of every expected device, index order."""
        ...


class SimGpuSource:
    """Reads a `SimGpu` state file."""

    kind = "sim"

    def __init__(self, sim: SimGpu) -> None:
        self.sim = sim

    def read(self) -> list[dict[str, Any]]:
        """The simulated devices, as written by chaos."""
        return self.sim.read()


class NvmlSource:
    """Reads real GPUs through NVML (`pynvml` from nvidia-ml-py).

    `count` is the number of GPUs the machine should have; devices NVML no longer lists
    or whose handle fails are reported with present=False. Xid critical-error events are
    collected with a short wait (`event_wait_ms`) on every read and kept per device.
    """

    kind = "nvml"

    def __init__(self, count: int | None = None, event_wait_ms: int = 100, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415 - optional at import time of this module
        self.nvml = nvml
        nvml.nvmlInit()  # raises NVMLError_LibraryNotFound / DriverNotLoaded without a GPU
        self.count = count if count is not None else nvml.nvmlDeviceGetCount()
        self.event_wait_ms = event_wait_ms
        self._xids: dict[int, list[int]] = {i: [] for i in range(self.count)}
        self._events = None
        try:
            events = nvml.nvmlEventSetCreate()
            for i in range(min(self.count, nvml.nvmlDeviceGetCount())):
                try:
                    nvml.nvmlDeviceRegisterEvents(
                        nvml.nvmlDeviceGetHandleByIndex(i), nvml.nvmlEventTypeXidCriticalError, events
                    )
                except nvml.NVMLError_NotSupported:
                    continue
            self._events = events
        except nvml.NVMLError:
            self._events = None

    def close(self) -> None:
        """Free the event set and shut NVML down."""
        if self._events is not None:
            self.nvml.nvmlEventSetFree(self._events)
            self._events = None
        self.nvml.nvmlShutdown()

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        nvml = self.nvml
        wait = self.event_wait_ms
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, wait)
            except nvml.NVMLError_Timeout:
                return
            except nvml.NVMLError:
                return
            wait = 0  # only the first wait blocks; then take what is queued
            try:
                index = nvml.nvmlDeviceGetIndex(data.device)
            except nvml.NVMLError:
                continue
            self._xids.setdefault(index, []).append(int(data.eventData))

    def _optional(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (self.nvml.NVMLError_NotSupported, self.nvml.NVMLError_NoPermission):
            return None

    def _reasons(self, mask: int) -> list[str]:
        nvml = self.nvml
        bits = {
            "gpu_idle": "nvmlClocksEventReasonGpuIdle",
            "applications_clocks_setting": "nvmlClocksEventReasonApplicationsClocksSetting",
            "sw_power_cap": "nvmlClocksEventReasonSwPowerCap",
            "hw_slowdown": "nvmlClocksEventReasonHwSlowdown",
            "sync_boost": "nvmlClocksEventReasonSyncBoost",
            "sw_thermal_slowdown": "nvmlClocksEventReasonSwThermalSlowdown",
            "hw_thermal_slowdown": "nvmlClocksEventReasonHwThermalSlowdown",
            "hw_power_brake_slowdown": "nvmlClocksEventReasonHwPowerBrakeSlowdown",
            "display_clock_setting": "nvmlClocksEventReasonDisplayClockSetting",
        }
        return [name for name, attr in bits.items() if mask & getattr(nvml, attr, 0)]

    def _device(self, i: int) -> dict[str, Any]:
        nvml = self.nvml
        d = default_device(i)
        d["xid"] = list(self._xids.get(i, []))
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            d["name"] = str(nvml.nvmlDeviceGetName(h))
            d["uuid"] = str(nvml.nvmlDeviceGetUUID(h))
            d["temperature"] = int(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        except nvml.NVMLError as exc:  # GpuIsLost, Unknown, InvalidArgument (index gone), ...
            d["present"] = False
            d["error"] = str(exc)
            return d
        dbe = self._optional(
            nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
        sbe = self._optional(
            nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC
        )
        d["ecc_dbe"], d["ecc_sbe"] = int(dbe or 0), int(sbe or 0)
        remap = self._optional(nvml.nvmlDeviceGetRemappedRows, h)  # (corr, unc, pending, failure)
        if remap is not None:
            d["retired_pages_pending"] = bool(remap[2])
            d["row_remap_failure"] = bool(remap[3])
        else:  # pre-Ampere: page retirement
            pending = self._optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
            d["retired_pages_pending"] = pending == nvml.NVML_FEATURE_ENABLED
        limit = self._optional(nvml.nvmlDeviceGetTemperatureThreshold, h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        if limit:
            d["slowdown_temp"] = int(limit)
        mask = self._optional(nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
        d["throttle"] = self._reasons(int(mask or 0))
        clock = self._optional(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM)
        clock_max = self._optional(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_SM)
        if clock and clock_max:
            d["clock_sm"], d["clock_sm_max"] = int(clock), int(clock_max)
        for key, fn in (
            ("pcie_width", nvml.nvmlDeviceGetCurrPcieLinkWidth),
            ("pcie_width_max", nvml.nvmlDeviceGetMaxPcieLinkWidth),
            ("pcie_gen", nvml.nvmlDeviceGetCurrPcieLinkGeneration),
            ("pcie_gen_max", nvml.nvmlDeviceGetMaxPcieLinkGeneration),
        ):
            value = self._optional(fn, h)
            if value:
                d[key] = int(value)
        return d

    def read(self) -> list[dict[str, Any]]:
        """Every expected device; missing or failing ones have present=False."""
        self._drain_xids()
        return [self._device(i) for i in range(self.count)]


def make_gpu_source(sim_path: str | os.PathLike[str], count: int, nvml: Any = None) -> GpuSource:
    """NVML when a driver answers, otherwise the simulated GPU at `sim_path`.

    `nvmlInit` raises NVMLError_LibraryNotFound (no driver library) or
    NVMLError_DriverNotLoaded on machines without GPUs; both fall back to the simulation.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415
        except ImportError:
            return SimGpuSource(SimGpu(sim_path, count))
    try:
        return NvmlSource(count, nvml=nvml)
    except nvml.NVMLError:
        return SimGpuSource(SimGpu(sim_path, count))


def assess(
    devices: list[dict[str, Any]],
    seen_xids: dict[int, int],
    *,
    min_clock_ratio: float = 0.8,
) -> tuple[list[tuple[str, str, dict[str, Any]]], dict[int, int]]:
    """Pure: readings -> (findings, updated seen-Xid counts).

    A finding is (kind, severity, detail). `seen_xids` maps device index to how many of
    its Xids were already reported; only newer ones become findings (a shorter list than
    seen means the device was reset, and all of its Xids are new).
    """
    findings: list[tuple[str, str, dict[str, Any]]] = []
    seen = dict(seen_xids)
    for d in devices:
        i = int(d["index"])
        if not d.get("present", True):
            findings.append(("gpu_lost", "fatal", {"device": i, "error": d.get("error", "device not present")}))
            continue
        xids = list(d.get("xid", []))
        start = seen.get(i, 0)
        if len(xids) < start:
            start = 0
        for code in xids[start:]:
            severity = "fatal" if code in FATAL_XIDS else "info"
            findings.append(("gpu_xid", severity, {"device": i, "xid": code}))
        seen[i] = len(xids)
        if d.get("ecc_dbe", 0) > 0:
            findings.append(("ecc_dbe", "fatal", {"device": i, "count": d["ecc_dbe"]}))
        if d.get("row_remap_failure"):
            findings.append(("row_remap_failure", "fatal", {"device": i}))
        if d.get("retired_pages_pending"):
            findings.append(("retired_pages_pending", "warn", {"device": i}))
        throttle = set(d.get("throttle", []))
        temp, limit = d.get("temperature", 0), d.get("slowdown_temp", 87)
        if temp >= limit or throttle & THERMAL_REASONS:
            findings.append(("gpu_hot", "warn", {"device": i, "temperature": temp, "slowdown_temp": limit}))
        slow = sorted((throttle & SLOW_THROTTLE_REASONS) - THERMAL_REASONS - {"sw_power_cap"})
        clock, clock_max = d.get("clock_sm", 0), d.get("clock_sm_max", 0)
        low_clock = clock_max > 0 and "gpu_idle" not in throttle and clock < min_clock_ratio * clock_max
        if slow or low_clock:
            findings.append(
                ("gpu_throttle", "warn", {"device": i, "reasons": slow, "clock_sm": clock, "clock_sm_max": clock_max})
            )
        width_low = d.get("pcie_width", 0) < d.get("pcie_width_max", 0)
        gen_low = "gpu_idle" not in throttle and d.get("pcie_gen", 0) < d.get("pcie_gen_max", 0)
        if width_low or gen_low:
            findings.append(
                (
                    "pcie_downgrade",
                    "warn",
                    {
                        "device": i,
                        "width": d.get("pcie_width"),
                        "width_max": d.get("pcie_width_max"),
                        "gen": d.get("pcie_gen"),
                        "gen_max": d.get("pcie_gen_max"),
                    },
                )
            )
    return findings, seen


class GpuProbe(Probe):
    """Inspects the machine's GPUs every `interval_s` (10 s, as in ByteRobust Table 3).

    Fatal findings are reported on the first check; warnings only after `warn_after`
    consecutive checks show them for the same device.
    """

    name = "gpu"

    def __init__(
        self, source: GpuSource, interval_s: float = 10.0, warn_after: int = 2, min_clock_ratio: float = 0.8
    ) -> None:
        super().__init__()
        if interval_s <= 0:
            raise ValueError(f"GPU probe interval must be > 0 s, got {interval_s}")
        if not 0 < min_clock_ratio <= 1:
            raise ValueError(f"min_clock_ratio must be in (0, 1], got {min_clock_ratio}")
        self.source = source
        self.interval_s = interval_s
        self.min_clock_ratio = min_clock_ratio
        self._warn = Debounce(warn_after)
        self._seen_xids: dict[int, int] = {}

    def check(self, now: float) -> list[HealthEvent]:
        """Read the source once and turn its state into events."""
        findings, self._seen_xids = assess(self.source.read(), self._seen_xids, min_clock_ratio=self.min_clock_ratio)
        fired = self._warn.observe_all({(k, d["device"]) for k, sev, d in findings if sev == "warn"})
        events: list[HealthEvent] = []
        for kind, severity, detail in findings:
            if severity == "warn" and (kind, detail["device"]) not in fired:
                continue
            certain = severity == "fatal"
            events.append(self.event(kind, severity, certain, now, source=self.source.kind, **detail))
        return events


__all__ = [
    "FATAL_XIDS",
    "THROTTLE_REASONS",
    "GpuProbe",
    "GpuSource",
    "NvmlSource",
    "SimGpuSource",
    "assess",
    "make_gpu_source",
]
