"""Namespace machines on a bridge, and the network chaos that acts on them (real kernel objects)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from stalwart.devices import netns
from stalwart.devices.netns import IFNAMSIZ, Network, available, cleanup_stale
from stalwart.chaos import net as chaos_net

REPO_SRC = str(Path(__file__).resolve().parents[2] / "src")


def unique_prefix() -> str:
    return "t" + uuid.uuid4().hex[:7]


def ip_state() -> tuple[str, str]:
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, timeout=10).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return links, spaces


def assert_nothing_left(prefix: str) -> None:
    links, spaces = ip_state()
    assert prefix not in links, links
    assert prefix not in spaces, spaces
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=10).stdout
    assert f" {prefix}\n" not in tables + "\n", tables
    etc = Path("/etc/netns")
    assert not (etc.is_dir() and any(d.name.startswith(prefix) for d in etc.iterdir()))


def reachable(src, address: str) -> bool:
    return src.run(["ping", "-c", "1", "-W", "1", address], timeout=10).returncode == 0


def wait_until(cond, within: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def need_root_net(*tools: str) -> None:
    ok, why = available()
    if not ok:
        pytest.skip(why)
    for tool in tools:
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            pytest.skip(f"{tool} not installed (apt-get install -y nftables iputils-ping)")


@pytest.fixture
def network(tmp_path: Path):
    need_root_net("ping")
    prefix = unique_prefix()
    net = Network(prefix, state_dir=tmp_path)
    try:
        net.create()
        net.add_machine(0)
        net.add_machine(1)
        yield net
    finally:
        net.destroy()
        cleanup_stale(prefix, state_dir=tmp_path)


# ----- pure -------------------------------------------------------------------------------
def test_names_fit_ifnamsiz_and_bad_input_is_rejected():
    for i in (0, 9, 244):
        names = netns.names_for("abcdefghij", i)
        assert all(len(names[k]) <= IFNAMSIZ for k in ("ifname", "host_ifname"))
        assert len(netns.bridge_name("abcdefghij")) <= IFNAMSIZ
    assert netns.names_for("x", 3) == {"ns": "x-m3", "ifname": "xi3", "host_ifname": "xh3"}
    for bad in ("", "Abc", "1ab", "abcdefghijk", "a-b", "a/b"):
        with pytest.raises(ValueError):
            netns.validate_prefix(bad)
    for bad in (-1, 245, "1"):
        with pytest.raises(ValueError):
            netns.names_for("x", bad)
    with pytest.raises(ValueError):
        Network("x", subnet_index=0)
    assert netns.machine_address(7, 2) == "10.213.7.12" and netns.gateway_address(7) == "10.213.7.1"


def test_subnet_choice_skips_used_ones():
    addr_json = [
        {"ifname": "eth0", "addr_info": [{"local": "10.0.0.5"}]},
        {"ifname": "abr", "addr_info": [{"local": "10.213.1.1"}]},
        {"ifname": "bbr", "addr_info": [{"local": "10.213.2.1"}, {"local": "10.213.4.1"}]},
    ]
    used = netns.used_subnets(addr_json)
    assert used == {1, 2, 4}
    assert netns.pick_free_subnet(used) == 3
    with pytest.raises(ValueError):
        netns.pick_free_subnet(set(range(1, 255)))


def test_rate_parsing_and_nft_listing():
    assert chaos_net.parse_rate("1mbit") == 1_000_000
    assert chaos_net.parse_rate("500kbit") == 500_000
    assert chaos_net.parse_rate("2mbps") == 16_000_000
    for bad in ("fast", "0mbit", "-1mbit", "1 mbit/s"):
        with pytest.raises(ValueError):
            chaos_net.parse_rate(bad)
    args = chaos_net.tbf_args("1mbit")
    assert args[:3] == ["tbf", "rate", "1000000bit"] and int(args[4]) >= 16 * 1024
    listing = "set parted {\n elements = { 10.213.1.10 . 10.213.1.11, 10.213.1.11 . 10.213.1.10 }\n}"
    assert chaos_net.parse_pairs(listing) == {("10.213.1.10", "10.213.1.11"), ("10.213.1.11", "10.213.1.10")}


# ----- real namespaces (root) ---------------------------------------------------------------
@pytest.mark.root
@pytest.mark.timeout(30)
def test_machines_reach_each_other_and_the_gateway(network: Network):
    a, b = network.machines[0], network.machines[1]
    assert reachable(a, b.address) and reachable(b, a.address)
    assert reachable(a, network.gateway)
    state = json.loads(network.state_file().read_text())
    assert state["bridge"] == network.bridge and set(state["machines"]) == {"0", "1"}
    assert a.env({})["GLOO_SOCKET_IFNAME"] == a.ifname
    inside = a.run(["ip", "-br", "addr"]).stdout
    assert a.ifname in inside and a.address in inside
    import socket  # a root-namespace service (the controller) is reachable over TCP at the gateway

    with socket.create_server((network.gateway, 0)) as srv:
        srv.settimeout(10)
        port = srv.getsockname()[1]
        client = a.popen([sys.executable, "-c",
                          f"import socket; socket.create_connection(('{network.gateway}', {port}), 5).sendall(b'hi')"])
        try:
            conn, peer = srv.accept()
            with conn:
                assert conn.recv(2) == b"hi" and peer[0] == a.address
            assert client.wait(timeout=10) == 0
        finally:
            if client.poll() is None:
                client.kill()
                client.wait(timeout=10)
    t0 = time.monotonic()  # no DNS in a machine: reverse lookups (c10d does them) must fail at once
    a.run(["getent", "hosts", b.address], timeout=10)
    assert time.monotonic() - t0 < 2.0


def _mac(link: str) -> str:
    return json.loads(subprocess.run(["ip", "-j", "link", "show", link], capture_output=True, text=True,
                                     check=True).stdout)[0]["address"]


@pytest.mark.root
def test_the_gateways_mac_stays_when_machines_come_and_go(network: Network):
    """A bridge takes its lowest port's MAC unless it has its own: removing or adding a machine
    would change the gateway's MAC under every other namespace's ARP cache (their connections to
    the controller stalled until the entry expired)."""
    mac = _mac(network.bridge)
    assert mac == netns.bridge_mac(network.prefix)
    network.add_machine(2)
    network.remove_machine(0)
    network.add_machine(3)
    assert _mac(network.bridge) == mac
    assert reachable(network.machines[1], network.gateway)


GLOO_RANK = textwrap.dedent(
    """
    import sys, datetime, torch, torch.distributed as dist
    rank, master = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29511", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    print("SUM", t.tolist(), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.root
