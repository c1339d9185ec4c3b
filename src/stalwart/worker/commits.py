"""The thread that commits a rank's in-memory snapshots (checksum, MAC, header) in the background.

`worker/memckpt.py` copies a snapshot's tensors on the training thread and hands the rest of the
commit here; one thread per checkpointer, at nice 19, runs them in order.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from stalwart.worker.threadprio import background_thread

COMMIT_POLL_S = 0.004     # how often the commit thread looks for snapshots to commit
COMMIT_IDLE_POLLS = 25    # empty looks (100 ms) before it sleeps until a hand-off wakes it


class CommitThread:
    """One background thread at nice 19 that runs the commits in order; `submit` returns a Future.

    The training thread hands a commit over by appending it to a deque, and the commit thread
    looks every COMMIT_POLL_S: the hand-off wakes no thread. Waking the sleeping nice-19 thread
    at every save (a ThreadPoolExecutor's `submit`, or a queue's `put`) cost the training thread
    0.5-0.7 ms a save on the loaded 2-core host (the DCP adapter's saves: 1.3 ms of blocking);
    the poll costs a commit at most COMMIT_POLL_S of delay, and a save whose slot's previous
    commit has not started does that commit itself (`snapshot`). After COMMIT_IDLE_POLLS empty
    looks (no save for 100 ms: a job whose steps are that long, or one that snapshots now and
    then) the thread sleeps until the next hand-off wakes it: an idle worker is not woken 250
    times a second, and a wake-up per save is small beside a step that long.
    """

    def __init__(self, name: str) -> None:
        self._items: deque = deque()
        self._stopping = False
        self._asleep = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # at the interpreter's exit, the snapshots handed over are committed first (what a
        # ThreadPoolExecutor's exit hook does for its work items)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self.shutdown)

    def submit(self, fn: Callable, *args: Any) -> Future:
        fut: Future = Future()
        self._items.append((fut, fn, args))
        if self._asleep:
            self._wake.set()
        return fut

    def _run(self) -> None:
        background_thread()
        idle = 0
        while True:
            if self._items:
                idle = 0
            while self._items:
                fut, fn, args = self._items.popleft()
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:     # noqa: BLE001 — handed to the snapshot's future
                    fut.set_exception(e)
            if self._stopping:
                return
            idle += 1
            if idle < COMMIT_IDLE_POLLS:
                time.sleep(COMMIT_POLL_S)
                continue
            # asleep first, then one more look: a hand-off after that look sees the flag and wakes it
            self._asleep = True
            if not self._items and not self._stopping:
                self._wake.wait()
            self._asleep = False
            self._wake.clear()
            idle = 0

    def shutdown(self, wait: bool = True) -> None:
        """Run what was submitted, then stop the thread (joined when `wait`)."""
        self._stopping = True
        self._wake.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
