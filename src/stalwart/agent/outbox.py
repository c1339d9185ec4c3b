"""The agent's outgoing events while the controller is slow or away: bounded, never losing evidence.

Events wait here until the sender thread delivers them. When the buffer is full (a controller
restart taking long, say), the oldest *metrics* go first, then the oldest step reports; events
that are evidence of a failure (worker exits, probe alerts, stacks, check results...) are never
dropped. What was dropped is counted and reported with the next batch.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from typing import Deque

from stalwart.protocol import AGENT_RETRY_CAP_S

DEFAULT_LIMIT = 20_000
EVENT_LINGER_S = 0.2   # metrics wait this long for company (steps go at once: see `routine`)
STEP_GATHER_S = 0.02   # a rank's step report waits at most this long for the other local ranks' of its step
STEP_PACE_S = 0.25     # step reports go at most this often (a fast job's few steps in one request: PACED)
RETRY_CAP_S = AGENT_RETRY_CAP_S    # a restarted controller's reconcile grace allows two of these
# What may be dropped, first to last; every other kind is evidence (`protocol.EVIDENCE`).
DROP_ORDER = ("metrics", "activity", "step", "steps", "ckpt", "hello", "restored", "restore_source", "prewarmed",
              "standby_ready")
# What may wait a moment for company (`take(linger=)`): everything else goes out at once. Not
# step reports nor reports of durable copies: a machine that dies loses what waits in its outbox,
# and a lost report of its last step is a step missing from the job's record. A report of a copy
# in the machine's own memory, its own shard (tier "own") or a peer's backup it holds (tier
# "backup", holder: itself), may wait: if the machine dies the copy dies with it, and while it
# lives anything prompt behind it (a step report, a worker's exit) takes it along, in order.
ROUTINE = frozenset(("metrics", "activity"))
# Step reports are prompt, but a job stepping many times a second need not be one request per
# step: with `take(pace=)` a batch whose prompt events are all step reports waits until `pace`
# has passed since the last batch that carried some (a job of one step a second is not delayed;
# one of ten a second sends a few steps per request). Anything else prompt ends the wait at once.
# A report of a non-finite loss or gradient norm is evidence of a failure: it goes at once.
PACED = frozenset(("step",))
_CHECKED = ("loss", "grad_norm", "local_grad_norm")


def paced(event: dict) -> bool:
    """May `event` wait for the pace (see PACED)?"""
    if event.get("type") not in PACED:
        return False
    for k in _CHECKED:
        v = event.get(k)
        if isinstance(v, float) and not math.isfinite(v):
            return False
    return True


def routine(event: dict) -> bool:
    """May `event` wait for company (see ROUTINE)?"""
    kind = event.get("type")
    if kind in ROUTINE:
        return True
    return kind == "ckpt" and (event.get("tier") == "own" or (
        event.get("tier") == "backup" and event.get("holder") is not None
        and event.get("holder") == event.get("machine")))


class Outbox:
    def __init__(self, limit: int = DEFAULT_LIMIT):
        if limit < 1:
            raise ValueError(f"limit must be >= 1 (got {limit})")
        self.limit = limit
        self._q: Deque[dict] = collections.deque()
        self._cond = threading.Condition()
        self.dropped: dict[str, int] = {}
        self._prompt = 0            # queued events that may not linger
        self._urgent = 0            # ...of which not step reports either (see PACED)
        self._paced_at = float("-inf")   # when the last batch with step reports was taken
        # what `take` waits for now: while it paces step reports, another step report does not
        # wake it (a machine's ranks report 20 times a second: 20 wake-ups for nothing)
        self._pacing = False
        self._batch = 500

    def put(self, event: dict) -> None:
        with self._cond:
            self._q.append(event)
            if not routine(event):
                self._prompt += 1
                if not paced(event):
                    self._urgent += 1
            if len(self._q) > self.limit:
                self._make_room()
            if not self._pacing or self._urgent or len(self._q) >= self._batch:
                self._cond.notify()

    def _make_room(self) -> bool:
        """Drop the oldest event of the most expendable kind there is; False when only evidence
        is left (then the buffer goes over its limit rather than lose any: it is small and rare)."""
        for kind in DROP_ORDER:
            for i, ev in enumerate(self._q):
                if ev.get("type") == kind:
                    del self._q[i]
                    self._count_out([ev], -1)
                    self.dropped[kind] = self.dropped.get(kind, 0) + 1
                    return True
        return False

    def _steps_incomplete(self, ranks: int) -> bool:
        """Are step reports all that is prompt here, and has some step fewer than `ranks` of them?"""
        counts: dict[tuple, int] = {}
        for ev in self._q:
            if ev.get("type") == "step":
                key = (ev.get("run"), ev.get("step"))
                counts[key] = counts.get(key, 0) + 1
            elif not routine(ev):
                return False
        return any(c < ranks for c in counts.values())

    def take(self, timeout: float | None = None, max_batch: int = 500, linger: float = 0.0,
             gather: float = 0.0, ranks: int = 1, pace: float = 0.0) -> list[dict]:
        """Up to `max_batch` events, oldest first; waits up to `timeout` for the first one. With
        `gather`, step reports wait up to that long for the other ranks' reports of their step
        (`ranks` on this machine: they train in lockstep, their reports come within a moment, and
        together they are one request, not one each). With `linger`, a batch of routine events
        only (metrics, copies held here) waits that much longer for more, so a job's every step
        is not a request of its own; anything else (evidence of a failure, a restored rank) goes
        at once. With `pace`, step reports go at most once per `pace` seconds (PACED)."""
        with self._cond:
            if not self._q:
                left = self._paced_at + pace - time.monotonic() if pace > 0 else 0.0
                if left > 0:
                    # inside the pace: a step report (or a routine event) coming now could not go
                    # before its end, so it does not wake this thread; the end of the pace does
                    self._pacing, self._batch = True, max_batch
                    try:
                        self._cond.wait(left if timeout is None else min(timeout, left))
                    finally:
                        self._pacing = False
                else:
                    self._cond.wait(timeout)
            if self._q and pace > 0 and not self._urgent:
                self._pacing, self._batch = True, max_batch
                try:
                    while not self._urgent and len(self._q) < max_batch:
                        left = self._paced_at + pace - time.monotonic()    # (reset_pace moves it)
                        if left <= 0:
                            break
                        self._cond.wait(left)
                finally:
                    self._pacing = False
            if self._q and gather > 0 and ranks > 1:
                end = time.monotonic() + gather
                while len(self._q) < max_batch and self._steps_incomplete(ranks):
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            if self._q and linger > 0:
                end = time.monotonic() + linger
                while not self._prompt and len(self._q) < max_batch:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            n = min(max_batch, len(self._q))
            batch = [self._q.popleft() for _ in range(n)]
            self._count_out(batch, -1)
            if any(ev.get("type") in PACED for ev in batch):
                self._paced_at = time.monotonic()
            return batch

    def reset_pace(self) -> None:
        """A new run: its first step report goes at once (it ends a recovery)."""
        with self._cond:
            self._paced_at = float("-inf")
            self._cond.notify()      # (a pacing `take` looks at its deadline again)

    def _count_out(self, batch: list[dict], sign: int) -> None:
        for ev in batch:
            if not routine(ev):
                self._prompt += sign
                if not paced(ev):
                    self._urgent += sign

    def give_back(self, batch: list[dict]) -> None:
        """A batch that could not be delivered goes back to the front, in order."""
        with self._cond:
            self._q.extendleft(reversed(batch))
            self._count_out(batch, +1)
            while len(self._q) > self.limit and self._make_room():
                pass

    def __len__(self) -> int:
        with self._cond:
            return len(self._q)


def retry_delay(failures: int, heartbeat_s: float, rand: float) -> float:
    """Seconds before the next attempt to reach the controller after `failures` failed ones:
    doubling from a heartbeat up to RETRY_CAP_S, times a jitter in [0.5, 1) (`rand` in [0, 1))."""
    base = min(RETRY_CAP_S, heartbeat_s * (2 ** min(max(failures - 1, 0), 16)))
    return base * (0.5 + rand / 2)
