"""Commands waiting for their agents, and the agents' long polls for them.

Job threads put commands (any thread); each agent long-polls for its own on the API's event loop
(`take`), so thousands of idle agents cost no thread each. A command wakes only the agent it is
for: its machine's `asyncio.Event`, set through the loop (`call_soon_threadsafe`).
"""
from __future__ import annotations

import asyncio
import threading

MAX_WAIT_S = 30.0


class CommandQueues:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, list[dict]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def put(self, machine: str, cmd: dict) -> None:
        with self._lock:
            self._queues.setdefault(machine, []).append(cmd)
            self._wake(machine)

    def pending(self, machine: str) -> int:
        with self._lock:
            return len(self._queues.get(machine, ()))

    def _wake(self, machine: str) -> None:          # (with the lock held)
        ev, loop = self._events.get(machine), self._loop
        if ev is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(ev.set)

    async def take(self, machine: str, wait: float) -> list[dict]:
        """The machine's commands; when there are none, wait up to `wait` seconds (at most
        MAX_WAIT_S) for the first. Runs on one event loop (the API's)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(wait, MAX_WAIT_S))
        while True:
            with self._lock:
                cmds = self._queues.get(machine)
                if cmds or self._closed:
                    self._queues[machine] = []
                    return cmds or []
                self._loop = loop
                ev = self._events.get(machine)
                if ev is None:
                    ev = self._events[machine] = asyncio.Event()
                ev.clear()        # a put after this line sets it again (it takes the lock first)
            left = deadline - loop.time()
            if left <= 0:
                return []
            try:
                await asyncio.wait_for(ev.wait(), left)
            except TimeoutError:
                pass

    def close(self) -> None:
        """Answer every waiting poll now (empty) and every later one at once."""
        with self._lock:
            self._closed = True
            for machine in self._events:
                self._wake(machine)
