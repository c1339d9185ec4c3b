"""Unit tests are pure: one that starts a process (subprocess, fork, multiprocessing) fails here
and belongs in tests/integration."""
import multiprocessing.process
import os
import subprocess
import threading
import time

import pytest

_STARTED = pytest.StashKey[list]()


def _refuse(*_a, **_kw):
    raise AssertionError("a unit test started a process: move it to tests/integration")


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(os, "fork", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)



@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = set(threading.enumerate())
    try:
        return (yield)
    finally:
        item.stash[_STARTED] = [t for t in threading.enumerate() if t not in before]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A thread a unit test starts ends with the test (its fixtures' teardown included): one left
    running (a job's event loop) would act on the next tests' state, and a spy on the job core
    would record its events. Threads of module-wide fixtures are theirs to stop, and so are the
    idle workers of a pool (a server's executor starts them on its first request)."""
    result = yield
    deadline = time.monotonic() + 5.0
    left = [t for t in item.stash.get(_STARTED, []) if not _pool_worker(t)]
    for t in left:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = sorted(t.name for t in left if t.is_alive())
    assert not alive, f"threads the test started still run after it: {alive}"
    return result


def _pool_worker(t: threading.Thread) -> bool:
    target = getattr(t, "_target", None)
    return getattr(target, "__module__", "") == "concurrent.futures.thread"
