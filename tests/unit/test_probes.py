"""Agent probes and the simulated GPU, with temp files as their sources."""

import json
import os

import pytest

from stalwart.agent.probes.base import Debounce, HealthEvent, Probe
from stalwart.agent.probes.gpu import FATAL_XIDS, GpuProbe, SimGpuSource, assess, make_gpu_source
from stalwart.agent.probes.disk import DiskProbe, low_space
from stalwart.agent.probes.host import HostProbe, read_meminfo
from stalwart.agent.probes.kmsg import KmsgProbe, parse_line
from stalwart.agent.probes.nic import NicProbe
from stalwart.devices.simgpu import SimGpu, fatal_line, slowdown_factor


# -- base ---------------------------------------------------------------------------------


def test_health_event_roundtrip_and_validation():
    e = HealthEvent("gpu", "gpu_lost", "fatal", True, {"device": 1}, 12.5)
    assert HealthEvent.from_dict(json.loads(json.dumps(e.to_dict()))) == e
    with pytest.raises(ValueError, match="severity"):
        HealthEvent("gpu", "x", "critical", True)
    with pytest.raises(ValueError):
        HealthEvent("", "x", "warn", False)


def test_probe_due_follows_interval():
    class Counting(Probe):
        name = "count"
        interval_s = 5.0

        def check(self, now):
            return [self.event("tick", "info", False, now)]

    p = Counting()
    assert p.due(0.0)
    assert p.run(0.0)[0].t == 0.0
    assert not p.due(4.9) and p.due(5.0)
    with pytest.raises(NotImplementedError):
        Probe().check(0.0)


def test_debounce_tolerates_glitches():
    d = Debounce(3)
    assert [d.observe("a", True) for _ in range(2)] == [False, False]
    assert not d.observe("a", False)  # healed: count restarts
    assert [d.observe("a", True) for _ in range(3)] == [False, False, True]
    assert d.observe_all({"b"}) == set()  # "a" was good this time
    assert not d.observe("a", True)
    with pytest.raises(ValueError):
        Debounce(0)


# -- simulated GPU ------------------------------------------------------------------------


@pytest.fixture
def sim(tmp_path):
    return SimGpu(tmp_path / "gpus.json", 2)


def test_simgpu_creates_healthy_devices(sim, tmp_path):
    devs = sim.read()
    assert [d["index"] for d in devs] == [0, 1]
    assert all(d["present"] and d["xid"] == [] and not d["sdc"] for d in devs)
    assert sim.fatal(0) is None and sim.slowdown(0) == 1.0 and not sim.corrupts(0)
    # Reopening takes the file's count; a different count is an error.
    assert SimGpu(tmp_path / "gpus.json").count == 2
    with pytest.raises(ValueError, match="holds 2"):
        SimGpu(tmp_path / "gpus.json", 4)
    with pytest.raises(ValueError, match="does not exist"):
        SimGpu(tmp_path / "other.json")


def test_simgpu_fatal_lines(sim):
    prefix = "torch.AcceleratorError: CUDA error: "
    sim.set(0, xid=[79])
    assert sim.fatal(0) == prefix + "unspecified launch failure"
    assert sim.fatal(1) is None
    sim.set(1, xid=[31])
    assert sim.fatal(1) == prefix + "an illegal memory access was encountered"
    sim.set(1, xid=[], ecc_dbe=2)
    assert sim.fatal(1) == prefix + "uncorrectable ECC error encountered"
    sim.set(1, present=False)
    assert sim.fatal(1) == prefix + "no CUDA-capable device is detected"
    assert fatal_line({"present": True, "xid": [63, 92]}) is None  # these do not crash a process
    sim.reset()
    assert sim.fatal(0) is None and sim.fatal(1) is None


