"""Local "machines" as Linux network namespaces joined by a bridge.

One `Network` per local cluster: a bridge ``<prefix>br`` in the root namespace holds the
gateway address ``10.213.<idx>.1/24`` (where the controller is reachable from every
machine), and each `Machine` is a namespace ``<prefix>-m<i>`` with one end of a veth pair
(``<prefix>i<i>`` inside, ``<prefix>h<i>`` on the bridge) at ``10.213.<idx>.<10+i>``.
Workers inside a machine must set ``GLOO_SOCKET_IFNAME`` to the machine's ``ifname``
(`Machine.env` does it).

Every creation step is recorded in a JSON state file *before* it runs, so that
`cleanup_stale` can remove the leftovers of a process that crashed half-way.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from stalwart.errors import StalwartError

IFNAMSIZ = 15  # usable characters of a Linux interface name
SUBNET_BASE = "10.213"
MAX_MACHINES = 245  # host part 10 + i must stay <= 254
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_CMD_TIMEOUT_S = 15.0
ETC_NETNS = Path("/etc/netns")  # `ip netns exec` bind-mounts /etc/netns/<ns>/<file> over /etc/<file>
# No DNS server is reachable from a machine: without this, every reverse lookup (c10d does
# one per connection) waits for the host's resolver to time out, ~10 s per gloo init.
RESOLV_CONF = ("# stalwart namespace machine: no DNS here, fail lookups at once\n"
               "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


class NetnsError(StalwartError, RuntimeError):
    """A system command that builds or removes the network failed."""


def available() -> tuple[bool, str]:
    """Whether namespaces can be built here: (True, "ok") or (False, why not)."""
    if os.geteuid() != 0:
        return False, f"needs root (uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return False, "ip not found (Debian package iproute2)"
    if not Path("/proc/self/ns/net").exists():
        return False, "kernel without network namespaces"
    return True, "ok"


def validate_prefix(prefix: str) -> str:
    """Return `prefix` if it can name bridges, links, namespaces and nft tables; else ValueError."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"network prefix {prefix!r} must be 1-10 characters of [a-z0-9] starting with a letter"
        )
    return prefix


def names_for(prefix: str, index: int) -> dict[str, str]:
    """The namespace, inside and host interface names of machine `index` (pure)."""
    validate_prefix(prefix)
    if not isinstance(index, int) or not 0 <= index < MAX_MACHINES:
        raise ValueError(f"machine index {index!r} must be an int in [0, {MAX_MACHINES})")
    names = {"ns": f"{prefix}-m{index}", "ifname": f"{prefix}i{index}", "host_ifname": f"{prefix}h{index}"}
    for key in ("ifname", "host_ifname"):
        assert len(names[key]) <= IFNAMSIZ, names[key]
    return names


def bridge_mac(prefix: str) -> str:
    """A fixed, locally administered MAC address for the bridge of this prefix (pure). A bridge
    without an address of its own takes its lowest port's, so a machine added or removed later
    (a standby handed back, a fresh one) changed the gateway's MAC under every namespace's ARP
    cache, and their connections to the controller's store stalled for a minute."""
    digest = hashlib.sha256(prefix.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02,) + tuple(digest[:5]))


def bridge_name(prefix: str) -> str:
    """Name of the bridge of a network with this prefix (pure)."""
    return f"{validate_prefix(prefix)}br"


def machine_address(subnet_index: int, index: int) -> str:
    """IPv4 address of machine `index` in subnet `subnet_index` (pure)."""
    return f"{SUBNET_BASE}.{subnet_index}.{10 + index}"


def gateway_address(subnet_index: int) -> str:
    """Bridge (gateway, controller) address of subnet `subnet_index` (pure)."""
    return f"{SUBNET_BASE}.{subnet_index}.1"


def pick_free_subnet(used: set[int]) -> int:
    """Lowest subnet index in [1, 254] not in `used` (pure); ValueError when all are taken."""
    for idx in range(1, 255):
        if idx not in used:
            return idx
    raise ValueError(f"no free subnet left in {SUBNET_BASE}.0.0/16")


