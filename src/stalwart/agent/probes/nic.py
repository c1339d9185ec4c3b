"""NIC probe: link state, carrier flaps and error counters from sysfs.

Reads `<root>/<if>/operstate`, `carrier`, `carrier_changes` and `statistics/*_errors`
(root = /sys/class/net; tests pass a temp dir laid out the same way). Every finding is a
warning and never machine-certain: NIC and switch problems often heal by themselves, so
the controller evicts only after repeated alerts (ByteRobust: twice within 5 minutes).
Checked every 30 s by default (Table 3: network items are inspected every 30 s).

Events: nic_missing (interface gone), nic_down (operstate not up, or no carrier),
nic_flap (carrier_changes grew since the last check), nic_errors (an error counter grew
by at least `error_threshold`), nic_drops (`rx_dropped` + `tx_dropped` grew by at least
`drop_threshold` in one check: a host drops packets under load now and then, so only a burst
counts). Each carries `occurrences`, the ids of the underlying occurrences it saw
(`occurrences.Occurrences`: a link that stays down is one occurrence however many checks see it,
and the down and the carrier change of one flap are the same one; errors or drops growing on
consecutive checks are one), and `standing`, whether the condition still holds at this check (a
link down, an interface missing), so the controller counts each occurrence once.
"""

from __future__ import annotations

import os

from stalwart.agent.probes.base import HealthEvent, Probe
from stalwart.agent.probes.occurrences import Occurrences, down_transitions

# operstate values that mean the link is usable ("unknown" is what loopback and many
# virtual devices report; their carrier decides).
_UP_STATES = {"up", "unknown"}


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:  # missing file, or EINVAL reading carrier of a down interface
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


class NicProbe(Probe):
    """Watches the given interfaces (all but loopback when None) under `root`."""

    name = "nic"

    def __init__(
        self,
        interfaces: list[str] | None = None,
        root: str = "/sys/class/net",
        interval_s: float = 30.0,
        error_threshold: int = 1,
        drop_threshold: int = 1000,
    ) -> None:
        super().__init__()
        if interval_s <= 0:
            raise ValueError(f"NIC probe interval must be > 0 s, got {interval_s}")
        if error_threshold < 1:
            raise ValueError(f"NIC error threshold must be >= 1, got {error_threshold}")
        self.root = root
        self.interval_s = interval_s
        self.error_threshold = error_threshold
        if drop_threshold < 1:
            raise ValueError(f"NIC drop threshold must be >= 1, got {drop_threshold}")
        self.drop_threshold = drop_threshold
        self._drops: dict[str, dict[str, int]] = {}
        self._fixed = list(interfaces) if interfaces is not None else None
        self._carrier_changes: dict[str, int] = {}
        self._errors: dict[str, dict[str, int]] = {}
        self._seen = Occurrences()

    def interfaces(self) -> list[str]:
        """The interfaces to inspect: the configured ones, or every non-loopback one present."""
        if self._fixed is not None:
            return self._fixed
        try:
            return sorted(n for n in os.listdir(self.root) if n != "lo")
        except OSError:
            return []

    def _counters(self, iface: str, suffix: str = "_errors") -> dict[str, int]:
        stats = os.path.join(self.root, iface, "statistics")
        try:
            names = sorted(n for n in os.listdir(stats) if n.endswith(suffix))
        except OSError:
            return {}
        out = {}
        for n in names:
            v = _read_int(os.path.join(stats, n))
            if v is not None:
                out[n] = v
        return out

    def check(self, now: float) -> list[HealthEvent]:
        """Compare each interface with the last check and report what went wrong."""
        events: list[HealthEvent] = []
        for iface in self.interfaces():
            base = os.path.join(self.root, iface)
            if not os.path.isdir(base):
                ids, _ = self._seen.observe((iface, "missing"), 0, True, now)
                events.append(self.event("nic_missing", "warn", False, now, interface=iface,
                                         occurrences=ids, standing=True))
                self._carrier_changes.pop(iface, None)
                self._errors.pop(iface, None)
                self._drops.pop(iface, None)
                continue
            self._seen.observe((iface, "missing"), 0, False, now)
            state = _read(os.path.join(base, "operstate")) or "unknown"
            carrier = _read_int(os.path.join(base, "carrier"))
            down = state not in _UP_STATES or carrier == 0
            changes = _read_int(os.path.join(base, "carrier_changes"))
            before = self._carrier_changes.get(iface)
            grew = changes - before if changes is not None and before is not None and changes > before else 0
            link = (iface, "link")
            ids, _ = self._seen.observe(link, down_transitions(grew, self._seen.is_open(link)), down, now)
            if down:
                events.append(
                    self.event("nic_down", "warn", False, now, interface=iface, operstate=state, carrier=carrier,
                               occurrences=ids, standing=True)
                )
            if grew:
                events.append(
                    self.event("nic_flap", "warn", False, now, interface=iface, carrier_changes=grew,
                               occurrences=ids, standing=False)
                )
            if changes is not None:
                self._carrier_changes[iface] = changes
            counters = self._counters(iface)
            previous = self._errors.get(iface)
            if previous is not None:
                grown = {
                    k: v - previous[k]
                    for k, v in counters.items()
                    if k in previous and v - previous[k] >= self.error_threshold
                }
                # errors growing on consecutive checks are one occurrence
                ids, _ = self._seen.observe((iface, "errors"), 0, bool(grown), now)
                if grown:
                    events.append(self.event("nic_errors", "warn", False, now, interface=iface, delta=grown,
                                             occurrences=ids, standing=False))
            self._errors[iface] = counters
            drops, before_drops = self._counters(iface, "_dropped"), self._drops.get(iface)
            self._drops[iface] = drops
            if before_drops is not None:
                delta = {k: v - before_drops[k] for k, v in drops.items() if k in before_drops and v > before_drops[k]}
                burst = sum(delta.values()) >= self.drop_threshold
                ids, _ = self._seen.observe((iface, "drops"), 0, burst, now)
                if burst:
                    events.append(self.event("nic_drops", "warn", False, now, interface=iface, delta=delta,
                                             occurrences=ids, standing=False))
        return events