def test_simgpu_slowdown_and_sdc(sim):
    sim.set(0, clock_sm=990)
    assert sim.slowdown(0) == pytest.approx(2.0)
    sim.set(1, temperature=90)  # 3 °C above the 87 °C slowdown threshold
    assert sim.slowdown(1) == pytest.approx(1.8)
    assert slowdown_factor({"temperature": 40, "slowdown_temp": 87, "throttle": ["hw_slowdown"]}) == 1.5
    assert slowdown_factor({"temperature": 40, "throttle": ["gpu_idle", "sw_power_cap"]}) == 1.5
    assert slowdown_factor({"temperature": 40, "throttle": ["gpu_idle"]}) == 1.0
    assert slowdown_factor({"temperature": 500, "slowdown_temp": 87}) == 10.0
    sim.set(0, sdc=True)
    assert sim.corrupts(0)
    sim.set(0, present=False)
    assert not sim.corrupts(0)


def test_simgpu_rejects_bad_fields(sim):
    with pytest.raises(ValueError, match="unknown simulated GPU field"):
        sim.set(0, colour="red")
    with pytest.raises(ValueError, match="true/false"):
        sim.set(0, present=1)
    with pytest.raises(ValueError, match="Xid"):
        sim.set(0, xid=[-1])
    with pytest.raises(ValueError, match="throttle"):
        sim.set(0, throttle=["too_hot"])
    with pytest.raises(ValueError, match="no simulated GPU"):
        sim.set(2, present=False)
    with pytest.raises(ValueError, match="no simulated GPU"):
        sim.fatal(-1)


def test_simgpu_file_is_replaced_atomically(sim, tmp_path):
    sim.set(0, temperature=70)
    data = json.loads((tmp_path / "gpus.json").read_text())
    assert data["devices"][0]["temperature"] == 70
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".simgpu-")]
    (tmp_path / "gpus.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid"):
        sim.read()


# -- GPU probe ----------------------------------------------------------------------------


def test_make_gpu_source_falls_back_to_sim_without_driver(tmp_path):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present: NVML is used, not the simulation")
    except pynvml.NVMLError:
        pass
    src = make_gpu_source(tmp_path / "g.json", 4)
    assert src.kind == "sim" and len(src.read()) == 4


def kinds(events):
    return sorted((e.kind, e.severity, e.detail.get("device")) for e in events)


def test_gpu_probe_healthy_is_silent(sim):
    assert GpuProbe(SimGpuSource(sim)).check(0.0) == []


def test_gpu_probe_lost_is_fatal_and_certain(sim):
    probe = GpuProbe(SimGpuSource(sim))
    sim.set(1, present=False)
    (e,) = probe.check(1.0)
    assert (e.probe, e.kind, e.severity, e.machine_certain, e.detail["device"], e.t) == (
        "gpu", "gpu_lost", "fatal", True, 1, 1.0,
    )
    assert e.detail["source"] == "sim"


def test_gpu_probe_reports_each_xid_once(sim):
    probe = GpuProbe(SimGpuSource(sim))
    sim.add_xid(0, 79)
    assert kinds(probe.check(0.0)) == [("gpu_xid", "fatal", 0)]
    assert probe.check(10.0) == []  # already reported
    sim.add_xid(0, 43)
    (e,) = probe.check(20.0)
    assert (e.detail["xid"], e.severity, e.machine_certain) == (43, "info", False)
    sim.reset(0)
    sim.add_xid(0, 48)  # list shorter than before: a reset happened, 48 is new
    assert kinds(probe.check(30.0)) == [("gpu_xid", "fatal", 0)]
    assert {48, 62, 64, 74, 79, 92, 94, 95, 119, 120} <= FATAL_XIDS and 13 not in FATAL_XIDS


def test_gpu_probe_ecc_and_row_remap(sim):
    probe = GpuProbe(SimGpuSource(sim))
    sim.set(0, ecc_dbe=1)
    sim.set(1, row_remap_failure=True)
    assert kinds(probe.check(0.0)) == [("ecc_dbe", "fatal", 0), ("row_remap_failure", "fatal", 1)]


