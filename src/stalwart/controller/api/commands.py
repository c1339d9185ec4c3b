"""Commands waiting for their agents: pushed on an agent's channel, or taken by its long poll.

Job threads put commands (any thread). An agent with a channel (controller/api/channel.py) has a
pusher attached here: a command wakes only that pusher, on the API's event loop
(`call_soon_threadsafe`), which takes the machine's commands and writes them to its socket. An
agent without one (HTTP: an older agent) long-polls for its own (`take`), so thousands of idle
agents cost no thread each; a poll that times out is answered by a timer on the loop (no task, no
cancellation: thousands of polls end every few seconds).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from stalwart import protocol

MAX_WAIT_S = 30.0


class CommandQueues:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, list[dict]] = {}
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._pushers: dict[str, tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def put(self, machine: str, cmd: dict) -> None:
        with self._lock:
            self._queues.setdefault(machine, []).append(cmd)
            self._wake(machine)

    def send(self, machine: str, cmd: protocol.Command) -> None:
        """A typed command for the machine's agent (the job executors' `AgentGateway`)."""
        self.put(machine, protocol.encode(cmd))     # wakes only that machine's pusher or poll

    # -- channels: commands pushed -------------------------------------------------------------------
    def attach(self, machine: str, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        """`wake()` runs on `loop` whenever a command for `machine` is put (and at once when some
        wait already); it replaces the machine's previous pusher (a reconnected agent)."""
        with self._lock:
            self._pushers[machine] = (loop, wake)
            if self._queues.get(machine):
                loop.call_soon_threadsafe(wake)

    def detach(self, machine: str, wake: Callable[[], None]) -> None:
        with self._lock:
            pusher = self._pushers.get(machine)
            if pusher is not None and pusher[1] == wake:      # (==: a bound method is made anew each time)
                del self._pushers[machine]

    def take_now(self, machine: str) -> list[dict]:
        """The machine's waiting commands, taken (none: an empty list)."""
        with self._lock:
            cmds = self._queues.get(machine)
            if not cmds:
                return []
            self._queues[machine] = []
            return cmds

    def give_back(self, machine: str, cmds: list[dict]) -> None:
        """Commands that could not be written (the socket went away): first in line again."""
        if cmds:
            with self._lock:
                self._queues[machine] = cmds + self._queues.get(machine, [])
                self._wake(machine)         # (a newer channel of the machine, or its poll)

    def pending(self, machine: str) -> int:
        with self._lock:
            return len(self._queues.get(machine, ()))

    def _wake(self, machine: str) -> None:          # (with the lock held)
        waiters, loop = self._waiters.pop(machine, None), self._loop
        if waiters and loop is not None and not loop.is_closed():
            for w in waiters:
                loop.call_soon_threadsafe(_resolve, w)
        pusher = self._pushers.get(machine)
        if pusher is not None and not pusher[0].is_closed():
            pusher[0].call_soon_threadsafe(pusher[1])

    async def take(self, machine: str, wait: float) -> list[dict]:
        """The machine's commands; when there are none, wait up to `wait` seconds (at most
        MAX_WAIT_S) for the first. Runs on one event loop (the API's)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(wait, MAX_WAIT_S))
        while True:
            left = deadline - loop.time()
            with self._lock:
                cmds = self._queues.get(machine)
                if cmds or self._closed or left <= 0:
                    self._queues[machine] = []
                    return cmds or []
                self._loop = loop
                waiter = loop.create_future()     # a put after this line resolves it (it takes the lock)
                self._waiters.setdefault(machine, []).append(waiter)
            timer = loop.call_later(left, _resolve, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                with self._lock:
                    mine = self._waiters.get(machine)
                    if mine and waiter in mine:
                        mine.remove(waiter)
                        if not mine:
                            del self._waiters[machine]

    def close(self) -> None:
        """Answer every waiting poll now (empty) and every later one at once."""
        with self._lock:
            self._closed = True
            for machine in list(self._waiters):
                self._wake(machine)


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
