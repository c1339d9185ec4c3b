"""The probes of an agent on a real host: which NICs and RDMA ports it watches,
drop counters, RDMA port state and counters, the kernel log it follows (with its fallback), OOM kills
from /proc/vmstat. sysfs and procfs are laid out in temp dirs; the real ones are read where present."""
import logging
import os

import pytest

from stalwart.agent import probeset
from stalwart.agent.probes.host import HostProbe, read_vmstat
from stalwart.agent.probes.kmsg import KmsgProbe
from stalwart.agent.probes.nic import NicProbe
from stalwart.agent.probes.rdma import RdmaProbe, netdevs, ports
from test_probes import make_nic, write_proc

ROUTE_HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"


def write_routes(proc, lines, v6=()):
    (proc / "net").mkdir(parents=True, exist_ok=True)
    (proc / "net" / "route").write_text(ROUTE_HEADER + "".join(lines))
    (proc / "net" / "ipv6_route").write_text("".join(v6))


def route(iface, dest="00000000", flags="0003", mask="00000000"):
    return f"{iface}\t{dest}\t0102000A\t{flags}\t0\t0\t0\t{mask}\t0\t0\t0\n"


def test_default_route_interface_from_proc(tmp_path):
    write_routes(tmp_path, [route("eth1", "0002000A", "0001", "00FFFFFF"), route("eth0")])
    assert probeset.default_route_interfaces(str(tmp_path)) == ["eth0"]
    write_routes(tmp_path, [route("eth0", flags="0002")])          # a default route that is not up
    assert probeset.default_route_interfaces(str(tmp_path)) == []
    v6 = "00000000000000000000000000000000 00 00000000000000000000000000000000 00 " \
         "fe800000000000000000000000000001 00000400 00000001 00000000 00000003 ens5\n"
    write_routes(tmp_path, [], [v6])
    assert probeset.default_route_interfaces(str(tmp_path)) == ["ens5"]
    assert probeset.default_route_interfaces(str(tmp_path / "none")) == []


def test_default_route_of_this_host():
    if not os.path.exists("/proc/net/route"):
        pytest.skip("no /proc/net/route")
    for iface in probeset.default_route_interfaces():
        assert os.path.isdir(f"/sys/class/net/{iface}")


def make_port(root, dev, port, state="4: ACTIVE", phys="5: LinkUp", counters=None, netdev=None):
    d = root / dev / "ports" / str(port)
    (d / "counters").mkdir(parents=True, exist_ok=True)
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text(phys + "\n")
    for k, v in (counters or {"symbol_error": 0, "link_downed": 0, "port_xmit_discards": 0}).items():
        (d / "counters" / k).write_text(f"{v}\n")
    if netdev:
        (root / dev / "device" / "net" / netdev).mkdir(parents=True, exist_ok=True)


def test_rdma_ports_and_their_netdevs(tmp_path):
    make_port(tmp_path, "mlx5_1", 1)
    make_port(tmp_path, "mlx5_0", 2)
    make_port(tmp_path, "mlx5_0", 1, netdev="ens1f0")
    assert ports(str(tmp_path)) == ["mlx5_0/1", "mlx5_0/2", "mlx5_1/1"]
    assert netdevs("mlx5_0", str(tmp_path)) == ["ens1f0"] and netdevs("mlx5_1", str(tmp_path)) == []
    assert ports(str(tmp_path / "absent")) == []


