"""How late machines' heartbeats arrive: the jitter the silence rules allow for.

A machine that sends nothing for a while during a stop is called lost (`policy.silent_during_stop`).
How long "a while" must be depends on the host: on a quiet host beats arrive within milliseconds of
their interval and two intervals of silence mean a dead machine; on a loaded host one beat can come
a second late and the same rule would evict a live machine. `BeatLateness` keeps the largest lateness
seen (gap between two hearings of one machine minus the heartbeat interval) over a sliding window,
so the rule asks for as much silence as this host has actually shown, no more.
"""
from __future__ import annotations

WINDOW_S = 60.0     # lateness older than one to two windows is forgotten


class BeatLateness:
    """The largest heartbeat lateness seen over the last one to two windows (O(1) per beat)."""

    def __init__(self, heartbeat_s: float, window_s: float = WINDOW_S):
        self.heartbeat_s, self.window_s = heartbeat_s, window_s
        self._bucket_start: float | None = None
        self._current = 0.0                # max lateness in the current window
        self._previous = 0.0               # ... and in the one before

    def _roll(self, now: float) -> None:
        if self._bucket_start is None:
            self._bucket_start = now
        elif now - self._bucket_start >= 2 * self.window_s:
            self._current = self._previous = 0.0
            self._bucket_start = now
        elif now - self._bucket_start >= self.window_s:
            self._previous, self._current = self._current, 0.0
            self._bucket_start += self.window_s

    def heard(self, previous: float | None, now: float) -> None:
        """One machine heard at `now`, last heard at `previous` (None: first time)."""
        self._roll(now)
        if previous is None:
            return
        late = now - previous - self.heartbeat_s
        if late > self._current:
            self._current = late

    def late_s(self, now: float) -> float:
        """The largest lateness seen recently (0 when every beat came on time)."""
        self._roll(now)
        return max(self._current, self._previous, 0.0)
