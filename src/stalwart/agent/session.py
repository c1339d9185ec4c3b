"""The agent's side of its controller: registration, heartbeats, commands in, events out.

Three threads: heartbeat (every `heartbeat_s`, and the registration, again whenever the
controller asks or comes back), commands (pushed over the agent's channel, else a long poll;
each handed to the command executor passed in) and events (the outbox, delivered in order). The
line itself is `agent/link.py` (one WebSocket, HTTP requests where the controller has none).
Every part of the agent reports through `emit`; what the session registers with comes from a
callable passed in (`registration`), so it knows nothing of workers or checkpoints.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Protocol

import msgspec

from stalwart import protocol as p
from stalwart.agent.link import Link
from stalwart.agent.outbox import EVENT_LINGER_S, STEP_GATHER_S, STEP_PACE_S, Outbox, retry_delay
from stalwart.transport.client import ApiError, ControllerUnreachable

log = logging.getLogger("stalwart.agent")
SKIP_BEATS_FROM = 3    # missed beats the controller allows before an agent's batches stand in for beats


class CommandTarget(Protocol):
    """Who carries out the controller's commands (agent/executor.py)."""

    def execute(self, cmd: p.Command) -> None: ...

    def poll_wait(self) -> float:
        """How long the next poll for commands may wait."""
        ...

    def after_poll(self) -> None:
        """After each poll's commands (work due on the command thread: spares to start)."""
        ...