@pytest.mark.timeout(60)
def test_gloo_all_reduce_across_namespaces(network: Network):
    a, b = network.machines[0], network.machines[1]
    procs = []
    try:
        for rank, m in enumerate((a, b)):
            env = m.env({**os.environ, "PYTHONPATH": REPO_SRC})
            procs.append(m.popen([sys.executable, "-c", GLOO_RANK, str(rank), a.address], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=45)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out
            assert "SUM [3.0, 3.0, 3.0, 3.0]" in out, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.mark.root
@pytest.mark.timeout(30)
def test_nic_down_cuts_the_machine_and_nic_up_restores(network: Network):
    a, b = network.machines[0], network.machines[1]
    chaos_net.nic_down(b)
    chaos_net.nic_down(b)  # idempotent
    assert not reachable(a, b.address)
    assert not reachable(b, network.gateway)
    chaos_net.nic_up(b)
    assert wait_until(lambda: reachable(a, b.address), 5)
    assert reachable(b, network.gateway), "default route not restored after nic_up"
    t0 = time.monotonic()
    chaos_net.nic_flap(b, times=2, down_s=0.2)
    assert 0.5 <= time.monotonic() - t0 < 5
    assert wait_until(lambda: reachable(a, b.address), 5)


SINK = textwrap.dedent(
    """
    import socket
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 29512)); s.listen(4)
    while True:
        c, _ = s.accept(); n = 0
        while True:
            d = c.recv(1 << 16)
            if not d: break
            n += len(d)
        c.sendall(str(n).encode()); c.close()
    """
)
SEND = textwrap.dedent(
    """
    import socket, sys, time
    host, n = sys.argv[1], int(sys.argv[2])
    deadline = time.monotonic() + 10
    while True:
        try:
            c = socket.create_connection((host, 29512), timeout=20); break
        except OSError:
            if time.monotonic() > deadline: raise
            time.sleep(0.05)
    t0 = time.monotonic(); c.sendall(b"x" * n); c.shutdown(socket.SHUT_WR)
    got = int(c.recv(64)); dt = time.monotonic() - t0
    assert got == n, got
    print(dt)
    """
)


@pytest.mark.root
@pytest.mark.timeout(30)
def test_tbf_slows_a_transfer(network: Network):
    a, b = network.machines[0], network.machines[1]
    size = 2_000_000  # 2 MB: ~1.6 s at 10 mbit
    sink = b.popen([sys.executable, "-c", SINK], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def transfer() -> float:
        out = a.run([sys.executable, "-c", SEND, b.address, str(size)], timeout=25)
        assert out.returncode == 0, out.stderr
        return float(out.stdout.strip())

    try:
        fast = transfer()
        chaos_net.link_slow(a, rate="10mbit")
        chaos_net.link_slow(a, rate="10mbit")  # idempotent
        slow = transfer()
        chaos_net.link_restore(a)
        chaos_net.link_restore(a)  # idempotent
        again = transfer()
    finally:
        chaos_net.link_restore(a)
        sink.kill()
        sink.wait(timeout=10)
    print(f"2 MB over veth: {fast:.4f} s, at 10mbit {slow:.3f} s, restored {again:.4f} s")
    assert slow >= 3 * fast
    assert slow >= 0.8 * size * 8 / 10e6  # the shaper really holds the rate
    assert again * 3 <= slow


@pytest.mark.root
@pytest.mark.timeout(30)
def test_partition_drops_and_heal_restores(network: Network):
    need_root_net("nft")
    a, b = network.machines[0], network.machines[1]
    c = network.add_machine(2)
    chaos_net.partition(a, b)
    chaos_net.partition(a, b)  # idempotent
    assert chaos_net.partitioned_pairs(network.prefix) == {(a.address, b.address), (b.address, a.address)}
    assert not reachable(a, b.address) and not reachable(b, a.address)
    assert reachable(a, c.address) and reachable(b, c.address), "partition cut more than the pair"
    assert reachable(a, network.gateway)
    chaos_net.heal(a, b)
    chaos_net.heal(a, b)  # idempotent
    assert reachable(a, b.address)
    assert chaos_net.partitioned_pairs(network.prefix) == set()
    with pytest.raises(ValueError):
        chaos_net.partition(a, a)


@pytest.mark.root
@pytest.mark.timeout(30)
def test_destroy_leaves_nothing(tmp_path: Path):
    need_root_net("nft")
    prefix = unique_prefix()
    net = Network(prefix, state_dir=tmp_path)
    try:
        net.create()
        a, b = net.add_machine(0), net.add_machine(1)
        chaos_net.partition(a, b)
        sleeper = a.popen(["sleep", "30"])
        links, spaces = ip_state()
        assert f"{prefix}h0" in links and f"{prefix}-m1" in spaces
        net.destroy()
        assert sleeper.wait(timeout=5) is not None, "process inside the machine survived destroy"
        assert_nothing_left(prefix)
        assert not net.state_file().exists()
        net.destroy()  # idempotent
    finally:
        net.destroy()


@pytest.mark.root
@pytest.mark.timeout(30)
def test_cleanup_stale_after_a_forgotten_network(tmp_path: Path):
    need_root_net("nft")
    prefix = unique_prefix()
    net = Network(prefix, state_dir=tmp_path)
    try:
        net.create()
        a, b = net.add_machine(0), net.add_machine(1)
        chaos_net.partition(a, b)
        del net, a, b  # the object is gone; the kernel objects are not
        removed = cleanup_stale(prefix, state_dir=tmp_path)
        assert {f"netns {prefix}-m0", f"netns {prefix}-m1", f"bridge {prefix}br",
                f"nft table bridge {prefix}"} <= set(removed), removed
        assert_nothing_left(prefix)
        assert not (tmp_path / f"{prefix}.json").exists()
    finally:
        cleanup_stale(prefix, state_dir=tmp_path)


CRASHER = textwrap.dedent(
    """
    import os, sys
    from stalwart.devices.netns import Network
    net = Network(sys.argv[1], state_dir=sys.argv[2])
    net.create(); net.add_machine(0); net.add_machine(1)
    os.kill(os.getpid(), 9)
    """
)


@pytest.mark.root
@pytest.mark.timeout(30)
def test_cleanup_stale_state_dir_after_owner_crash_spares_live_networks(tmp_path: Path):
    need_root_net()
    dead, live = unique_prefix(), unique_prefix()
    survivor = Network(live, state_dir=tmp_path)
    try:
        survivor.create()
        survivor.add_machine(0)
        proc = subprocess.run([sys.executable, "-c", CRASHER, dead, str(tmp_path)], timeout=20,
                              env={**os.environ, "PYTHONPATH": REPO_SRC}, capture_output=True, text=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        links, spaces = ip_state()
        assert f"{dead}br" in links and f"{dead}-m1" in spaces
        removed = cleanup_stale(tmp_path)
        assert f"bridge {dead}br" in removed and f"netns {dead}-m0" in removed, removed
        assert_nothing_left(dead)
        assert not (tmp_path / f"{dead}.json").exists()
        links, spaces = ip_state()
        assert f"{live}br" in links and f"{live}-m0" in spaces, "a live network was cleaned up"
        assert survivor.state_file().exists()
    finally:
        survivor.destroy()
        cleanup_stale(dead, state_dir=tmp_path)
    assert_nothing_left(live)


def test_without_root_everything_says_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert available() == (False, "needs root (uid 1000)")
    fake = netns.Machine(name="m0", index=0, ns="x-m0", ifname="xi0", host_ifname="xh0",
                         address="10.213.9.10", gateway="10.213.9.1", prefix="x")
    other = netns.Machine(name="m1", index=1, ns="x-m1", ifname="xi1", host_ifname="xh1",
                          address="10.213.9.11", gateway="10.213.9.1", prefix="x")
    for call in (lambda: chaos_net.nic_down(fake), lambda: chaos_net.nic_up(fake),
                 lambda: chaos_net.link_slow(fake), lambda: chaos_net.link_restore(fake),
                 lambda: chaos_net.partition(fake, other), lambda: chaos_net.heal(fake, other)):
        with pytest.raises(chaos_net.ChaosUnavailable, match="needs root"):
            call()
    with pytest.raises(netns.NetnsError, match="needs root"):
        Network("x").create()


@pytest.mark.root
@pytest.mark.timeout(30)
def test_networks_created_at_once_get_distinct_subnets(tmp_path: Path):
    need_root_net()
    import threading

    nets = [Network(unique_prefix(), state_dir=tmp_path / str(k)) for k in range(3)]
    errors: list[BaseException] = []

    def build(net: Network) -> None:
        try:
            net.create()
            net.add_machine(0)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(n,)) for n in nets]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not errors, errors
        assert len({n.subnet_index for n in nets}) == 3
        dup = Network(nets[0].prefix, state_dir=tmp_path / "dup")
        with pytest.raises(ValueError, match="already exists"):
            dup.create()
        dup.destroy()  # owns nothing: must not remove the live network it collided with
        assert reachable(nets[0].machines[0], nets[0].gateway)
        with pytest.raises(ValueError, match="create"):
            Network(unique_prefix(), state_dir=tmp_path).add_machine(0)
    finally:
        for n in nets:
            n.destroy()
    for n in nets:
        assert_nothing_left(n.prefix)
