"""Which probes an agent runs, and on what: GPUs, kernel log, NICs, disk, host.

An agent alone on its host (a real machine: `stalwart agent` started by hand, by Slurm or in a
Kubernetes pod) watches the host's own sources:

- the kernel log: /dev/kmsg when it can read it (root, or CAP_SYSLOG), else a warning and the
  host probe counts OOM kills from /proc/vmstat instead; `--kmsg FILE` follows a file instead,
  `--kmsg off` nothing;
- the NICs: the interfaces `--nic` names (network interfaces, RDMA devices or "<device>/<port>"),
  else the interface of the default route and every RDMA port under /sys/class/infiniband (the
  training fabric of a GPU machine is its RDMA ports, seldom its default route);
- the host: memory pressure, load, OOM kills (`probes/host.py`).

Several agents on one host (`--shared-host`: the local backend's machines, or Slurm nodes
simulated on one host) share one kernel and one memory: an Xid in /dev/kmsg, a low-memory host or
the host's default NIC would be blamed on every machine at once, and a test writing to /dev/kmsg
would reach every cluster on the host. Such a machine follows only what is its own: the kernel-log
file its chaos writes Xid lines to, and the host end of its network namespace's veth when it has one.

Every agent also follows its chaos file (`<workdir>/kmsg.log`), so `stalwart inject gpu-xid` works
on real machines too without writing into the host's kernel log.
"""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field

from stalwart.agent.probes import rdma
from stalwart.agent.probes.base import Probe
from stalwart.agent.probes.disk import DiskProbe
from stalwart.agent.probes.gpu import GpuProbe, make_gpu_source
from stalwart.agent.probes.host import HostProbe
from stalwart.agent.probes.kmsg import KmsgProbe
from stalwart.agent.probes.nic import NicProbe
from stalwart.errors import StalwartError

log = logging.getLogger("stalwart.agent")

DEV_KMSG = "/dev/kmsg"
NIC_INTERVAL_S = 1.0          # a sysfs read per interface: cheap enough to see a link go down in a second
RTF_UP = 0x1


class ProbeSetupError(StalwartError, ValueError):
    """A probe option that cannot work on this host (an unknown --nic): one line for the user."""


def default_route_interfaces(proc_root: str = "/proc") -> list[str]:
    """The interfaces of the default routes (IPv4, else IPv6), from <proc>/net/route."""
    found: list[str] = []
    try:
        with open(os.path.join(proc_root, "net", "route")) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if len(cols) >= 8 and cols[1] == "00000000" and cols[7] == "00000000" \
                        and int(cols[3], 16) & RTF_UP and cols[0] not in found:
                    found.append(cols[0])
    except (OSError, ValueError):
        pass
    if found:
        return found
    try:
        with open(os.path.join(proc_root, "net", "ipv6_route")) as f:
            for line in f:
                cols = line.split()
                if len(cols) >= 10 and cols[0] == "0" * 32 and cols[1] == "00" and cols[9] != "lo" \
                        and cols[9] not in found:
                    found.append(cols[9])
    except OSError:
        pass
    return found


@dataclass
class NicChoice:
    """What the NIC probes watch, and why (for the agent's log)."""
    interfaces: list[str] = field(default_factory=list)     # /sys/class/net names
    rdma_ports: list[str] = field(default_factory=list)     # "<device>/<port>"
    why: str = ""