def used_subnets(addr_json: list[dict[str, Any]]) -> set[int]:
    """Subnet indexes of 10.213.x.y addresses in `ip -j -4 addr` output (pure)."""
    used: set[int] = set()
    for link in addr_json:
        for info in link.get("addr_info", []):
            parts = str(info.get("local", "")).split(".")
            if len(parts) == 4 and ".".join(parts[:2]) == SUBNET_BASE:
                used.add(int(parts[2]))
    return used


def default_state_dir() -> Path:
    """Where state files go unless told: /run/stalwart/netns as root, else the temp dir."""
    if os.geteuid() == 0 and Path("/run").is_dir():
        return Path("/run/stalwart/netns")
    return Path(tempfile.gettempdir()) / "stalwart-netns"


def subnet_lock_path() -> Path:
    """Host-wide lock serializing subnet choice between networks of every process and state dir."""
    run_lock = Path("/run/lock")
    base = run_lock if run_lock.is_dir() and os.access(run_lock, os.W_OK) else Path(tempfile.gettempdir())
    return base / "stalwart-netns-subnet.lock"


def _run(argv: Sequence[str], check: bool = True, timeout: float = _CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise NetnsError(f"{argv[0]} not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(argv)} timed out after {timeout} s") from exc
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _gone(proc: subprocess.CompletedProcess) -> bool:
    """True when a failed delete failed only because the object does not exist."""
    err = proc.stderr.lower()
    return any(s in err for s in ("cannot find device", "no such file", "does not exist", "not found"))


def _links() -> set[str]:
    out = _run(["ip", "-j", "link", "show"]).stdout
    return {link["ifname"] for link in json.loads(out or "[]")}


def _namespaces() -> set[str]:
    out = _run(["ip", "-j", "netns", "list"]).stdout.strip()
    return {ns["name"] for ns in json.loads(out or "[]")}


def _kill_ns_processes(ns: str, timeout: float = 5.0) -> None:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    pids = [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
        if pids:
            time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _delete_link(name: str) -> bool:
    proc = _run(["ip", "link", "del", name], check=False)
    if proc.returncode != 0 and not _gone(proc):
        raise NetnsError(f"ip link del {name} failed: {proc.stderr.strip()}")
    return proc.returncode == 0


def _delete_ns(ns: str) -> bool:
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    if ns not in _namespaces():
        return False
    _kill_ns_processes(ns)
    proc = _run(["ip", "netns", "del", ns], check=False)
    if proc.returncode != 0 and not _gone(proc):
        raise NetnsError(f"ip netns del {ns} failed: {proc.stderr.strip()}")
    return proc.returncode == 0


def _delete_nft_tables(prefix: str) -> list[str]:
    if shutil.which("nft") is None:
        return []
    removed = []
    out = _run(["nft", "list", "tables"], check=False).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "table" and parts[2] == prefix:
            if _run(["nft", "delete", "table", parts[1], prefix], check=False).returncode == 0:
                removed.append(f"nft table {parts[1]} {prefix}")
    return removed


@dataclass(frozen=True)
class Machine:
    """One namespace "machine" of a `Network`."""

    name: str
    index: int
    ns: str
    ifname: str
    host_ifname: str
    address: str
    gateway: str
    prefix: str  # the owning network's prefix (names its nft table)

    def exec_prefix(self) -> list[str]:
        """Argv prefix that runs a command inside this machine's namespace."""
        return ["ip", "netns", "exec", self.ns]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """A copy of `base` (default os.environ) with gloo/tensorpipe bound to this machine's NIC."""
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = self.ifname
        env["TP_SOCKET_IFNAME"] = self.ifname
        return env

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start `argv` inside the namespace (Popen keywords pass through; the pid is the program's)."""
        if not argv:
            raise ValueError("popen needs a non-empty argv")
        return subprocess.Popen(self.exec_prefix() + [str(a) for a in argv], **kw)

    def run(self, argv: Sequence[str], timeout: float = _CMD_TIMEOUT_S, **kw: Any) -> subprocess.CompletedProcess:
        """Run `argv` inside the namespace to completion (captured text output, bounded)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.exec_prefix() + [str(a) for a in argv], timeout=timeout, **kw)


@dataclass
class Network:
    """A bridge in the root namespace plus namespaces attached to it by veth pairs."""

    prefix: str
    subnet_index: int | None = None
    state_dir: Path | str | None = None
    machines: dict[int, Machine] = field(default_factory=dict, init=False)
    _created: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        validate_prefix(self.prefix)
        if self.subnet_index is not None and not (isinstance(self.subnet_index, int) and 1 <= self.subnet_index <= 254):
            raise ValueError(f"subnet_index {self.subnet_index!r} must be an int in [1, 254]")
        self.state_dir = Path(self.state_dir) if self.state_dir is not None else default_state_dir()
        self.bridge = bridge_name(self.prefix)

    # ----- state file -------------------------------------------------------------------
    def state_file(self) -> Path:
        """Path of the JSON record of what this network has (or is about to have) created."""
        return Path(self.state_dir) / f"{self.prefix}.json"

    def _record(self, pending_machine: int | None = None) -> None:
        machines = {str(i): names_for(self.prefix, i) for i in self.machines}
        if pending_machine is not None:
            machines[str(pending_machine)] = names_for(self.prefix, pending_machine)
        record = {
            "prefix": self.prefix,
            "subnet_index": self.subnet_index,
            "bridge": self.bridge,
            "nft_table": self.prefix,
            "machines": machines,
            "pid": os.getpid(),
            "pid_start": _pid_start(os.getpid()),
        }
        path = self.state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)

    # ----- lifecycle --------------------------------------------------------------------
    @property
    def gateway(self) -> str:
        """The bridge address (where root-namespace services such as the controller listen)."""
        if self.subnet_index is None:
            raise ValueError("network not created yet: no subnet chosen")
        return gateway_address(self.subnet_index)

    def create(self) -> None:
        """Create the bridge with the gateway address and bring it up; ValueError if it exists."""
        ok, why = available()
        if not ok:
            raise NetnsError(why)
        if self._created:
            return
        Path(self.state_dir).mkdir(parents=True, exist_ok=True)
        with open(subnet_lock_path(), "w") as lock:  # one host-wide lock, whatever the state dir
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.bridge in _links():
                raise ValueError(
                    f"bridge {self.bridge} already exists: another live Network uses prefix "
                    f"{self.prefix!r}, or a crash left it (cleanup_stale({self.prefix!r}))"
                )
            used = used_subnets(json.loads(_run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"))
            if self.subnet_index is None:
                self.subnet_index = pick_free_subnet(used)
            elif self.subnet_index in used:
                raise ValueError(f"subnet {SUBNET_BASE}.{self.subnet_index}.0/24 is already in use here")
            self._record()
            _run(["ip", "link", "add", self.bridge, "address", bridge_mac(self.prefix), "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
        self._created = True

    def add_machine(self, i: int) -> Machine:
        """Create machine `i`: namespace, veth pair on the bridge, its address, lo up, default route."""
        if not self._created:
            raise ValueError("call Network.create() before add_machine()")
        names = names_for(self.prefix, i)
        if i in self.machines:
            return self.machines[i]
        m = Machine(
            name=f"m{i}", index=i, ns=names["ns"], ifname=names["ifname"], host_ifname=names["host_ifname"],
            address=machine_address(self.subnet_index, i), gateway=self.gateway, prefix=self.prefix,
        )
        self._record(pending_machine=i)
        (ETC_NETNS / m.ns).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / m.ns / "resolv.conf").write_text(RESOLV_CONF)
        _run(["ip", "netns", "add", m.ns])
        # the inside end is born in the namespace: nothing named <prefix>i<n> ever sits in the root ns
        _run(["ip", "link", "add", m.host_ifname, "type", "veth", "peer", "name", m.ifname, "netns", m.ns])
        _run(["ip", "link", "set", m.host_ifname, "master", self.bridge])
        _run(["ip", "link", "set", m.host_ifname, "up"])
        _run(["ip", "-n", m.ns, "addr", "add", f"{m.address}/24", "dev", m.ifname])
        _run(["ip", "-n", m.ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", m.ns, "link", "set", m.ifname, "up"])
        _run(["ip", "-n", m.ns, "route", "replace", "default", "via", m.gateway])
        self.machines[i] = m
        return m

    def remove_machine(self, i: int) -> None:
        """Kill what runs in machine `i`, delete its links and namespace (idempotent)."""
        names = names_for(self.prefix, i)
        _delete_link(names["host_ifname"])
        _delete_ns(names["ns"])
        self.machines.pop(i, None)
        if self.state_file().exists():
            self._record()

    def destroy(self) -> None:
        """Remove every machine, the nft table and the bridge, then the state file (idempotent).

        A network that never got past `create`'s checks (no state file) owns nothing and
        removes nothing, so a failed duplicate cannot tear down the live network it collided with.
        """
        if not (self._created or self.machines or self.state_file().exists()):
            return
        recorded: set[int] = set()
        try:
            recorded = {int(k) for k in json.loads(self.state_file().read_text()).get("machines", {})}
        except (OSError, ValueError):
            pass
        for i in sorted(recorded | set(self.machines)):
            self.remove_machine(i)
        _delete_nft_tables(self.prefix)
        _delete_link(self.bridge)
        self.state_file().unlink(missing_ok=True)
        self._created = False

    def __enter__(self) -> "Network":
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _pid_start(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _owner_alive(record: dict[str, Any]) -> bool:
    pid = record.get("pid")
    if not isinstance(pid, int) or not Path(f"/proc/{pid}").exists():
        return False
    return _pid_start(pid) == record.get("pid_start")


def _cleanup_prefix(prefix: str) -> list[str]:
    removed: list[str] = []
    ns_re = re.compile(rf"^{re.escape(prefix)}-m\d+$")
    host_re = re.compile(rf"^{re.escape(prefix)}h\d+$")
    for link in sorted(_links()):
        if host_re.match(link) and _delete_link(link):
            removed.append(f"link {link}")
    for ns in sorted(_namespaces()):
        if ns_re.match(ns) and _delete_ns(ns):
            removed.append(f"netns {ns}")
    if ETC_NETNS.is_dir():
        for d in sorted(ETC_NETNS.iterdir()):
            if ns_re.match(d.name):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(f"dir {d}")
    removed += _delete_nft_tables(prefix)
    if _delete_link(bridge_name(prefix)):
        removed.append(f"bridge {bridge_name(prefix)}")
    return removed


def cleanup_stale(prefix_or_state_dir: str | Path, state_dir: Path | str | None = None) -> list[str]:
    """Remove leftovers of crashed networks; return what was removed ("netns x-m0", "bridge xbr", ...).

    Given a directory (a Path, or a string containing "/"): every network recorded there
    whose owning process is gone (live owners are left alone).
    Given a prefix: everything with that prefix, unconditionally (namespaces, veths, bridge,
    nft tables), and its state file in `state_dir` (default: `default_state_dir()`).
    """
    ok, why = available()
    if not ok:
        raise NetnsError(why)
    target = Path(prefix_or_state_dir)
    if isinstance(prefix_or_state_dir, Path) or "/" in str(prefix_or_state_dir):
        if not target.is_dir():
            raise ValueError(f"state dir {target} does not exist")
        removed: list[str] = []
        for path in sorted(target.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                prefix = validate_prefix(record["prefix"])
            except (OSError, ValueError, KeyError) as exc:
                raise ValueError(f"unreadable netns state file {path}: {exc}") from exc
            if _owner_alive(record):
                continue
            removed += _cleanup_prefix(prefix)
            path.unlink(missing_ok=True)
        return removed
    prefix = validate_prefix(str(prefix_or_state_dir))
    removed = _cleanup_prefix(prefix)
    base = Path(state_dir) if state_dir is not None else default_state_dir()
    base.joinpath(f"{prefix}.json").unlink(missing_ok=True)
    return removed


__all__ = [
    "Machine", "Network", "NetnsError", "available", "cleanup_stale", "names_for", "bridge_name",
    "machine_address", "gateway_address", "pick_free_subnet", "used_subnets", "validate_prefix",
    "default_state_dir",
]
