"""Network faults on namespace machines (`stalwart.devices.netns.Machine`).

- NIC faults: ``ip link set <ifname> down|up`` inside the machine's namespace.
- Slow links: a ``tc tbf`` qdisc on both ends of the machine's veth (the inside end
  shapes what the machine sends, the host end what it receives). ``tc netem`` is absent
  from some kernels, so delay and loss are not offered here.
- Partitions: one nftables table per network, family ``bridge`` (named after the
  network's prefix), whose forward chain drops IPv4 packets between listed address pairs.
  Bridged veth-to-veth traffic never reaches the ``inet`` hooks of the root namespace,
  so the ``bridge`` family is the one that sees it. Traffic to the bridge address (the
  controller) is not forwarded and so is not cut by a partition; use `nic_down` for that.

Every function is idempotent and raises `ChaosUnavailable(reason)` when it cannot work here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from typing import Sequence

from stalwart.devices.netns import Machine
from stalwart.errors import StalwartError

_TIMEOUT_S = 10.0
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")
_RATE_UNITS = {
    "bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000,
    "bps": 8, "kbps": 8_000, "mbps": 8_000_000, "gbps": 8_000_000_000,
}


class ChaosUnavailable(StalwartError, RuntimeError):
    """A fault cannot be injected on this host; the message says why."""


def _need(*tools: str) -> None:
    if os.geteuid() != 0:
        raise ChaosUnavailable(f"needs root (uid {os.geteuid()})")
    for tool in tools:
        if shutil.which(tool) is None:
            raise ChaosUnavailable(f"{tool} not found")


def _run(argv: Sequence[str], input: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(argv)} timed out after {_TIMEOUT_S} s") from exc


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed: {proc.stderr.strip() or proc.returncode}")


# ----- NIC ---------------------------------------------------------------------------------
def nic_down(machine: Machine) -> None:
    """Take the machine's NIC down (inside its namespace); idempotent."""
    _need("ip")
    _check(_run(["ip", "-n", machine.ns, "link", "set", machine.ifname, "down"]), f"nic_down {machine.ns}")


def nic_up(machine: Machine, wait_s: float = 2.0) -> None:
    """Bring the NIC back up and restore the default route the kernel dropped; idempotent."""
    _need("ip")
    _check(_run(["ip", "-n", machine.ns, "link", "set", machine.ifname, "up"]), f"nic_up {machine.ns}")
    _check(
        _run(["ip", "-n", machine.ns, "route", "replace", "default", "via", machine.gateway]),
        f"default route in {machine.ns}",
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        out = _run(["ip", "-n", machine.ns, "-br", "link", "show", machine.ifname]).stdout.split()
        if len(out) >= 2 and out[1] == "UP":
            return
        time.sleep(0.02)
    raise RuntimeError(f"{machine.ifname} in {machine.ns} not UP {wait_s} s after nic_up")


def nic_flap(machine: Machine, times: int = 2, down_s: float = 0.5, up_s: float | None = None) -> None:
    """Take the NIC down for `down_s` and up again, `times` times (`up_s` between, default down_s)."""
    if not isinstance(times, int) or times < 1:
        raise ValueError(f"nic_flap times must be an int >= 1, got {times!r}")
    if down_s <= 0 or (up_s is not None and up_s < 0):
        raise ValueError(f"nic_flap needs down_s > 0 and up_s >= 0, got {down_s!r}, {up_s!r}")
    up_s = down_s if up_s is None else up_s
    for k in range(times):
        nic_down(machine)
        try:
            time.sleep(down_s)
        finally:
            nic_up(machine)
        if k + 1 < times:
            time.sleep(up_s)


# ----- bandwidth ---------------------------------------------------------------------------
def parse_rate(rate: str) -> int:
    """tc-style rate ("1mbit", "500kbit", "10mbps") to bits per second (pure)."""
    m = _RATE_RE.match(str(rate).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {rate!r} must look like 1mbit, 500kbit, 1gbit or 10mbps")
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2)])