def test_gpu_probe_warnings_need_two_checks(sim):
    probe = GpuProbe(SimGpuSource(sim), warn_after=2)
    sim.set(0, temperature=91)
    assert probe.check(0.0) == []  # a single hot reading may be a glitch
    (e,) = probe.check(10.0)
    assert (e.kind, e.severity, e.machine_certain, e.detail["temperature"]) == ("gpu_hot", "warn", False, 91)
    sim.set(0, temperature=60)
    assert probe.check(20.0) == []
    sim.set(0, temperature=91)
    assert probe.check(30.0) == []  # healed in between: counting starts again


def test_assess_throttle_and_pcie():
    base = {"index": 0, "present": True, "xid": [], "temperature": 50, "slowdown_temp": 87}
    f, _ = assess([{**base, "throttle": ["hw_slowdown"], "clock_sm": 1980, "clock_sm_max": 1980}], {})
    assert [k for k, *_ in f] == ["gpu_throttle"]
    f, _ = assess([{**base, "throttle": ["sw_power_cap"], "clock_sm": 1800, "clock_sm_max": 1980}], {})
    assert f == []  # power capping under load is normal
    f, _ = assess([{**base, "clock_sm": 900, "clock_sm_max": 1980}], {})
    assert [k for k, *_ in f] == ["gpu_throttle"]
    f, _ = assess([{**base, "throttle": ["gpu_idle"], "clock_sm": 300, "clock_sm_max": 1980}], {})
    assert f == []  # idle clocks are low on purpose
    f, _ = assess([{**base, "throttle": ["hw_thermal_slowdown"]}], {})
    assert [k for k, *_ in f] == ["gpu_hot"]
    link = {"pcie_width": 8, "pcie_width_max": 16, "pcie_gen": 5, "pcie_gen_max": 5}
    f, _ = assess([{**base, **link}], {})
    assert f[0][0] == "pcie_downgrade" and f[0][2]["width"] == 8
    idle_gen = {"pcie_width": 16, "pcie_width_max": 16, "pcie_gen": 1, "pcie_gen_max": 5, "throttle": ["gpu_idle"]}
    assert assess([{**base, **idle_gen}], {})[0] == []
    busy_gen = {**idle_gen, "throttle": []}
    assert assess([{**base, **busy_gen}], {})[0][0][0] == "pcie_downgrade"
    f, _ = assess([{**base, "retired_pages_pending": True}], {})
    assert f == [("retired_pages_pending", "warn", {"device": 0})]


def test_gpu_probe_validates_arguments(sim):
    with pytest.raises(ValueError):
        GpuProbe(SimGpuSource(sim), interval_s=0)
    with pytest.raises(ValueError):
        GpuProbe(SimGpuSource(sim), min_clock_ratio=1.5)


# -- NIC probe ----------------------------------------------------------------------------


def make_nic(root, name, operstate="up", carrier="1", changes=2, errors=None):
    d = root / name
    (d / "statistics").mkdir(parents=True, exist_ok=True)
    (d / "operstate").write_text(operstate + "\n")
    if carrier is None:
        (d / "carrier").unlink(missing_ok=True)
    else:
        (d / "carrier").write_text(carrier + "\n")
    (d / "carrier_changes").write_text(f"{changes}\n")
    for k, v in (errors or {"rx_errors": 0, "tx_errors": 0}).items():
        (d / "statistics" / k).write_text(f"{v}\n")


def test_nic_probe_healthy_and_default_interfaces(tmp_path):
    make_nic(tmp_path, "eth0")
    make_nic(tmp_path, "lo", operstate="unknown")
    p = NicProbe(root=str(tmp_path))
    assert p.interfaces() == ["eth0"] and p.interval_s == 30.0
    assert p.check(0.0) == [] and p.check(30.0) == []


