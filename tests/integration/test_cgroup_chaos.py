"""cgroup chaos: freeze, thaw, CPU throttling and clean teardown on a real busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from stalwart.chaos.cgroup import CgroupChaos, available, cgroup_paths, cpu_limit, detect_layout


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def cpu_used_over(proc: psutil.Process, seconds: float) -> float:
    before = cpu_seconds(proc)
    time.sleep(seconds)
    return cpu_seconds(proc) - before


def wait_cpu_growth(proc: psutil.Process, amount: float, within: float) -> bool:
    start, deadline = cpu_seconds(proc), time.monotonic() + within
    while time.monotonic() < deadline:
        if cpu_seconds(proc) - start >= amount:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def busy():
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        ps = psutil.Process(proc.pid)
        assert wait_cpu_growth(ps, 0.05, 10), "busy loop never ran"
        yield ps
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def chaos():
    ok, why = available()
    if not ok:
        pytest.skip(why)
    c = CgroupChaos(f"test-{uuid.uuid4().hex[:8]}")
    try:
        yield c
    finally:
        c.destroy()
        for d in (c.freezer_dir, c.cpu_dir):
            assert d is None or not d.exists()


# ----- pure / filesystem-only -----------------------------------------------------------------
def test_detect_layout_v1_v2_hybrid_and_none(tmp_path: Path):
    v1 = tmp_path / "v1"
    (v1 / "freezer").mkdir(parents=True)
    (v1 / "freezer" / "cgroup.procs").write_text("")
    (v1 / "cpu,cpuacct").mkdir()
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1")
    lay = detect_layout(v1)
    assert (lay.freezer, lay.cpu, lay.cpu_root) == ("v1", "v1", v1 / "cpu,cpuacct")

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    lay = detect_layout(v2)
    assert (lay.freezer, lay.freezer_root, lay.cpu, lay.cpu_root) == ("v2", v2, "v2", v2)

    v2_nocpu = tmp_path / "v2b"
    v2_nocpu.mkdir()
    (v2_nocpu / "cgroup.controllers").write_text("hugetlb\n")
    (v2_nocpu / "freezer").mkdir()
    (v2_nocpu / "freezer" / "cgroup.procs").write_text("")
    lay = detect_layout(v2_nocpu)  # hybrid: v1 freezer, no cpu anywhere
    assert (lay.freezer, lay.cpu) == ("v1", None)
    ok, why = available(lay)
    assert not ok and ("cpu" in why or "root" in why)

    assert detect_layout(tmp_path / "missing") == detect_layout(tmp_path / "missing2")
    assert detect_layout(tmp_path / "missing").freezer is None


def test_cgroup_paths_and_cpu_limit():
    text = "9:name=systemd:/\n6:freezer:/a/b\n2:cpu,cpuacct:/c\n0::/user.slice\n"
    paths = cgroup_paths(text)
    assert paths["freezer"] == "/a/b" and paths["cpu"] == "/c" and paths["cpuacct"] == "/c"
    assert paths[""] == "/user.slice"
    assert cpu_limit(0.1) == (10_000, 100_000)
    assert cpu_limit(0.001, 100_000) == (1_000, 100_000)  # kernel minimum
    assert cpu_limit(2.0, 50_000) == (100_000, 50_000)
    for bad in (0, -1, "x"):
        with pytest.raises(ValueError):
            cpu_limit(bad)
    with pytest.raises(ValueError):
        CgroupChaos("bad/name")


# ----- real cgroups (root) --------------------------------------------------------------------
@pytest.mark.root
@pytest.mark.timeout(30)
def test_freeze_stops_cpu_and_thaw_resumes(chaos: CgroupChaos, busy: psutil.Process):
    chaos.freeze([busy.pid])
    assert chaos.frozen
    used = cpu_used_over(busy, 0.5)
    status = busy.status()
    print(f"frozen: cpu {used:.3f} s over 0.5 s, status {status}")
    assert used < 0.02
    assert status in (psutil.STATUS_DISK_SLEEP, psutil.STATUS_STOPPED, psutil.STATUS_SLEEPING)
    chaos.freeze([busy.pid])  # idempotent
    chaos.thaw()
    assert not chaos.frozen
    assert wait_cpu_growth(busy, 0.1, 10), "process did not run again after thaw"
    chaos.thaw()  # idempotent


@pytest.mark.root
@pytest.mark.timeout(30)
def test_throttle_to_ten_percent(chaos: CgroupChaos, busy: psutil.Process):
    chaos.throttle_cpu([busy.pid], fraction=0.1)
    cpu_used_over(busy, 0.2)  # let the quota take hold
    used = cpu_used_over(busy, 1.0)
    print(f"throttled to 10%: {used:.3f} s of CPU over 1 s")
    assert used < 0.3
    chaos.restore()
    assert wait_cpu_growth(busy, 0.35, 5), "CPU limit not lifted by restore()"


@pytest.mark.root
@pytest.mark.timeout(30)
def test_destroy_thaws_and_moves_back(busy: psutil.Process):
    ok, why = available()
    if not ok:
        pytest.skip(why)
    before = Path(f"/proc/{busy.pid}/cgroup").read_text()
    chaos = CgroupChaos(f"test-{uuid.uuid4().hex[:8]}")
    try:
        with chaos:
            chaos.throttle_cpu([busy.pid], fraction=0.2)
            chaos.freeze([busy.pid])
            raise KeyError("boom")  # an error inside the block must still thaw
    except KeyError:
        pass
    finally:
        chaos.destroy()
    assert Path(f"/proc/{busy.pid}/cgroup").read_text() == before
    assert not chaos.freezer_dir.exists() and not chaos.cpu_dir.exists()
    assert wait_cpu_growth(busy, 0.2, 5), "process left frozen or throttled after destroy"
    chaos.destroy()  # idempotent


@pytest.mark.root
@pytest.mark.timeout(30)
def test_bad_pid_is_a_clear_error(chaos: CgroupChaos):
    with pytest.raises(ValueError, match="no process"):
        chaos.freeze([2**22 + 12345])
    with pytest.raises(ValueError):
        chaos.throttle_cpu([], fraction=0.1)


def test_without_root_freeze_and_throttle_say_why(monkeypatch):
    from stalwart.chaos.cgroup import ChaosUnavailable

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert available() == (False, "needs root (uid 1000)")
    c = CgroupChaos("never-created")
    with pytest.raises(ChaosUnavailable, match="needs root"):
        c.freeze([os.getpid()])
    with pytest.raises(ChaosUnavailable, match="needs root"):
        c.throttle_cpu([os.getpid()])
    c.destroy()  # nothing was created: a no-op