def test_rdma_probe_state_flap_errors_drops(tmp_path):
    make_port(tmp_path, "mlx5_0", 1)
    p = RdmaProbe(["mlx5_0/1", "mlx5_9/1"], root=str(tmp_path), drop_threshold=100)
    assert [(e.kind, e.detail["interface"]) for e in p.check(0.0)] == [("nic_missing", "mlx5_9/1")]
    p.ports = ["mlx5_0/1"]
    make_port(tmp_path, "mlx5_0", 1, state="1: DOWN", phys="3: Disabled",
              counters={"symbol_error": 3, "link_downed": 1, "port_xmit_discards": 50})
    evs = {e.kind: e for e in p.check(1.0)}
    assert set(evs) == {"nic_down", "nic_flap", "nic_errors"}            # 50 discards: under the threshold
    down = evs["nic_down"].detail
    assert {k: down[k] for k in ("interface", "rdma", "operstate", "phys_state", "standing")} == \
        {"interface": "mlx5_0/1", "rdma": True, "operstate": "DOWN", "phys_state": "Disabled", "standing": True}
    # the down state and the link_downed step are one occurrence
    assert evs["nic_flap"].detail["occurrences"] == down["occurrences"] and len(down["occurrences"]) == 1
    assert evs["nic_errors"].detail["delta"] == {"symbol_error": 3}
    assert all(e.probe == "nic" and e.severity == "warn" and not e.machine_certain for e in evs.values())
    [again] = p.check(1.5)                      # still down, nothing counted since: the same occurrence
    assert again.kind == "nic_down" and again.detail["occurrences"] == down["occurrences"]
    make_port(tmp_path, "mlx5_0", 1, counters={"symbol_error": 3, "link_downed": 1, "port_xmit_discards": 400})
    assert [(e.kind, e.detail["delta"]) for e in p.check(2.0)] == [("nic_drops", {"port_xmit_discards": 350})]
    assert p.check(3.0) == []
    make_port(tmp_path, "mlx5_0", 1, counters={"symbol_error": 3, "link_downed": 2, "port_xmit_discards": 400})
    [flap] = p.check(4.0)                       # down and up again between two checks: a new occurrence
    assert flap.kind == "nic_flap" and not flap.detail["standing"]
    assert set(flap.detail["occurrences"]).isdisjoint(down["occurrences"])
    with pytest.raises(ValueError):
        RdmaProbe(["mlx5_0/1"], error_threshold=0)


def test_nic_probe_drops_need_a_burst(tmp_path):
    make_nic(tmp_path, "eth0", errors={"rx_errors": 0, "rx_dropped": 10, "tx_dropped": 0})
    p = NicProbe(["eth0"], root=str(tmp_path), drop_threshold=1000)
    assert p.check(0.0) == []
    make_nic(tmp_path, "eth0", errors={"rx_errors": 0, "rx_dropped": 500, "tx_dropped": 0})
    assert p.check(1.0) == []                       # a host drops packets now and then
    make_nic(tmp_path, "eth0", errors={"rx_errors": 0, "rx_dropped": 1200, "tx_dropped": 400})
    [e] = p.check(2.0)
    assert e.kind == "nic_drops" and e.detail["delta"] == {"rx_dropped": 700, "tx_dropped": 400}
    make_nic(tmp_path, "eth0", errors={"rx_errors": 0, "rx_dropped": 2300, "tx_dropped": 400})
    [e2] = p.check(3.0)                             # a burst on consecutive checks: one occurrence
    assert e2.detail["occurrences"] == e.detail["occurrences"] and e.detail["interface"] == "eth0"
    with pytest.raises(ValueError):
        NicProbe(["eth0"], root=str(tmp_path), drop_threshold=0)


def test_choose_nics_by_name_device_port_or_default_route(tmp_path):
    net, ib, proc = tmp_path / "net", tmp_path / "ib", tmp_path / "proc"
    for name in ("eth0", "ens1f0", "lo"):
        make_nic(net, name)
    make_port(ib, "mlx5_0", 1, netdev="ens1f0")
    make_port(ib, "mlx5_1", 1)
    make_port(ib, "mlx5_1", 2)
    write_routes(proc, [route("eth0")])
    kw = dict(net_root=str(net), ib_root=str(ib), proc_root=str(proc))
    c = probeset.choose_nics(None, **kw)
    assert (c.interfaces, c.rdma_ports) == (["eth0"], ["mlx5_0/1", "mlx5_1/1", "mlx5_1/2"])
    assert "default route via eth0" in c.why
    c = probeset.choose_nics(["ens1f0"], **kw)             # RoCE: the device behind the interface too
    assert (c.interfaces, c.rdma_ports) == (["ens1f0"], ["mlx5_0/1"])
    c = probeset.choose_nics(["mlx5_1", "mlx5_1/2"], **kw)
    assert (c.interfaces, c.rdma_ports) == ([], ["mlx5_1/1", "mlx5_1/2"])
    with pytest.raises(probeset.ProbeSetupError, match=r"--nic eth9: no such .*there are: ens1f0, eth0, mlx5_0"):
        probeset.choose_nics(["eth9"], **kw)
    write_routes(proc, [])
    assert probeset.choose_nics(None, **kw).why.startswith("no default route")


