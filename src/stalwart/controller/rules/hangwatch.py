"""Hang detection from step progress, and training-signal anomalies (NaN, loss jumps).

Pure: every method takes the time explicitly (``t`` / ``now``, seconds on any clock the
caller uses consistently); nothing here sleeps, reads a clock or touches a process.

The controller feeds a :class:`HangWatch` per run:

* ``on_step(rank, step, t)`` when a rank reports a finished step through the SDK;
* ``on_activity(rank, t)`` when the agent sees a worker make progress without the SDK
  (its CPU time or its log file grew outside a collective, see :func:`stalwart.analyzer.activity.progressed`);
* ``on_collectives(rank, count, t)`` for a rank without the SDK: how many collectives it has
  entered (its flight recorder, sampled by the agent), when that grew.

and calls ``check(now)`` periodically (every second is enough to fire within
``timeout + 1 s`` of the last progress).

Timeout (auto-calibrated, ByteRobust "no step progress past an auto-calibrated timeout"):

* **calibrated** once some rank has reported more than ``policy.hang_warmup_steps`` steps:
  ``max(hang_timeout_floor_s, hang_safety_factor * max(recent step intervals))``, where
  the recent intervals are the last ``window`` report-to-report intervals of every rank
  after its warm-up steps (compile and first-batch steps do not inflate it);
* **before calibration** a generous default, ``max(warmup_factor * floor,
  safety_factor * longest interval seen so far)`` with ``warmup_factor`` 10 (100 s with
  the default 10 s floor), because the first steps include compilation and data-loader
  start-up whose length nobody knows yet.  During warm-up, agent activity (CPU time or
  log growth) also counts as progress, so a job whose first step legitimately takes 10
  minutes is not declared hung while it computes; after calibration only step reports
  count for ranks that report steps (a rank spinning in a stuck NCCL collective burns CPU
  and would otherwise never be declared hung).

Ranks that never report a step (a plain torchrun script without the SDK) have no steps to
calibrate on: their collectives stand in for steps. Once such a rank has entered new collectives
more than ``hang_warmup_steps`` times, the intervals between those marks calibrate the timeout
exactly as step intervals do; without a flight recorder (no marks) the uncalibrated timeout stays.
Their activity counts at all times, because the agent counts CPU time only outside a collective (a
rank spinning inside a stuck one shows no progress, see
:func:`stalwart.analyzer.activity.progressed`). And they are judged together: a rank waiting
inside a collective may be waiting for another rank that computes, so step-less ranks are stalled
only when none of them has progressed within the timeout (a data-parallel job stops as a whole
when one rank stops; which rank it was is the flight recorder's and the stacks' business, not
this timer's).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from stalwart.spec import Policy

DEFAULT_WARMUP_FACTOR = 10.0
DEFAULT_WINDOW = 20


def _time(name: str, t: Any) -> float:
    if type(t) is float and math.isfinite(t):        # the common case, checked first (per rank, per step)
        return t
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError(f"{name} must be a finite number of seconds (got {t!r})")
    return float(t)


def _rank(rank: Any) -> int:
    if type(rank) is int and rank >= 0:
        return rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer (got {rank!r})")
    return rank


@dataclass(frozen=True)
class HangVerdict:
    """A detected hang.

    detected_at: ``now`` of the first ``check`` that saw it (stable until progress resumes).
    stalled_since: the oldest last-progress time among the stalled ranks.
    timeout_s: the timeout in force when it was detected.
    stalled: rank -> time of its last progress, for every rank silent past the timeout.
    last_step: rank -> last reported step (ranks that never reported are absent).
    waiting_step: the step the leading ranks are in (highest reported + 1), None without steps.
    laggards: ranks that never reported the highest step some other rank reported (or never
        reported at all while others did): the candidates for what the others wait on.
    calibrated: whether the timeout came from observed step times.
    reason: one human line.
    """

    detected_at: float
    stalled_since: float
    timeout_s: float
    stalled: dict[int, float]
    last_step: dict[int, int]
    waiting_step: int | None
    laggards: list[int]
    calibrated: bool
    reason: str

    def as_dict(self) -> dict:
        """Plain-data form (JSON-ready)."""
        return {"detected_at": self.detected_at, "stalled_since": self.stalled_since,
                "timeout_s": self.timeout_s, "stalled": dict(self.stalled),
                "last_step": dict(self.last_step), "waiting_step": self.waiting_step,
                "laggards": list(self.laggards), "calibrated": self.calibrated,
                "reason": self.reason}


@dataclass
class _RankState:
    step: int | None = None
    step_t: float | None = None
    reports: int = 0
    activity_t: float | None = None
    coll: int | None = None          # collectives entered (ranks without the SDK)
    coll_t: float | None = None
    coll_marks: int = 0
    done: bool = False               # its worker exited 0: never stalled again


@dataclass
class HangWatch:
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
            # the first report's distance from the start is a warm-up interval too
            if self.started_at is not None:
                self._warmup_max = max(self._warmup_max, t - self.started_at)
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
        elif self.started_at is not None:
            self._warmup_max = max(self._warmup_max, t - self.started_at)
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
            times = [x for x in (st.activity_t, st.coll_t, self.started_at, self._resumed_at) if x is not None]
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


# -------------------------------------------------------------------- anomalies
def _finite_values(name: str, values: Sequence[Any]) -> list[float]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must hold numbers (got {v!r})")
        out.append(float(v))
    return out


def _jump(name: str, history: list[float], factor: float, window: int, min_history: int) -> str | None:
    latest = history[-1]
    if not math.isfinite(latest):
        return f"{name} is {latest} at the latest step"
    base = [v for v in history[-1 - window:-1] if math.isfinite(v)]
    if len(base) < min_history:
        return None
    median = statistics.median(base)
    if median > 0 and latest >= factor * median:
        return (f"{name} jumped to {latest:.4g}, {latest / median:.1f}x the median {median:.4g} "
                f"of the last {len(base)} steps (threshold {factor:g}x)")
    return None


def anomaly(loss_history: Sequence[float], grad_norm: Sequence[float] | float | None = None,
            factor: float = 5.0, window: int = DEFAULT_WINDOW, min_history: int = 3) -> str | None:
    """Reason string when the latest loss or grad norm is NaN/inf or jumped, else None.

    ``loss_history`` and ``grad_norm`` (a history, or just the latest value) end with the
    latest step.  A jump is ``latest >= factor * median`` of up to ``window`` previous
    finite values, checked once ``min_history`` of them exist (papers.md: >= 5x or NaN).
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"factor must be > 1 (got {factor!r})")
    losses = _finite_values("loss_history", loss_history)
    if grad_norm is None:
        grads: list[float] = []
    elif isinstance(grad_norm, (int, float)) and not isinstance(grad_norm, bool):
        grads = [float(grad_norm)]
    else:
        grads = _finite_values("grad_norm", grad_norm)  # type: ignore[arg-type]  # a bool is refused there
    for name, hist in (("loss", losses), ("grad norm", grads)):
        if hist:
            why = _jump(name, hist, factor, window, min_history)
            if why:
                return why
    return None


def nan_culprits(local_grad_norms: Mapping[int, float]) -> list[int]:
    """Ranks whose LOCAL grad norm (before the data-parallel reduction) is NaN or inf.

    After the all-reduce every rank sees the same non-finite global norm; the local norms
    tell which rank produced it.  Map them to machines with :func:`culprit_machines`.
    """
    out = []
    for rank, norm in local_grad_norms.items():
        _rank(rank)
        if isinstance(norm, bool) or not isinstance(norm, (int, float)):
            raise ValueError(f"grad norm of rank {rank} must be a number (got {norm!r})")
        if not math.isfinite(norm):
            out.append(rank)
    return sorted(out)


def culprit_machines(local_grad_norms: Mapping[int, float], topo: Any) -> list[int]:
    """Machine indices (topology) holding the ranks named by :func:`nan_culprits`."""
    return topo.machines_of(nan_culprits(local_grad_norms))
