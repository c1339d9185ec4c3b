"""The hang watch as it was held before its arrays: a record per rank in a dict (`_RankState`), a
list of recent intervals per rank, and a full look that loops over them. The unit tests hold
`HangWatch`'s arrays to it on random sequences of every operation (`test_hangwatch.py`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from stalwart.controller.rules.hangwatch import (DEFAULT_WARMUP_FACTOR, DEFAULT_WINDOW, HangVerdict, _RankState,
                                                 _rank, _time)
from stalwart.spec import Policy


@dataclass
class PlainHangWatch:
    """Per-run hang detector; see the module docstring for the timeout rules.

    policy: any object with ``hang_timeout_floor_s``, ``hang_safety_factor`` and
        ``hang_warmup_steps`` (a :class:`stalwart.spec.Policy`).
    ranks: the ranks expected to report (the run's world); a listed rank that has never
        shown any progress counts from ``started_at``.  Ranks not listed are added when
        they first report.
    started_at: when the run's workers were started (default: the first event seen).
    warmup_factor: the uncalibrated timeout is this times the floor (>= 1).
    window: recent intervals kept per rank for calibration (>= 1).
    """

    policy: Policy
    ranks: Iterable[int] = ()
    started_at: float | None = None
    warmup_factor: float = DEFAULT_WARMUP_FACTOR
    window: int = DEFAULT_WINDOW
    _state: dict[int, _RankState] = field(default_factory=dict, init=False, repr=False)
    _recent: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)
    _warmup_max: float = field(default=0.0, init=False, repr=False)
    _calibrated: bool = field(default=False, init=False, repr=False)
    _latched: HangVerdict | None = field(default=None, init=False, repr=False)
    _resumed_at: float | None = field(default=None, init=False, repr=False)
    _ending: bool = field(default=False, init=False, repr=False)     # some rank finished
    # a lower bound of every rank's last progress (None: unknown), so that a check within the
    # floor timeout of it needs no look at every rank (a controller ticks 5 times a second)
    _lower: float | None = field(default=None, init=False, repr=False)
    # no rank can be stalled before this time (the earliest last progress + its timeout, from the
    # last full look); any report, activity or resume forgets it (timeouts and progress move)
    _quiet_until: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("hang_timeout_floor_s", "hang_safety_factor", "hang_warmup_steps"):
            if not hasattr(self.policy, name):
                raise ValueError(f"policy lacks {name} (pass a stalwart.spec.Policy)")
        if self.policy.hang_timeout_floor_s <= 0 or self.policy.hang_safety_factor < 1:
            raise ValueError("policy needs hang_timeout_floor_s > 0 and hang_safety_factor >= 1")
        if isinstance(self.warmup_factor, bool) or not isinstance(self.warmup_factor, (int, float)) \
                or not self.warmup_factor >= 1:
            raise ValueError(f"warmup_factor must be >= 1 (got {self.warmup_factor!r})")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be a positive integer (got {self.window!r})")
        if self.started_at is not None:
            self.started_at = _time("started_at", self.started_at)
        self._start_grace = float(getattr(self.policy, "worker_start_s", 0.0))
        for r in list(self.ranks):
            self._state.setdefault(_rank(r), _RankState())   # kept when loaded from a saved state
        self.ranks = tuple(sorted(self._state))

    # ------------------------------------------------------------------ events
    def _woken(self, t: float) -> None:
        """Progress was seen at `t`: a quiet period ends, and the first progress starts the clock."""
        self._quiet_until = None
        if self.started_at is None:
            self.started_at = t
            self._lower = None

    def _touch(self, rank: int, t: float) -> _RankState:
        self._woken(t)
        st = self._state.get(rank)
        if st is None:
            st = self._state[rank] = _RankState()
            self.ranks = tuple(sorted(self._state))
            self._lower = None
        return st

    def on_step(self, rank: int, step: int, t: float) -> None:
        """Rank ``rank`` finished ``step`` at time ``t``.

        A step not higher than the rank's last one is not progress and is ignored (an older
        report sent again after a reconnect among them, whatever its time); time running
        backwards for a rank's new step is refused.
        """
        rank, t = _rank(rank), _time("t", t)
        if type(step) is not int or step < 0:       # (an int subclass such as bool is refused)
            raise ValueError(f"step must be a non-negative integer (got {step!r})")
        st = self._state.get(rank)
        if st is not None and st.step is not None and step <= st.step:
            return
        self._advance(rank, self._touch(rank, t), step, t)

    def _advance(self, rank: int, st: _RankState, step: int, t: float) -> None:
        """A known rank's new step `step` at `t` (progress: checked by the caller)."""
        if st.step_t is not None and t < st.step_t:
            raise ValueError(f"rank {rank} reported step {step} at {t}, before its previous "
                             f"report at {st.step_t}")
        if st.step_t is not None:
            st.reports += 1
            self._interval(rank, st.reports, t - st.step_t)
        else:
            # the first report's distance from its worker's start is a warm-up interval too
            start = self._start_of(st)
            if start is not None:
                self._warmup_max = max(self._warmup_max, t - start)
            self._lower = None
        st.step, st.step_t = step, t
        self._latched = None

    def on_steps(self, ranks: Sequence[int], step: int, t: float) -> None:
        """`on_step(rank, step, t)` for each rank in turn (one step that many ranks reported at
        once), with the checks of `step` and `t` made once."""
        t = _time("t", t)
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative integer (got {step!r})")
        state, touched = self._state, False
        warm, window, recents = self.policy.hang_warmup_steps, self.window, self._recent
        for rank in ranks:
            st = state.get(rank)
            if st is None or type(rank) is not int or rank < 0:
                self.on_step(rank, step, t)        # a rank first seen (or malformed): the full path
                touched = True
                continue
            if st.step is not None and step <= st.step:
                continue
            if not touched:                         # what `_touch` does for a known rank, once
                self._woken(t)
                touched = True
            # `_advance(rank, st, step, t)` and its `_interval`, without two calls per rank
            last = st.step_t
            if last is None:
                self._advance(rank, st, step, t)
                continue
            if t < last:
                raise ValueError(f"rank {rank} reported step {step} at {t}, before its previous "
                                 f"report at {last}")
            st.reports += 1
            if st.reports > warm:
                recent = recents.get(rank)
                if recent is None:
                    recent = recents[rank] = []
                recent.append(t - last)
                del recent[:-window]
                if not self._calibrated:
                    self._lower = None
                self._calibrated = True
            else:
                self._warmup_max = max(self._warmup_max, t - last)
            st.step, st.step_t = step, t
            self._latched = None

    def _interval(self, rank: int, marks: int, interval: float) -> None:
        """One more interval between a rank's progress marks (steps, or collectives without the
        SDK): past the warm-up marks it calibrates the timeout."""
        if marks > self.policy.hang_warmup_steps:
            recent = self._recent.setdefault(rank, [])
            recent.append(interval)
            del recent[:-self.window]
            if not self._calibrated:      # activity no longer counts: progress times may drop
                self._lower = None
            self._calibrated = True
        else:
            self._warmup_max = max(self._warmup_max, interval)

    def on_collectives(self, rank: int, count: int, t: float) -> None:
        """Rank ``rank`` (without the SDK) had entered ``count`` collectives at ``t``.

        A count that did not grow, a report older than the rank's last mark, and any count from a
        rank that reports SDK steps (its steps are its progress) are ignored."""
        rank, t = _rank(rank), _time("t", t)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"collective count must be a non-negative integer (got {count!r})")
        st = self._touch(rank, t)
        if st.step is not None or (st.coll is not None and count <= st.coll) or \
                (st.coll_t is not None and t < st.coll_t):
            return
        if st.coll_t is not None:
            st.coll_marks += 1
            self._interval(rank, st.coll_marks, t - st.coll_t)
        else:
            start = self._start_of(st)
            if start is not None:
                self._warmup_max = max(self._warmup_max, t - start)
        st.coll, st.coll_t = count, t
        self._latched = None

    def on_activity(self, rank: int, t: float) -> None:
        """Rank ``rank`` showed progress other than a step report at ``t`` (CPU time or log
        growth, as judged by :func:`stalwart.analyzer.activity.progressed`)."""
        rank, t = _rank(rank), _time("t", t)
        st = self._touch(rank, t)
        if st.activity_t is None or t > st.activity_t:
            st.activity_t = t
            if st.step is None or not self._calibrated:
                self._latched = None

    def on_started(self, ranks: Sequence[int], t: float) -> None:
        """The workers of ``ranks`` were started at ``t``: their clocks count from then."""
        t = _time("t", t)
        for rank in ranks:
            st = self._touch(_rank(rank), t)
            if st.start_t is None or t > st.start_t:
                st.start_t = t
        self._lower = None
        self._latched = None

    def _start_of(self, st: _RankState) -> float | None:
        if st.start_t is None:
            return self.started_at
        return st.start_t if self.started_at is None else max(st.start_t, self.started_at)

    def on_done(self, rank: int) -> None:
        """Rank ``rank``'s worker finished (exit 0): it makes no more progress and is never stalled;
        the ranks still running are judged on their own."""
        st = self._state.get(_rank(rank))
        if st is None or st.done:
            return
        st.done = True
        self._ending = True
        self._latched = None
        self._lower = self._quiet_until = None

    def done(self) -> list[int]:
        """The ranks whose worker finished."""
        return sorted(r for r, st in self._state.items() if st.done)

    def resume(self, t: float) -> None:
        """Nobody could watch the ranks until `t` (the controller was away): count `t` as every
        rank's last progress, without touching the step history reports keep arriving for."""
        self._resumed_at = _time("t", t)
        self._latched = None
        self._quiet_until = None

    # --------------------------------------------------------------- timeouts
    @property
    def calibrated(self) -> bool:
        """True once some rank has reported more than the warm-up steps."""
        return self._calibrated

    def warmup_timeout(self) -> float:
        """The uncalibrated timeout: max(warmup_factor * floor, safety * longest interval seen)."""
        p = self.policy
        return max(self.warmup_factor * p.hang_timeout_floor_s,
                   p.hang_safety_factor * self._warmup_max)

    def timeout(self) -> float:
        """The hang timeout in force now (seconds)."""
        p = self.policy
        if not self._calibrated:
            return self.warmup_timeout()
        longest = max(max(d) for d in self._recent.values() if d)
        return max(p.hang_timeout_floor_s, p.hang_safety_factor * longest)

    def _progress(self, st: _RankState, warmup: float, current: float) -> tuple[float | None, float]:
        """(last progress time, timeout that applies to it) for one rank; `warmup` and `current`
        are `warmup_timeout()` and `timeout()`, computed once per check (each looks at every
        rank's history: per rank, a check over thousands of ranks would be quadratic)."""
        if st.step is None:
            times = [x for x in (st.activity_t, st.coll_t, self._start_of(st), self._resumed_at) if x is not None]
            # a rank calibrated on its collectives is judged on the calibrated timeout
            return (max(times) if times else None), current if self._calibrated and st.coll is not None \
                else warmup
        if not self._calibrated or self._ending:
            # (once some rank finished, no more steps come: what the others still do is activity)
            times = [x for x in (st.step_t, st.activity_t, self._resumed_at) if x is not None]
            return max(times), current
        times = [x for x in (st.step_t, self._resumed_at) if x is not None]
        return max(times), current

    # ------------------------------------------------------------------ check
    def check(self, now: float) -> HangVerdict | None:
        """A verdict when some rank has shown no progress for longer than its timeout.

        The verdict is latched: repeated checks return the same object (same
        ``detected_at``) until some progress resets it.
        """
        now = _time("now", now)
        if self._latched is not None:
            return self._latched
        if self._lower is not None and now - self._lower <= self.policy.hang_timeout_floor_s:
            return None             # every timeout is at least the floor: nobody can be stalled yet
        if self._quiet_until is not None and now <= self._quiet_until:
            return None             # nothing changed since a look that saw nobody due before then
        stalled: dict[int, float] = {}
        timeouts = []
        warmup, current = self.warmup_timeout(), self.timeout()
        progress = {rank: self._progress(st, warmup, current) for rank, st in self._state.items() if not st.done}
        if self._start_grace > 0 and any(
                st.step is None and st.start_t is None and st.activity_t is None and st.coll_t is None
                for st in self._state.values() if not st.done):
            # a worker not started yet: the ranks without steps may all be waiting for it
            progress = {r: (last, limit + self._start_grace if self._state[r].step is None else limit)
                        for r, (last, limit) in progress.items()}
        # step-less ranks are judged together (see the module docstring): the newest progress of any
        shared = max((last for r, (last, _) in progress.items()
                      if last is not None and self._state[r].step is None), default=None)
        lower = due = math.inf
        for rank, st in self._state.items():
            if st.done:
                continue
            last, limit = progress[rank]
            if st.step is None and shared is not None:
                last = shared
            if last is not None:
                lower = min(lower, last)
                due = min(due, last + limit)
                if now - last > limit:
                    stalled[rank] = last
                    timeouts.append(limit)
        self._lower = lower if math.isfinite(lower) else None
        self._quiet_until = due if math.isfinite(due) else None
        if not stalled:
            return None
        last_step = {r: st.step for r, st in self._state.items() if st.step is not None}
        top = max(last_step.values()) if last_step else None
        laggards = sorted(r for r in self._state if top is not None and
                          (r not in last_step or last_step[r] < top))
        since = min(stalled.values())
        limit = max(timeouts)
        if top is None:
            marks = any(st.coll is not None for st in self._state.values())
            what = ("no rank has reported a step" if not marks else
                    "no rank entered a new collective or used CPU outside one")
        elif laggards:
            what = (f"ranks {laggards} never reported step {top} "
                    f"({len(self._state) - len(laggards)} others did)")
        else:
            what = f"all ranks stopped after step {top}"
        reason = (f"{len(stalled)} of {len(self._state)} ranks without progress for "
                  f"{now - since:.1f} s (timeout {limit:.1f} s, "
                  f"{'calibrated' if self._calibrated else 'warm-up'}); {what}")
        self._latched = HangVerdict(
            detected_at=now, stalled_since=since, timeout_s=limit, stalled=dict(sorted(stalled.items())),
            last_step=dict(sorted(last_step.items())), waiting_step=None if top is None else top + 1,
            laggards=laggards, calibrated=self._calibrated, reason=reason)
        return self._latched