def test_nic_probe_down_flap_errors(tmp_path):
    make_nic(tmp_path, "eth0")
    p = NicProbe(["eth0"], root=str(tmp_path))
    assert p.check(0.0) == []
    make_nic(tmp_path, "eth0", operstate="down", carrier=None, changes=3)  # carrier unreadable when down
    evs = {e.kind: e for e in p.check(30.0)}
    assert set(evs) == {"nic_down", "nic_flap"}
    assert all(e.severity == "warn" and not e.machine_certain for e in evs.values())
    assert evs["nic_down"].detail == {"interface": "eth0", "operstate": "down", "carrier": None,
                                      "occurrences": ["eth0/link@0.000#1"], "standing": True}
    assert evs["nic_flap"].detail["carrier_changes"] == 1
    make_nic(tmp_path, "eth0", changes=4, errors={"rx_errors": 5, "tx_errors": 0})
    evs = {e.kind: e for e in p.check(60.0)}
    assert set(evs) == {"nic_flap", "nic_errors"} and evs["nic_errors"].detail["delta"] == {"rx_errors": 5}
    assert p.check(90.0) == []  # no growth since: quiet again
    make_nic(tmp_path, "eth0", operstate="up", carrier="0", changes=4, errors={"rx_errors": 5, "tx_errors": 0})
    assert [e.kind for e in p.check(120.0)] == ["nic_down"]  # up but no carrier


def occurrences(events, kind=None):
    return [tuple(e.detail["occurrences"]) for e in events if kind is None or e.kind == kind]


def test_nic_probe_names_one_occurrence_per_underlying_event(tmp_path):
    """A flap reported as a down state and then as a carrier change, a link that stays down for
    several checks, errors growing on consecutive checks: each is one occurrence (one id)."""
    make_nic(tmp_path, "eth0", changes=2)
    p = NicProbe(["eth0"], root=str(tmp_path), interval_s=1.0)
    assert p.check(0.0) == []
    # one flap seen mid-way: down now (one change), then up (one more change)
    make_nic(tmp_path, "eth0", operstate="down", carrier="0", changes=3)
    mid = p.check(1.0)
    assert {e.kind for e in mid} == {"nic_down", "nic_flap"} and len(set(occurrences(mid))) == 1
    [flap] = set(occurrences(mid))
    make_nic(tmp_path, "eth0", changes=4)
    after = p.check(2.0)
    assert [e.kind for e in after] == ["nic_flap"] and occurrences(after) == [flap]
    assert after[0].detail["standing"] is False
    # a flap entirely between two checks: two changes, one new occurrence
    make_nic(tmp_path, "eth0", changes=6)
    [between] = occurrences(p.check(3.0))
    assert len(between) == 1 and between[0] != flap[0]
    # two flaps between two checks: two occurrences
    make_nic(tmp_path, "eth0", changes=10)
    [two] = occurrences(p.check(4.0))
    assert len(two) == 2 and between[0] not in two
    # a link that goes down and stays down: the same id on every check, standing
    make_nic(tmp_path, "eth0", operstate="down", carrier="0", changes=11)
    downs = [p.check(5.0 + k) for k in range(4)]
    [(down,)] = {ids for evs in downs for ids in occurrences(evs, "nic_down")}
    assert all(e.detail["standing"] for evs in downs for e in evs if e.kind == "nic_down")
    # it comes back, goes down again and stays: the old occurrence ends, a new one stands
    make_nic(tmp_path, "eth0", operstate="down", carrier="0", changes=13)
    [(ended, standing)] = occurrences(p.check(9.0), "nic_down")
    assert ended == down and standing != down
    make_nic(tmp_path, "eth0", changes=14)
    assert occurrences(p.check(10.0)) == [(standing,)]
    # errors that grow on consecutive checks are one occurrence; a quiet check ends it
    errors = set()
    for k in range(3):
        make_nic(tmp_path, "eth0", changes=14, errors={"rx_errors": k + 1, "tx_errors": 0})
        errors |= set(occurrences(p.check(11.0 + k), "nic_errors"))
    assert len(errors) == 1
    assert p.check(14.0) == []
    make_nic(tmp_path, "eth0", changes=14, errors={"rx_errors": 9, "tx_errors": 0})
    assert occurrences(p.check(15.0), "nic_errors") != list(errors)


