"""One agent per work directory: a second agent started on a directory a live agent holds
refuses to start, with the reason in one line; once the first is gone the directory is free."""
import subprocess
import sys

import pytest

from jobrun import wait_for
from stalwart.agent.workers import kill_tree
from stalwart.security.auth import create_token_file


def agent(tmp_path, machine: str) -> list[str]:
    return [sys.executable, "-m", "stalwart.cli", "agent", "--controller", "http://127.0.0.1:9",
            "--machine-id", machine, "--workdir", str(tmp_path / "w"), "--token-file", str(tmp_path / "token"),
            "--kmsg", "off", "--shared-host"]


@pytest.mark.timeout(60)
def test_a_second_agent_on_a_work_directory_in_use_refuses_to_start(tmp_path):
    create_token_file(str(tmp_path / "token"))
    first = subprocess.Popen(agent(tmp_path, "m0"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        lock = tmp_path / "w" / "agent.lock"
        assert wait_for(lambda: lock.exists() and f"pid {first.pid}" in lock.read_text(), timeout=30)
        second = subprocess.run(agent(tmp_path, "m9"), capture_output=True, text=True, timeout=30)
        assert second.returncode == 2
        err = second.stderr.strip()
        assert err == (f"error: the work directory {tmp_path / 'w'} is in use by agent pid {first.pid} "
                       f"(machine m0): stop that agent first or give this one another --workdir"), err
        assert first.poll() is None          # the first one never noticed
    finally:
        kill_tree(first.pid)
        first.wait(timeout=10)
    again = subprocess.Popen(agent(tmp_path, "m0"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:                                      # the kernel released the lock with the process
        assert wait_for(lambda: f"pid {again.pid}" in (tmp_path / "w" / "agent.lock").read_text(), timeout=30)
    finally:
        kill_tree(again.pid)
        again.wait(timeout=10)
