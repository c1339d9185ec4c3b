"""Per-peer TCP figures of a machine's workers, from the kernel's `tcp_info` (`ss -tinHe`).

The workers' collectives (gloo pairs, the rendezvous store) run over TCP connections to the other
machines, and the kernel keeps, per connection, what the network did to it: the smoothed RTT, the
retransmissions, the data not yet acknowledged, the RTO backoff. A slow link inflates the RTT of
every connection through it (the queue in front of it), a flapping NIC or a partition makes the
connections through it retransmit and back off, while the connections between two healthy machines
stay as they were: a per-pair signal that the collectives' own traces (gloo records no durations,
and a network fault stalls every rank alike) do not give. The controller's link detector
(`analyzer/links.py`) compares the pairs.

Each sample reads the sockets of the workers' process trees (their inodes, from ``/proc/PID/fd``),
runs ``ss -tinHe state established`` once per network namespace the workers live in (a local
namespace machine's workers: ``nsenter --net=/proc/PID/ns/net``, which needs root), keeps the
workers' sockets to addresses other than their own and loopback, and sums them per (local, peer)
address since the previous sample (`protocol.LinkStat`). `ss` rather than a netlink library: one
small process per namespace per heartbeat, no dependency, and its text is parsed by the pure
`parse_ss`. Where `ss` is missing or the namespace cannot be entered the sampler switches itself off
and says so once in the agent's log.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterable

from stalwart import protocol as p

log = logging.getLogger("stalwart.agent.tcpstats")

SS_TIMEOUT_S = 2.0
_ADDR = re.compile(r"^\[?([0-9a-fA-F.:]+?)(?:%[^\]]*)?\]?:(\d+|\*)$")


@dataclass(frozen=True)
class SockStat:
    """One established TCP socket as `ss -tinHe` shows it (fields absent from its line are 0)."""
    local: str
    local_port: int
    peer: str
    peer_port: int
    inode: int
    rtt_ms: float = 0.0
    rttvar_ms: float = 0.0
    retrans: int = 0              # retransmitted segments now outstanding
    total_retrans: int = 0        # ... since the connection opened
    dsack_dups: int = 0           # ... of which the peer reported duplicates (spurious: nothing lost)
    unacked: int = 0
    backoff: int = 0
    lost: int = 0
    bytes_acked: int = 0
    bytes_received: int = 0


def _addr(text: str) -> tuple[str, int] | None:
    m = _ADDR.match(text)
    if not m or m.group(2) == "*":
        return None
    host = m.group(1)
    if host.startswith("::ffff:") and "." in host:      # an IPv4 peer of a dual-stack socket
        host = host[7:]
    return host, int(m.group(2))


def _num(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def parse_ss(text: str) -> list[SockStat]:
    """The sockets of ``ss -tinHe [state established]`` output (pure). Each socket is a line of
    ``[State] Recv-Q Send-Q Local:Port Peer:Port ino:N ...`` followed by an indented line of
    ``key:value`` figures; a socket without an inode or a parsable address is skipped."""
    out: list[SockStat] = []
    head: list[str] | None = None

    def flush(info: list[str]) -> None:
        nonlocal head
        if head is None:
            return
        toks, head = head, None
        if toks and not toks[0][0].isdigit():            # the State column (no state filter)
            toks = toks[1:]
        if len(toks) < 4:
            return
        local, peer = _addr(toks[2]), _addr(toks[3])
        inode = next((int(t[4:]) for t in toks[4:] if t.startswith("ino:") and t[4:].isdigit()), 0)
        if local is None or peer is None or not inode:
            return
        f: dict[str, str] = {}
        for t in info:
            k, sep, v = t.partition(":")
            if sep and k not in f:
                f[k] = v
        rtt, _, rttvar = f.get("rtt", "").partition("/")
        cur, _, total = f.get("retrans", "").partition("/")
        out.append(SockStat(local=local[0], local_port=local[1], peer=peer[0], peer_port=peer[1], inode=inode,
                            rtt_ms=_num(rtt), rttvar_ms=_num(rttvar), retrans=int(_num(cur)),
                            total_retrans=int(_num(total)), dsack_dups=int(_num(f.get("dsack_dups", "0"))),
                            unacked=int(_num(f.get("unacked", "0"))),
                            backoff=int(_num(f.get("backoff", "0"))), lost=int(_num(f.get("lost", "0"))),
                            bytes_acked=int(_num(f.get("bytes_acked", "0"))),
                            bytes_received=int(_num(f.get("bytes_received", "0")))))

    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            if head is not None:
                flush(line.split())
        else:
            flush([])
            head = line.split()
    flush([])
    return out


def _local_only(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return True


def per_peer(socks: Iterable[SockStat], prev: dict[int, tuple[int, int, int]]) -> list[p.LinkStat]:
    """The sockets summed per (local, peer) address since the previous sample (pure): `prev` holds
    each socket's (retransmissions counted, retransmissions then, bytes acked), by inode, and is
    updated. Retransmissions the peer reported as duplicates (DSACK) are not counted: a healthy
    connection on a loaded host retransmits spuriously (measured: a healthy gloo pair of a
    4-machine job on this 2-core host had retransmitted 83 segments, every one reported as a
    duplicate), a lost packet's retransmission is never a duplicate. A duplicate is reported one
    round trip after its retransmission, so a sample taken in between sees a spurious
    retransmission not yet reported: a retransmission counts only once it is still unreported a
    sample later (a lost packet's is named one sample later; counted at once, three spurious ones
    name a healthy pair, the loss test needing no streak). A socket to a loopback address
    or to its own address is left out (not a link between machines); a socket seen for the first
    time counts its figures from now."""
    groups: dict[tuple[str, str], list[SockStat]] = {}
    for s in socks:
        if s.peer == s.local or _local_only(s.peer):
            continue
        groups.setdefault((s.local, s.peer), []).append(s)
    out: list[p.LinkStat] = []
    seen: set[int] = set()
    for (local, peer), ss in sorted(groups.items()):
        retrans = acked = 0
        rtts: list[float] = []
        for s in ss:
            seen.add(s.inode)
            lost = s.total_retrans - s.dsack_dups
            counted, last, a0 = prev.get(s.inode, (lost, lost, s.bytes_acked))
            unreported = min(lost, last)        # retransmitted by the last sample, still no duplicate
            d_acked = max(0, s.bytes_acked - a0)
            retrans += max(0, unreported - counted)
            acked += d_acked
            if d_acked > 0 and s.rtt_ms > 0:
                rtts.append(s.rtt_ms)
            prev[s.inode] = (max(counted, unreported), lost, s.bytes_acked)
        out.append(p.LinkStat(local=local, peer=peer, socks=len(ss), rtt_ms=max(rtts) if rtts else None,
                              retrans=retrans, unacked=sum(s.unacked for s in ss),
                              backoff=max(s.backoff for s in ss), acked=acked))
    for gone in [i for i in prev if i not in seen]:
        del prev[gone]
    return out


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open (empty when it is gone or unreadable)."""
    out: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _netns(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


class TcpSampler:
    """Samples the TCP connections of a machine's workers (module docstring); `sample(pids)` gives
    this period's `LinkStat`s. Off (an empty list every time) once `ss` is missing or a namespace
    could not be entered; the reason is logged once and kept in `off`."""

    def __init__(self) -> None:
        self.off: str | None = None if shutil.which("ss") else "ss not found (iproute2)"
        self._prev: dict[int, tuple[int, int, int]] = {}
        self._own_ns = _netns("self")
        if self.off:
            log.info("per-peer TCP figures off: %s", self.off)

    def _switch_off(self, why: str) -> None:
        self.off = why
        log.warning("per-peer TCP figures off: %s", why)

    def _ss(self, ns_pid: int | None) -> str | None:
        argv = ["ss", "-tinHe", "state", "established"]
        if ns_pid is not None:
            argv = ["nsenter", f"--net=/proc/{ns_pid}/ns/net"] + argv
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=SS_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            if isinstance(e, subprocess.TimeoutExpired):
                return None                               # a stalled host: next period
            self._switch_off(f"{argv[0]} could not run: {e}")
            return None
        if res.returncode != 0:
            if ns_pid is not None and _netns(ns_pid) is None:
                return None                               # the worker exited meanwhile
            self._switch_off(f"{' '.join(argv[:2])} failed: {(res.stderr or '').strip()[:200]}")
            return None
        return res.stdout

    def sample(self, pids: Iterable[int]) -> list[p.LinkStat]:
        """The workers' (`pids`: every process of their trees) connections to other machines."""
        if self.off:
            return []
        by_ns: dict[int | None, tuple[int, set[int]]] = {}
        for pid in pids:
            ns = _netns(pid)
            if ns is None:
                continue
            inodes = socket_inodes(pid)
            if not inodes:
                continue
            by_ns.setdefault(ns, (pid, set()))[1].update(inodes)
        socks: list[SockStat] = []
        for ns, (pid, inodes) in by_ns.items():
            text = self._ss(None if ns == self._own_ns else pid)
            if text is None:
                if self.off:
                    return []
                continue
            socks += [s for s in parse_ss(text) if s.inode in inodes]
        return per_peer(socks, self._prev)