def test_nic_probe_missing_interface_and_threshold(tmp_path):
    assert [e.kind for e in NicProbe(["ib0"], root=str(tmp_path)).check(0.0)] == ["nic_missing"]
    make_nic(tmp_path, "eth0")
    p = NicProbe(["eth0"], root=str(tmp_path), error_threshold=10)
    p.check(0.0)
    make_nic(tmp_path, "eth0", errors={"rx_errors": 3, "tx_errors": 0})
    assert p.check(30.0) == []
    with pytest.raises(ValueError):
        NicProbe(root=str(tmp_path), error_threshold=0)


def test_nic_probe_reads_real_sysfs():
    if not os.path.isdir("/sys/class/net/lo"):
        pytest.skip("no /sys/class/net on this host")
    p = NicProbe(["lo"])
    assert [e for e in p.check(0.0) if e.kind in ("nic_missing", "nic_down")] == []


# -- kernel log probe ---------------------------------------------------------------------

XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2871, name=python, GPU has fallen off the bus."


def test_parse_line_formats_and_kinds():
    for line in (f"4,1201,881234567,-;{XID79}", f"[ 8812.441276] {XID79}", XID79):
        kind, sev, certain, detail = parse_line(line)
        assert (kind, sev, certain, detail["xid"], detail["pci"]) == ("gpu_xid", "fatal", True, 79, "0000:3b:00")
    k = parse_line("[ 1.0] NVRM: Xid (PCI:0000:18:00): 13, pid=1, Graphics SM Warp Exception")
    assert k[:3] == ("gpu_xid", "info", False)
    assert parse_line("NVRM: GPU at PCI:0000:3b:00: GPU-1234 has fallen off the bus.")[0] == "gpu_lost"
    assert parse_line("Kernel panic - not syncing: Fatal exception")[:3] == ("kernel_panic", "fatal", True)
    oom = parse_line("[ 8812.4] Out of memory: Killed process 48213 (python) total-vm:98812340kB, anon-rss:1kB")
    assert oom[:3] == ("cpu_oom", "warn", False) and oom[3]["pid"] == 48213 and oom[3]["process"] == "python"
    assert parse_line("Memory cgroup out of memory: Killed process 7 (pt_main_thread)")[0] == "cpu_oom"
    for disk in (
        "EXT4-fs error (device nvme0n1p1): ext4_find_entry:1455: inode #2: comm python: reading directory lblock 0",
        "XFS (sdb1): metadata I/O error in \"xfs_imap_to_bp+0x5c/0xa0\" at daddr 0x1a0 len 32 error 5",
        "blk_update_request: I/O error, dev sda, sector 2048 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio class 0",
        "Buffer I/O error on dev sdb1, logical block 0, lost async page write",
    ):
        assert parse_line(disk)[:3] == ("disk_fault", "fatal", True), disk
    assert parse_line("EXT4-fs error (device nvme0n1p1): x")[3]["device"] == "nvme0n1p1"
    assert parse_line("INFO: task python:4242 blocked for more than 120 seconds.")[0] == "hung_task"
    assert parse_line("watchdog: BUG: soft lockup - CPU#3 stuck for 22s! [python:99]")[0] == "soft_lockup"
    assert parse_line("NETDEV WATCHDOG: eth0 (mlx5_core): transmit queue 3 timed out")[3]["interface"] == "eth0"
    assert parse_line("[    0.000000] Linux version 6.1.0") is None
    assert parse_line("EXT4-fs (sda1): mounted filesystem with ordered data mode") is None


