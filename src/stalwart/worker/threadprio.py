"""Background threads of a training process at the lowest CPU priority.

A training thread on a busy host loses its CPU to whatever wakes up beside it: the checkpoint's
commit thread, woken at the end of each snapshot, ran at once and took the training thread's
CPU (the next step's first SDK call waited 0.2-0.4 ms for it on this 2-core host). At nice 19 it
runs while the training thread waits (in collectives, on the GPU) or on a spare core, and still
gets its share of a busy CPU (a SCHED_IDLE thread could starve there while a training thread
waits for it). On Linux the nice value of a thread (its native id) is its own.

(The agents' backup and durable-copy threads at nice 19 were measured too, and made the workers
slower, not faster: they stay at the agent's priority.)

Such a thread holds the interpreter lock for its Python parts while the OS may run other
threads instead, and the training thread then waits for the lock: keep the Python work handed to
it small (moving the snapshot's plan check there made the bench's SDK blocking worse, 2.02 ->
2.17 ms a step). Nice 10 was measured too (1.80 -> 1.98 ms), and SCHED_BATCH for the agents' and
workers' woken threads gained nothing measurable.
"""
from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 19


def background_thread() -> None:
    """Lower the calling thread's CPU priority to BACKGROUND_NICE (a no-op where that fails:
    a platform without per-thread nice values, or a sandbox that forbids it)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (OSError, AttributeError):
        pass