class ControllerSession:
    def __init__(self, link: Link, machine_id: str, registration: Callable[[], p.Registration],
                 worker_pids: Callable[[], list[int]], local_ranks: Callable[[], int], stop: threading.Event,
                 heartbeat_s: float = 1.0, controller_file: str | None = None,
                 on_heartbeat_s: Callable[[float], None] = lambda s: None):
        """`registration`: what to register with; `worker_pids`: the live workers a beat names;
        `local_ranks`: how many ranks the machine runs (a step's reports wait for each other);
        `controller_file`: where the controller's address is published (a restarted controller
        may get a new port); `on_heartbeat_s`: told the interval the controller asks for."""
        self.link = link
        self.machine_id = machine_id
        self.registration = registration
        self.worker_pids = worker_pids
        self.local_ranks = local_ranks
        self.controller_file = controller_file
        self.heartbeat_s = heartbeat_s
        self.on_heartbeat_s = on_heartbeat_s
        self.missed_beats = 3                  # the controller's limit, in beats (from its reply)
        self.registered = threading.Event()
        self._stop = stop
        self._events = Outbox()
        self._failures = 0          # failed attempts to reach the controller in a row
        self._delivered_at = float("-inf")   # when the controller last took a batch of events
        self._skip_beats = False
        self._merge_steps = False

    def start(self, commands: CommandTarget) -> None:
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self._command_loop, args=(commands,), name="commands", daemon=True).start()
        threading.Thread(target=self._sender_loop, name="events", daemon=True).start()

    @property
    def relink_s(self) -> float:
        """How long a worker's link waits for a restarted agent (past the controller's limit the
        machine is lost anyway)."""
        return round(self.heartbeat_s * self.missed_beats + 5.0, 1)

    # -- events out ------------------------------------------------------------------------------
    def emit(self, event: p.Event) -> None:
        """Queue an event for the controller: one of `protocol`'s events, in its wire form."""
        data: dict = msgspec.to_builtins(event)
        if not data.get("t"):
            data["t"] = time.time()
        data["machine"] = self.machine_id
        self._events.put(data)

    def reset_pace(self) -> None:
        """A new run: its first step reports go at once (see Outbox.take)."""
        self._events.reset_pace()

    # -- registration and heartbeats -----------------------------------------------------------
    def _register(self) -> None:
        reply = self.link.register(p.encode(self.registration()))
        self.heartbeat_s = float(reply.get("heartbeat_s", self.heartbeat_s))
        self.on_heartbeat_s(self.heartbeat_s)
        # beats may ride on events when the controller allows 3 missed beats or more (a
        # controller that does not say so gets every heartbeat)
        self._skip_beats = int(reply.get("missed_beats") or 0) >= SKIP_BEATS_FROM
        self.missed_beats = int(reply.get("missed_beats") or 3)
        self._merge_steps = bool(reply.get("steps_batch"))      # one step message per machine
        self.registered.set()
        log.info("registered with the controller as %s (%s, %s)", self.machine_id, reply.get("role"),
                 "over its channel" if self.link.over_channel else "HTTP requests")

    def _ensure_registered(self) -> bool:
        if self.registered.is_set():
            return True
        if self._failures:
            # where it is published, the controller may have come back on another address: knock
            # there now, not one more backoff after a failure at the old one
            self.link.find_controller(self.controller_file)
        try:
            self._register()
        except (ControllerUnreachable, ApiError) as e:
            self._failures += 1
            # a refusal is never transient: say it every time; an absence once in a while
            if isinstance(e, ApiError) or self._failures == 1 or self._failures % 20 == 0:
                log.warning("%s; retrying with backoff (attempt %d)", e, self._failures)
            return False
        if self._failures:
            log.info("controller back after %d failed attempt(s)", self._failures)
        self._failures = 0
        return True

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            if not self._ensure_registered():
                # back off (with jitter) while the controller is away: thousands of agents must
                # not knock on a restarting controller in step
                # with several controllers (an active one and standbys) the whole list is one
                # attempt: the next URL is tried at once, the backoff grows per round of the list
                n = len(self.link.urls)
                if n > 1 and self._failures % n:
                    self._stop.wait(0.05)
                else:
                    self._stop.wait(retry_delay(-(-self._failures // n), self.heartbeat_s, random.random()))
                continue
            if self._skip_beats and time.monotonic() - self._delivered_at < self.heartbeat_s / 2:
                # events went through within the last half interval and counted as a beat: one
                # request a second per machine, not two (at 2,000 machines the controller's load
                # halves). At worst 1.5 intervals pass between beats, inside the missed beats allowed
                self._stop.wait(self.heartbeat_s)
                continue
            try:
                reply = self.link.beat({"t": time.time(), "workers": self.worker_pids()},
                                       timeout=max(2.0, 3 * self.heartbeat_s))
                if reply.get("reregister"):
                    self.registered.clear()
            except ControllerUnreachable:
                self.registered.clear()
            except ApiError as e:
                log.warning("heartbeat refused: %s", e)
                self.registered.clear()
            self._stop.wait(self.heartbeat_s)

    # -- commands in -----------------------------------------------------------------------------
    def _command_loop(self, commands: CommandTarget) -> None:
        while not self._stop.is_set():
            if not self.registered.wait(0.5):
                continue
            try:
                cmds = self.link.commands(commands.poll_wait())   # (pushed over the channel, else a long poll)
            except (ControllerUnreachable, ApiError):
                self.registered.clear()
                self._stop.wait(0.2)
                continue
            except Exception:  # the command thread never dies: a dead thread is a deaf machine
                log.exception("polling the controller for commands failed; retrying")
                self._stop.wait(0.5)
                continue
            for raw in cmds:
                try:
                    commands.execute(p.decode_command(raw))
                except Exception as e:  # report, never die on one bad command
                    log.exception("command %s failed", raw.get("type"))
                    self.emit(p.CommandFailed(command=str(raw.get("type")), kind=raw.get("kind"), error=str(e)))
            commands.after_poll()

    # -- events out ------------------------------------------------------------------------------
    def _sender_loop(self) -> None:
        """Deliver events in order; while the controller is away keep them (bounded, see Outbox).
        A batch the controller refuses (4xx) is logged and dropped: sending it again cannot help."""
        while not self._stop.is_set():
            if not self.registered.wait(0.5):       # away: keep the events, the heartbeat loop
                continue                            # knocks (with backoff) for everyone
            batch = self._events.take(timeout=0.5, linger=EVENT_LINGER_S, gather=STEP_GATHER_S,
                                      ranks=self.local_ranks(), pace=STEP_PACE_S)
            if not batch:
                continue
            if self._merge_steps:
                batch = p.merge_steps(batch)
            try:
                reply = self.link.events(batch)
                if reply.get("taken", True) is False:       # a restarted controller: after registering
                    self._events.give_back(batch)
                    self.registered.clear()
                    continue
                self._delivered_at = time.monotonic()        # a delivered batch is a heartbeat
                if reply.get("reregister"):
                    self.registered.clear()
            except ControllerUnreachable:
                self._events.give_back(batch)
                self._stop.wait(0.2)
            except ApiError as e:
                if e.status >= 500:
                    self._events.give_back(batch)
                    self._stop.wait(0.2)
                else:
                    log.warning("controller refused %d event(s): %s", len(batch), e)