def tbf_args(rate: str) -> list[str]:
    """The `tc qdisc ... tbf` parameters for `rate`: a 10 ms burst (at least 16 KiB), 100 ms queue (pure)."""
    bps = parse_rate(rate)
    burst = max(bps // 8 // 100, 16 * 1024)
    return ["tbf", "rate", f"{bps}bit", "burst", str(burst), "latency", "100ms"]


def _tc(ns: str | None, argv: list[str]) -> subprocess.CompletedProcess:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return _run(prefix + ["tc"] + argv)


def link_slow(machine: Machine, rate: str = "1mbit") -> None:
    """Limit the machine's link to `rate` in both directions with tc tbf; idempotent (replaces)."""
    args = tbf_args(rate)
    _need("ip", "tc")
    for ns, dev in ((machine.ns, machine.ifname), (None, machine.host_ifname)):
        proc = _tc(ns, ["qdisc", "replace", "dev", dev, "root"] + args)
        if proc.returncode != 0:
            err = proc.stderr.strip()
            if "unknown qdisc" in err.lower() or "not supported" in err.lower():
                raise ChaosUnavailable(f"tc tbf unavailable in this kernel: {err}")
            raise RuntimeError(f"tc qdisc replace on {dev} failed: {err}")


def link_restore(machine: Machine) -> None:
    """Remove the rate limit from both ends of the machine's link; idempotent."""
    _need("ip", "tc")
    for ns, dev in ((machine.ns, machine.ifname), (None, machine.host_ifname)):
        proc = _tc(ns, ["qdisc", "del", "dev", dev, "root"])
        err = proc.stderr.lower()
        if proc.returncode != 0 and not ("no such file" in err or "handle of zero" in err or "cannot find" in err):
            raise RuntimeError(f"tc qdisc del on {dev} failed: {proc.stderr.strip()}")


# ----- partitions --------------------------------------------------------------------------
CHAIN = "partition"
PAIRS_SET = "parted"


def partition_table(prefix: str) -> str:
    """The nft script creating the partition table of network `prefix` (pure)."""
    return (
        f"table bridge {prefix} {{\n"
        f"  set {PAIRS_SET} {{ type ipv4_addr . ipv4_addr; }}\n"
        f"  chain {CHAIN} {{\n"
        f"    type filter hook forward priority 0; policy accept;\n"
        f"    ip saddr . ip daddr @{PAIRS_SET} drop\n"
        f"  }}\n"
        f"}}\n"
    )


def _same_network(a: Machine, b: Machine) -> str:
    if a.prefix != b.prefix:
        raise ValueError(f"machines {a.ns} and {b.ns} belong to different networks")
    if a.address == b.address:
        raise ValueError(f"cannot partition machine {a.ns} from itself")
    return a.prefix


def partition(a: Machine, b: Machine) -> None:
    """Drop all IPv4 traffic between machines `a` and `b` (both directions); idempotent."""
    prefix = _same_network(a, b)
    _need("nft")
    if _run(["nft", "list", "table", "bridge", prefix]).returncode != 0:
        proc = _run(["nft", "-f", "-"], input=partition_table(prefix))
        if proc.returncode != 0:
            err = proc.stderr.strip()
            if "not supported" in err.lower() or "protocol not" in err.lower():
                raise ChaosUnavailable(f"nftables bridge family unavailable: {err}")
            raise RuntimeError(f"creating nft table bridge {prefix} failed: {err}")
    elements = f"{{ {a.address} . {b.address}, {b.address} . {a.address} }}"
    _check(_run(["nft", "add", "element", "bridge", prefix, PAIRS_SET, elements]), f"partition {a.ns} {b.ns}")


def heal(a: Machine, b: Machine) -> None:
    """Undo `partition(a, b)`; removes the table when no pair is left; idempotent."""
    prefix = _same_network(a, b)
    _need("nft")
    if _run(["nft", "list", "table", "bridge", prefix]).returncode != 0:
        return
    for src, dst in ((a.address, b.address), (b.address, a.address)):
        proc = _run(["nft", "delete", "element", "bridge", prefix, PAIRS_SET, f"{{ {src} . {dst} }}"])
        if proc.returncode != 0 and "no such file" not in proc.stderr.lower():
            raise RuntimeError(f"heal {a.ns} {b.ns} failed: {proc.stderr.strip()}")
    if not partitioned_pairs(prefix):
        _run(["nft", "delete", "table", "bridge", prefix])


def partitioned_pairs(prefix: str) -> set[tuple[str, str]]:
    """The (source, destination) address pairs currently dropped in network `prefix`."""
    _need("nft")
    proc = _run(["nft", "list", "set", "bridge", prefix, PAIRS_SET])
    if proc.returncode != 0:
        return set()
    return parse_pairs(proc.stdout)


def parse_pairs(nft_set_listing: str) -> set[tuple[str, str]]:
    """Address pairs from `nft list set` output (pure)."""
    return set(re.findall(r"(\d+\.\d+\.\d+\.\d+) \. (\d+\.\d+\.\d+\.\d+)", nft_set_listing))


__all__ = [
    "ChaosUnavailable", "nic_down", "nic_up", "nic_flap", "link_slow", "link_restore",
    "partition", "heal", "partitioned_pairs", "parse_rate", "tbf_args", "partition_table", "parse_pairs",
]
