"""The controller process and Python's cycle collector.

A full collection walks every object the collector tracks. A controller holds few of its own
(tens of thousands at 1,024 machines) but its libraries hold many more: torch alone (imported for
the rendezvous stores) leaves ~150k, aiohttp, SQLAlchemy, numpy and scipy more. At 1,024 agents
a full collection came every ~10 s and took ~0.2 s, during which the API's event loop answered no
agent (a 0.2 s beat round trip each time). Once the controller has started and torch is
imported, what exists then lives as long as the process: `settle` collects once and freezes it
(`gc.freeze`), so later collections walk only what came after. (Frozen objects that later become
cyclic garbage are never collected: a few start-up objects at most.)
"""
from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger("stalwart.controller")


def settle() -> float:
    """Collect, then freeze every object there is now; returns the seconds it took."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0


def settle_when(ready: threading.Event, timeout_s: float = 300.0) -> None:
    """`settle` once `ready` is set (or after `timeout_s`); for a thread of its own."""
    ready.wait(timeout_s)
    took = settle()
    log.info("start-up objects frozen out of the cycle collector (%d, in %.2fs)", gc.get_freeze_count(), took)
