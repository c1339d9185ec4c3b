"""A worker that died on its own before a stop is not marked as stopped by it (its crash must still
be reported), even while its watcher thread is blocked waiting on it."""
import os
import signal
import subprocess
import threading
import time

from stalwart.agent.workers import _exited


def test_exited_sees_a_dead_child_its_watcher_has_not_reaped():
    p = subprocess.Popen(["sleep", "30"])
    watcher = threading.Thread(target=p.wait)
    watcher.start()
    try:
        time.sleep(0.05)
        assert p.poll() is None and not _exited(p)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        watcher.join(timeout=10)
    assert _exited(p)


def test_exited_on_a_zombie_without_reaping_it():
    p = subprocess.Popen(["true"])
    deadline = time.time() + 10
    while not _exited(p) and time.time() < deadline:
        time.sleep(0.01)
    assert _exited(p) and p.returncode is None     # dead, not reaped
    assert p.wait(timeout=5) == 0                   # the status is still there for the watcher