def test_kmsg_probe_follows_a_file(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(f"[ 1.0] {XID79}\n")  # old: before the probe started
    p = KmsgProbe(str(log))
    assert p.interval_s == 2.0 and p.check(0.0) == []
    with open(log, "a") as f:
        f.write("[ 2.0] Kernel panic - not syncing: x\n[ 3.0] NVRM: Xid (PCI:0000:3b:00): 4")
    assert [e.kind for e in p.check(2.0)] == ["kernel_panic"]  # the half-written line waits
    with open(log, "a") as f:
        f.write("8, pid=1, DBE\n")
    (e,) = p.check(4.0)
    assert (e.kind, e.detail["xid"], e.severity, e.machine_certain) == ("gpu_xid", 48, "fatal", True)
    log.write_text(f"{XID79}\n")  # truncated (rotated): read from the start
    assert [e.kind for e in p.check(6.0)] == ["gpu_xid"]
    assert [e.kind for e in KmsgProbe(str(log), from_start=True).check(0.0)] == ["gpu_xid"]


def test_kmsg_probe_file_created_later(tmp_path):
    log = tmp_path / "later.log"
    p = KmsgProbe(str(log))
    assert p.check(0.0) == []
    log.write_text(f"{XID79}\n")
    assert [e.kind for e in p.check(2.0)] == ["gpu_xid"]


# -- disk probe ---------------------------------------------------------------------------


def test_low_space_threshold_is_the_smaller_one():
    assert low_space(500 << 20, 100 << 30, 1 << 30, 0.02)  # 500 MiB free of 100 GiB
    assert not low_space(3 << 20, 100 << 20, 1 << 30, 0.02)  # small tmpfs, 3% free
    assert low_space(1 << 20, 100 << 20, 1 << 30, 0.02)


def test_disk_probe_healthy_and_fake_full(tmp_path):
    fake = tmp_path / "free_bytes"
    p = DiskProbe([str(tmp_path)], fake_free_bytes_file=str(fake))
    assert p.check(0.0) == []
    assert not (tmp_path / ".stalwart-disk-probe").exists()
    fake.write_text("0\n")
    (e,) = p.check(10.0)
    assert (e.kind, e.severity, e.machine_certain, e.detail["free_bytes"]) == ("disk_full", "fatal", False, 0)
    fake.write_text("lots")
    with pytest.raises(ValueError, match="byte count"):
        p.check(20.0)


def test_disk_probe_write_failure_is_a_fault(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    (e,) = DiskProbe([str(not_a_dir)]).check(0.0)
    assert (e.kind, e.severity, e.machine_certain) == ("disk_fault", "fatal", True)
    (e,) = DiskProbe([str(tmp_path / "gone")]).check(0.0)
    assert e.kind == "disk_fault"
    with pytest.raises(ValueError):
        DiskProbe([])


# -- host probe ---------------------------------------------------------------------------


def write_proc(root, available_kb, load, total_kb=24683656):
    (root / "meminfo").write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:        {available_kb} kB\nMemAvailable:   {available_kb} kB\n"
    )
    (root / "loadavg").write_text(f"{load} 1.00 1.00 3/212 18490\n")


def test_host_probe_memory_and_load_debounced(tmp_path):
    write_proc(tmp_path, 20_000_000, 0.5)
    p = HostProbe(str(tmp_path), cpus=2, warn_after=2)
    assert p.check(0.0) == [] and p.interval_s == 5.0
    write_proc(tmp_path, 200_000, 9.0)  # 195 MiB available; load 4.5 per CPU
    assert p.check(5.0) == []
    evs = {e.kind: e for e in p.check(10.0)}
    assert set(evs) == {"host_memory_low", "host_overload"}
    assert evs["host_memory_low"].detail["available_bytes"] == 200_000 * 1024
    assert evs["host_overload"].detail == {"load1": 9.0, "cpus": 2}
    assert all(e.severity == "warn" and not e.machine_certain for e in evs.values())
    write_proc(tmp_path, 20_000_000, 0.5)
    assert p.check(15.0) == []


def test_host_probe_reads_real_proc():
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo")
    mem = read_meminfo("/proc/meminfo")
    assert mem["MemTotal"] > mem["MemAvailable"] > 0
    HostProbe().check(0.0)  # must not raise on this host
    with pytest.raises(ValueError):
        HostProbe(max_load_per_cpu=0)
