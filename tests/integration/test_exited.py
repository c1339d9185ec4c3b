"""A worker that died on its own before a stop is not marked as stopped by it (its crash must still
be reported), even while its watcher thread is blocked waiting on it."""
import os
import signal
import subprocess
import threading
import time

import pytest

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


def test_renice_sets_every_thread_of_a_process(tmp_path):
    import sys
    from stalwart.agent.workers import renice
    # a child with a second thread, both started at niceness 5
    code = ("import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); "
            "time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", code], preexec_fn=lambda: os.nice(5))
    try:
        deadline = time.time() + 10
        while len(os.listdir(f"/proc/{p.pid}/task")) < 2 and time.time() < deadline:
            time.sleep(0.01)
        tids = [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
        assert len(tids) == 2 and all(os.getpriority(os.PRIO_PROCESS, t) == 5 for t in tids)
        target = 7 if os.geteuid() != 0 else 0         # only root may lower a niceness
        assert renice(p.pid, target)
        assert all(os.getpriority(os.PRIO_PROCESS, t) == target for t in tids)
    finally:
        p.kill()
        p.wait()
    assert not renice(p.pid, 0)                        # gone: says so, does not raise


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may bring a process back from SCHED_IDLE")
def test_a_warm_worker_waits_in_the_idle_class_and_renice_brings_every_thread_back(tmp_path):
    import sys
    from stalwart.agent.workers import WorkerSet, renice
    ws = WorkerSet(str(tmp_path), on_exit=lambda w: None)
    code = ("import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); "
            "time.sleep(30)")
    ws.spawn([sys.executable, "-c", code], [dict(os.environ)], [None], None, None, "warm", nice=10)
    pid = ws.workers[0].proc.pid
    try:
        deadline = time.time() + 10
        while len(os.listdir(f"/proc/{pid}/task")) < 2 and time.time() < deadline:
            time.sleep(0.01)
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert len(tids) == 2
        assert all(os.sched_getscheduler(t) == os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, t) == 10
                   for t in tids)
        assert renice(pid, 0)
        assert all(os.sched_getscheduler(t) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, t) == 0
                   for t in tids)
    finally:
        ws.stop()


def test_a_fatal_signal_pending_counts_as_dying_and_the_stop_does_not_claim_the_exit(tmp_path):
    """A worker hit by a fatal signal a moment before a stop (not yet acted on: here the worker
    blocks it) keeps its crash: the stop marks only the workers it ends itself."""
    import sys
    from stalwart.agent.workers import WorkerSet, ended_on_its_own
    code = ("import signal, sys, time; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGABRT}); "
            "print('ready', flush=True); time.sleep(30)")
    exits = []
    ws = WorkerSet(str(tmp_path), exits.append)
    ws.spawn([sys.executable, "-c", code], [dict(os.environ)] * 2, [0, 1], run=1, cwd=None, tag="t")
    crashed, healthy = ws.workers
    try:
        deadline = time.time() + 20
        while not all("ready" in w.log_tail() for w in ws.workers) and time.time() < deadline:
            time.sleep(0.01)
        assert not ended_on_its_own(crashed.proc) and not ended_on_its_own(healthy.proc)
        os.kill(crashed.proc.pid, signal.SIGABRT)          # pending: blocked
        assert ended_on_its_own(crashed.proc) and not ended_on_its_own(healthy.proc)
    finally:
        ws.stop(grace_s=0.0)                               # also when an assertion failed
    deadline = time.time() + 10
    while len(exits) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert {w.rank: w.expected_exit for w in exits} == {0: False, 1: True}


def test_process_tree_finds_every_descendant_from_the_children_files():
    import psutil

    from stalwart.agent.workers import process_tree
    p = subprocess.Popen(["bash", "-c", "sleep 30 & (sleep 30; true) & wait"])
    try:
        want = None
        for _ in range(100):                      # until bash forked both (bounded)
            want = sorted([p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)])
            if len(want) >= 4:
                break
            time.sleep(0.05)
        assert want is not None and len(want) >= 4
        assert sorted(x.pid for x in process_tree(p.pid)) == want
    finally:
        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait()
    assert process_tree(p.pid) == []