def choose_nics(names: list[str] | None, net_root: str = "/sys/class/net",
                ib_root: str = "/sys/class/infiniband", proc_root: str = "/proc") -> NicChoice:
    """The interfaces and RDMA ports to watch: those `names` lists (a network interface, an RDMA
    device, or "<device>/<port>"; an RDMA device that backs a listed interface is watched too),
    else the default route's interfaces and every RDMA port. Raises ProbeSetupError for a name
    that is neither."""
    ports = rdma.ports(ib_root)
    if not names:
        ifaces = default_route_interfaces(proc_root)
        why = f"default route via {', '.join(ifaces)}" if ifaces else "no default route"
        return NicChoice(ifaces, ports, why + (f"; RDMA ports {', '.join(ports)}" if ports else ""))
    choice = NicChoice(why="--nic")
    devices = {port.partition("/")[0] for port in ports}
    for name in names:
        if name in ports:
            choice.rdma_ports.append(name)
        elif name in devices:
            choice.rdma_ports += [p for p in ports if p.startswith(name + "/")]
        elif os.path.isdir(os.path.join(net_root, name)):
            choice.interfaces.append(name)
            for dev in sorted(devices):
                if name in rdma.netdevs(dev, ib_root):
                    choice.rdma_ports += [p for p in ports if p.startswith(dev + "/")]
        else:
            have = sorted(n for n in _listdir(net_root) if n != "lo") + sorted(devices)
            raise ProbeSetupError(f"--nic {name}: no such network interface or RDMA device on this host "
                                  f"(there are: {', '.join(have) or 'none'})")
    choice.rdma_ports = list(dict.fromkeys(choice.rdma_ports))
    return choice


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def kernel_log(kmsg: str | None, shared_host: bool) -> KmsgProbe | None:
    """The host kernel log's probe: /dev/kmsg when readable (`kmsg` None), the file `kmsg` names,
    or None ("off", a shared host, or /dev/kmsg unreadable: then with a warning)."""
    if kmsg == "off" or (kmsg is None and shared_host):
        return None
    source = kmsg or DEV_KMSG
    try:
        if not os.path.exists(source):
            raise FileNotFoundError(errno.ENOENT, "no such file")
        if not os.access(source, os.R_OK):
            raise PermissionError(errno.EACCES, "not readable")
        return KmsgProbe(source, interval_s=0.5)     # /dev/kmsg: EPERM without CAP_SYSLOG
    except OSError as e:
        if kmsg is not None:
            raise ProbeSetupError(f"--kmsg {kmsg}: cannot read it ({e.strerror})") from None
        log.warning("cannot read %s (%s): the kernel-log probe follows only this machine's chaos file, "
                    "and OOM kills are counted from /proc/vmstat (run the agent as root, or with "
                    "CAP_SYSLOG, to see Xid, disk and panic lines)", source, e.strerror)
        return None


def machine_probes(workdir: str, simgpu_path: str, gpus: int, chaos_kmsg: str, disk_override: str,
                   min_free_bytes: int, nic: list[str] | None = None, kmsg: str | None = None,
                   shared_host: bool = False, netns_ifname: str | None = None) -> list[Probe]:
    """The probes of one machine (see the module docstring). Raises ProbeSetupError for an option
    that cannot work here."""
    open(chaos_kmsg, "a").close()
    probes: list[Probe] = [GpuProbe(make_gpu_source(simgpu_path, gpus), interval_s=1.0),
                           KmsgProbe(chaos_kmsg, interval_s=0.5),
                           DiskProbe([workdir], min_free_bytes=min_free_bytes, min_free_ratio=0.5,
                                     interval_s=1.0, fake_free_bytes_file=disk_override)]
    host_log = kernel_log(kmsg, shared_host)
    if host_log is not None:
        probes.append(host_log)
    if netns_ifname is not None:
        # The host end of the machine's veth mirrors its NIC the way a switch port does.
        probes.append(NicProbe([netns_ifname], interval_s=NIC_INTERVAL_S))
    elif not shared_host or nic:
        choice = choose_nics(nic)
        if choice.interfaces:
            probes.append(NicProbe(choice.interfaces, interval_s=NIC_INTERVAL_S))
        if choice.rdma_ports:
            probes.append(rdma.RdmaProbe(choice.rdma_ports, interval_s=NIC_INTERVAL_S))
        if choice.interfaces or choice.rdma_ports:
            log.info("NIC probe watches %s (%s)", ", ".join(choice.interfaces + choice.rdma_ports), choice.why)
        else:
            log.warning("no NIC to watch (%s): pass --nic IFACE", choice.why)
    if not shared_host:
        probes.append(HostProbe(oom_kills=host_log is None or host_log.source != DEV_KMSG))
    return probes