def test_host_probe_counts_oom_kills_from_vmstat(tmp_path):
    write_proc(tmp_path, 20_000_000, 0.5)
    (tmp_path / "vmstat").write_text("nr_free_pages 100\noom_kill 4\npgfault 9\n")
    p = HostProbe(str(tmp_path), cpus=2, oom_kills=True)
    assert p.check(0.0) == []
    (tmp_path / "vmstat").write_text("nr_free_pages 100\noom_kill 6\npgfault 9\n")
    [e] = p.check(5.0)
    assert (e.kind, e.severity, e.detail) == ("cpu_oom", "warn", {"kills": 2, "source": "/proc/vmstat"})
    assert p.check(10.0) == []
    assert HostProbe(str(tmp_path), cpus=2).check(0.0) == [] and read_vmstat(str(tmp_path / "vmstat"), "x") is None
    if os.path.exists("/proc/vmstat"):
        assert read_vmstat("/proc/vmstat", "oom_kill") is not None


def _kinds(probes):
    return [(type(p).__name__, getattr(p, "source", None) or getattr(p, "_fixed", None) or getattr(p, "ports", None))
            for p in probes]


def probes_for(tmp_path, **kw):
    wd = tmp_path / "m"
    wd.mkdir(exist_ok=True)
    return probeset.machine_probes(str(wd), str(wd / "simgpu.json"), 1, str(wd / "kmsg.log"),
                                   str(wd / "disk_free_override"), 1 << 20, **kw)


def test_shared_host_follows_only_its_own_sources(tmp_path):
    got = _kinds(probes_for(tmp_path, shared_host=True, netns_ifname="sw1h0"))
    assert got[1] == ("KmsgProbe", str(tmp_path / "m" / "kmsg.log"))          # the chaos file
    assert [k for k, _ in got] == ["GpuProbe", "KmsgProbe", "DiskProbe", "NicProbe"]
    assert got[3] == ("NicProbe", ["sw1h0"])
    # without a namespace: no NIC (the host's default route is not this machine's), no host probe
    assert [k for k, _ in _kinds(probes_for(tmp_path, shared_host=True))] == ["GpuProbe", "KmsgProbe", "DiskProbe"]


def test_real_host_follows_dev_kmsg_or_warns_and_counts_ooms(tmp_path, monkeypatch, caplog):
    log = tmp_path / "host-kmsg.log"
    log.write_text("")
    probes = probes_for(tmp_path, kmsg=str(log), nic=["lo"])
    names = [type(p).__name__ for p in probes]
    assert names == ["GpuProbe", "KmsgProbe", "DiskProbe", "KmsgProbe", "NicProbe", "HostProbe"]
    assert probes[3].source == str(log) and probes[5].oom_kills          # not /dev/kmsg: OOMs from vmstat
    monkeypatch.setattr(probeset, "DEV_KMSG", str(tmp_path / "no-such-kmsg"))
    with caplog.at_level(logging.WARNING, logger="stalwart.agent"):
        probes = probes_for(tmp_path, nic=["lo"])
    assert [type(p).__name__ for p in probes] == ["GpuProbe", "KmsgProbe", "DiskProbe", "NicProbe", "HostProbe"]
    assert probes[-1].oom_kills and "cannot read" in caplog.text and "no-such-kmsg" in caplog.text
    assert "KmsgProbe" not in [type(p).__name__ for p in probes_for(tmp_path, kmsg="off", nic=["lo"])[3:]]
    with pytest.raises(probeset.ProbeSetupError, match="--kmsg"):
        probes_for(tmp_path, kmsg=str(tmp_path / "absent" / "file"))
    with pytest.raises(probeset.ProbeSetupError, match="--nic"):
        probes_for(tmp_path, nic=["no-such-nic0"])


def test_dev_kmsg_is_followed_when_readable(tmp_path):
    try:
        KmsgProbe("/dev/kmsg").close()
    except OSError as e:
        pytest.skip(f"/dev/kmsg is not readable here ({e.strerror})")
    probes = probes_for(tmp_path, nic=["lo"])
    [host_log] = [p for p in probes if isinstance(p, KmsgProbe) and p.source == "/dev/kmsg"]
    assert not probes[-1].oom_kills           # the kernel log reports OOM kills with the victim
    host_log.close()
