"""RDMA port probe: state and error counters of InfiniBand / RoCE ports from sysfs.

Reads `<root>/<device>/ports/<n>/state` ("4: ACTIVE"), `phys_state` ("5: LinkUp") and the
port's `counters/` (root = /sys/class/infiniband; tests pass a temp dir laid out the same way).
The training fabric of a GPU machine is usually its RDMA ports, not the interface of its default
route, so an agent watches every port present unless `--nic` names the ones to watch.

Its events carry the NIC probe's kinds and fields (the controller counts them as network alerts),
with `interface` = "<device>/<port>" and `rdma: true`:
  nic_down (state not ACTIVE), nic_flap (`link_downed` grew: the port lost its link and
  retrained), nic_errors (an error counter grew by at least `error_threshold`), nic_drops
  (`port_xmit_discards` or `VL15_dropped` grew by at least `drop_threshold`: congestion more often
  than a fault, hence its own threshold).
Like the NIC probe's, each carries `occurrences` and `standing`: a port that stays down is one
occurrence however many checks see it, its down state and the `link_downed` step of the same
event are one, and counters growing on consecutive checks are one (`occurrences.Occurrences`).
"""
from __future__ import annotations

import os

from stalwart.agent.probes.base import HealthEvent, Probe
from stalwart.agent.probes.nic import _read, _read_int
from stalwart.agent.probes.occurrences import Occurrences

ACTIVE = "ACTIVE"
FLAP_COUNTER = "link_downed"
DROP_COUNTERS = ("port_xmit_discards", "VL15_dropped")
ERROR_COUNTERS = ("symbol_error", "link_error_recovery", "port_rcv_errors", "port_rcv_remote_physical_errors",
                  "port_rcv_switch_relay_errors", "port_xmit_constraint_errors", "port_rcv_constraint_errors",
                  "local_link_integrity_errors", "excessive_buffer_overrun_errors")


def ports(root: str = "/sys/class/infiniband") -> list[str]:
    """Every RDMA port present, as "<device>/<port>" (none without /sys/class/infiniband)."""
    out = []
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    for dev in devices:
        try:
            out += [f"{dev}/{n}" for n in sorted(os.listdir(os.path.join(root, dev, "ports")), key=_port_key)]
        except OSError:
            continue
    return out


def _port_key(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def netdevs(device: str, root: str = "/sys/class/infiniband") -> list[str]:
    """The network interfaces an RDMA device backs (RoCE: its Ethernet netdev), from sysfs."""
    try:
        return sorted(os.listdir(os.path.join(root, device, "device", "net")))
    except OSError:
        return []


def _state(text: str | None) -> str | None:
    """'4: ACTIVE' -> 'ACTIVE'."""
    return text.split(":", 1)[-1].strip() if text else None


class RdmaProbe(Probe):
    """Watches RDMA ports ("<device>/<port>") under `root`."""

    name = "nic"       # network alerts, counted like the NIC probe's

    def __init__(self, port_names: list[str], root: str = "/sys/class/infiniband", interval_s: float = 1.0,
                 error_threshold: int = 1, drop_threshold: int = 1000) -> None:
        super().__init__()
        if interval_s <= 0 or error_threshold < 1 or drop_threshold < 1:
            raise ValueError("RDMA probe: interval must be > 0 s and thresholds >= 1")
        self.ports = list(port_names)
        self.root = root
        self.interval_s = interval_s
        self.error_threshold = error_threshold
        self.drop_threshold = drop_threshold
        self._counters: dict[str, dict[str, int]] = {}
        self._seen = Occurrences()

    def _read_counters(self, base: str) -> dict[str, int]:
        out = {}
        for name in (FLAP_COUNTER,) + DROP_COUNTERS + ERROR_COUNTERS:
            v = _read_int(os.path.join(base, "counters", name))
            if v is not None:
                out[name] = v
        return out

    def check(self, now: float) -> list[HealthEvent]:
        events: list[HealthEvent] = []
        for port in self.ports:
            dev, _, n = port.partition("/")
            base = os.path.join(self.root, dev, "ports", n)
            if not os.path.isdir(base):
                ids, _ = self._seen.observe((port, "missing"), 0, True, now)
                events.append(self.event("nic_missing", "warn", False, now, interface=port, rdma=True,
                                         occurrences=ids, standing=True))
                self._counters.pop(port, None)
                continue
            self._seen.observe((port, "missing"), 0, False, now)
            state, phys = _state(_read(os.path.join(base, "state"))), _state(_read(os.path.join(base, "phys_state")))
            counters = self._read_counters(base)
            before = self._counters.get(port)
            self._counters[port] = counters
            grown = {k: v - before[k] for k, v in counters.items() if k in before and v > before[k]} \
                if before is not None else {}
            # each `link_downed` step is one time the port lost its link
            ids, _ = self._seen.observe((port, "link"), grown.get(FLAP_COUNTER, 0), state != ACTIVE, now)
            if state != ACTIVE:
                events.append(self.event("nic_down", "warn", False, now, interface=port, rdma=True,
                                         operstate=state, phys_state=phys, occurrences=ids, standing=True))
            if grown.get(FLAP_COUNTER):
                events.append(self.event("nic_flap", "warn", False, now, interface=port, rdma=True,
                                         carrier_changes=grown[FLAP_COUNTER], occurrences=ids, standing=False))
            if before is None:
                continue
            errors = {k: d for k, d in grown.items() if k in ERROR_COUNTERS and d >= self.error_threshold}
            ids, _ = self._seen.observe((port, "errors"), 0, bool(errors), now)
            if errors:
                events.append(self.event("nic_errors", "warn", False, now, interface=port, rdma=True, delta=errors,
                                         occurrences=ids, standing=False))
            drops = {k: d for k, d in grown.items() if k in DROP_COUNTERS}
            burst = sum(drops.values()) >= self.drop_threshold
            ids, _ = self._seen.observe((port, "drops"), 0, burst, now)
            if burst:
                events.append(self.event("nic_drops", "warn", False, now, interface=port, rdma=True, delta=drops,
                                         occurrences=ids, standing=False))
        return events
