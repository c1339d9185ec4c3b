"""Probes against real mechanisms: concurrent writers of the simulated GPU's file (forked
processes), a tmpfs filled and remounted read-only, the host's /dev/kmsg."""
import multiprocessing
import os
import subprocess

import pytest

from stalwart.agent.probes.disk import DiskProbe
from stalwart.agent.probes.kmsg import KmsgProbe
from stalwart.devices.simgpu import SimGpu


@pytest.fixture
def sim(tmp_path):
    return SimGpu(tmp_path / "gpus.json", 2)


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


@pytest.mark.root
@pytest.mark.timeout(10)
def test_kmsg_probe_reads_only_new_records_from_dev_kmsg():
    if os.geteuid() != 0:
        pytest.skip("writing to /dev/kmsg needs root")
    p = KmsgProbe("/dev/kmsg")
    try:
        marker = f"stalwart-kmsg-probe-test {os.getpid()}-{os.urandom(4).hex()}"
        with open("/dev/kmsg", "w") as f:
            f.write(marker + "\n")
        lines = p.new_lines()
        assert any(marker in line for line in lines)
        assert all("Linux version" not in line for line in lines)  # old records were skipped
        assert not any(marker in line for line in p.new_lines())
    finally:
        p.close()


@pytest.fixture
def tiny_mount(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.root
@pytest.mark.timeout(20)
def test_disk_probe_on_real_full_and_read_only_filesystems(tiny_mount):
    p = DiskProbe([str(tiny_mount)])
    assert p.check(0.0) == []
    with open(tiny_mount / "fill", "wb") as f:
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    assert [e.kind for e in p.check(10.0)] == ["disk_full"]
    os.unlink(tiny_mount / "fill")
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_mount)], check=True)
    (e,) = p.check(20.0)
    assert (e.kind, e.machine_certain) == ("disk_fault", True) and "Read-only" in e.detail["error"]
