"""Agent probes and the simulated GPU, with temp files as their sources."""

import json
import multiprocessing
import os

import pytest

from stalwart.agent.probes.base import Debounce, HealthEvent, Probe
from stalwart.agent.probes.gpu import FATAL_XIDS, GpuProbe, SimGpuSource, assess, make_gpu_source
from stalwart.agent.probes.simgpu import SimGpu, fatal_line, slowdown_factor


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


def _add_xids(path, device, codes):
    s = SimGpu(path)
    for c in codes:
        s.add_xid(device, c)


@pytest.mark.timeout(30)
def test_simgpu_concurrent_writers_lose_nothing(sim, tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_xids, args=(str(tmp_path / "gpus.json"), 0, [13] * 20)) for _ in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(20)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert sim.read()[0]["xid"] == [13] * 40


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
