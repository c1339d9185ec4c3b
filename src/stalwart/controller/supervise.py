"""Threads that never die silently: a supervised thread that raises is logged with its traceback
and started again after a pause (doubling to a minute while it keeps failing at once), so one
database error or bug costs a loop iteration, not the heartbeat monitor or a job for good."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("stalwart.controller")
FIRST_PAUSE_S, MAX_PAUSE_S = 0.5, 60.0
HEALTHY_S = 30.0        # a thread that ran this long before failing starts again at the first pause


def supervised(name: str, target: Callable[[], None], stop: threading.Event | None = None,
               start: bool = True) -> threading.Thread:
    """A daemon thread running `target` until it returns (or `stop` is set); restarted when it raises."""
    halt = stop or threading.Event()

    def run() -> None:
        pause = FIRST_PAUSE_S
        while not halt.is_set():
            began = time.monotonic()
            try:
                target()
                return
            except Exception as e:
                if time.monotonic() - began > HEALTHY_S:
                    pause = FIRST_PAUSE_S
                log.exception("thread %s failed (%s: %s); restarting it in %.1fs", name, type(e).__name__, e, pause)
            if halt.wait(pause):
                return
            pause = min(MAX_PAUSE_S, pause * 2)

    t = threading.Thread(target=run, name=name, daemon=True)
    if start:
        t.start()
    return t
