"""Hang detection from step progress (training-signal anomalies, NaN and loss jumps, are
`anomalies`).

Pure: every method takes the time explicitly (``t`` / ``now``, seconds on any clock the
caller uses consistently); nothing here sleeps, reads a clock or touches a process.

The controller feeds a :class:`HangWatch` per run:

* ``on_step(rank, step, t)`` when a rank reports a finished step through the SDK;
* ``on_activity(rank, t)`` when the agent sees a worker make progress without the SDK
  (its CPU time or its log file grew outside a collective, see :func:`stalwart.analyzer.activity.progressed`);
* ``on_collectives(rank, count, t)`` for a rank without the SDK: how many collectives it has
  entered (its flight recorder, sampled by the agent), when that grew;
* ``on_started(ranks, t)`` when a machine's agent has started its workers.

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

A rank's clock starts when its machine's agent reports its worker started, not when the run was
asked for: the agent may first wait for its fork server to import torch, which on a loaded machine
can outlast a short warm-up timeout. Until then the rank is the agent's
(it starts the worker or reports why not within ``policy.worker_start_s``), and it and the other
ranks without steps, which may be waiting for it, are judged on the warm-up timeout plus that
bound, from the run's start or their own (a report lost on the way leaves no rank unwatched).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

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
    start_t: float | None = None     # its worker started (None: not reported)


NO_STEP = -1                     # a rank's step or collective count before its first (None)


@dataclass
class HangWatch:
    """Per-run hang detector; see the module docstring for the timeout rules.

    policy: any object with ``hang_timeout_floor_s``, ``hang_safety_factor`` and
        ``hang_warmup_steps``, and optionally ``worker_start_s`` (0 without) (a
        :class:`stalwart.spec.Policy`).
    ranks: the ranks expected to report (the run's world); a listed rank that has never
        shown any progress counts from its worker's start, else from ``started_at``.  Ranks
        not listed are added when they first report.
    started_at: when the run was started (default: the first event seen).
    warmup_factor: the uncalibrated timeout is this times the floor (>= 1).
    window: recent intervals kept per rank for calibration (>= 1).

    Every rank's marks are held as arrays of one row per rank (its step and time, its reports, its
    activity, its collectives, whether it finished, and its recent intervals as a ring of
    ``window`` columns): one step of every rank (`on_steps`) is one write of whole columns, and a
    full look (`check`) one comparison over them, where a job of tens of thousands of ranks would
    otherwise loop over a record per rank at every report and tick. ``_state`` (rank -> its
    marks) and ``_recent`` (rank -> its recent intervals, oldest first) are the saved form,
    built from the arrays when read and read into them when given (a loaded state).
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
        given: dict[Any, Any] = self.__dict__.pop("_state", None) or {}
        recent: dict[Any, Any] = self.__dict__.pop("_recent", None) or {}
        self._n = 0                     # rows in use: row i holds rank self._rank_at[i]
        self._row: dict[int, int] = {}  # rank -> row
        self._ident = True              # row i holds rank i for every row (no lookups needed)
        self._alloc(0)
        self._longest: float | None = None      # the longest recent interval (None: not known)
        listed = self.ranks
        if isinstance(listed, range) and listed.start == 0 and listed.step == 1 and not given:
            self._add_first(len(listed))      # (a run's world: rows are its ranks)
        else:
            for r in sorted({_rank(r) for r in list(listed)} | {int(r) for r in given}):
                self._add(r)
        for r, st in given.items():          # a loaded state's marks
            if isinstance(st, dict):
                st = _RankState(**st)
            i = self._row[int(r)]
            self._step[i] = NO_STEP if st.step is None else st.step
            self._step_t[i] = math.nan if st.step_t is None else st.step_t
            self._reports[i] = st.reports
            self._act_t[i] = math.nan if st.activity_t is None else st.activity_t
            self._coll[i] = NO_STEP if st.coll is None else st.coll
            self._coll_t[i] = math.nan if st.coll_t is None else st.coll_t
            self._coll_marks[i] = st.coll_marks
            self._done[i] = st.done
            self._start_t[i] = math.nan if st.start_t is None else st.start_t
        for r, intervals in recent.items():
            row = self._row.get(int(r))
            at = self._add(int(r)) if row is None else row
            for x in list(intervals)[-self.window:]:
                self._push(at, float(x))
        self.ranks = tuple(self._rank_at[:self._n].tolist()) if self._ident else tuple(sorted(self._row))

    # ------------------------------------------------------------ the arrays
    def _alloc(self, cap: int) -> None:
        """Arrays of `cap` rows, the rows in use kept."""
        n, w = self._n, self.window
        old = self.__dict__.get("_step")

        def grown(name: str, fill: Any, dtype: Any, shape: tuple[int, ...] = ()) -> np.ndarray:
            arr = np.full((cap,) + shape, fill, dtype=dtype)
            if old is not None:
                arr[:n] = self.__dict__[name][:n]
            return arr

        self._rank_at = grown("_rank_at", -1, np.int64)
        self._step_t = grown("_step_t", math.nan, np.float64)
        self._reports = grown("_reports", 0, np.int64)
        self._act_t = grown("_act_t", math.nan, np.float64)
        self._coll = grown("_coll", NO_STEP, np.int64)
        self._coll_t = grown("_coll_t", math.nan, np.float64)
        self._coll_marks = grown("_coll_marks", 0, np.int64)
        self._done = grown("_done", False, np.bool_)
        self._start_t = grown("_start_t", math.nan, np.float64)
        self._rec = grown("_rec", math.nan, np.float64, (w,))     # ring of recent intervals
        self._nrec = grown("_nrec", 0, np.int64)                   # intervals pushed (ring position)
        self._step = grown("_step", NO_STEP, np.int64)

    def _add_first(self, count: int) -> None:
        """Ranks 0..count-1 into an empty watch, row i holding rank i."""
        self._alloc(count)
        self._rank_at[:count] = np.arange(count, dtype=np.int64)
        self._row = dict(zip(range(count), range(count)))
        self._n = count

    def _add(self, rank: int) -> int:
        """A row for a rank not seen before; its row."""
        i = self._n
        if i == len(self._step):
            self._alloc(max(16, 2 * i))
        self._rank_at[i] = rank
        self._row[rank] = i
        self._ident = self._ident and rank == i
        self._n = i + 1
        return i

    def _push(self, i: int, interval: float) -> None:
        """Row `i`'s new recent interval (the ring keeps the last `window`)."""
        self._rec[i, self._nrec[i] % self.window] = interval
        self._nrec[i] += 1
        self._longest = None

    def _marks(self, i: int) -> _RankState:
        step, coll = int(self._step[i]), int(self._coll[i])
        step_t, act_t, coll_t = float(self._step_t[i]), float(self._act_t[i]), float(self._coll_t[i])
        start_t = float(self._start_t[i])
        return _RankState(step=None if step == NO_STEP else step, step_t=None if math.isnan(step_t) else step_t,
                          reports=int(self._reports[i]), activity_t=None if math.isnan(act_t) else act_t,
                          coll=None if coll == NO_STEP else coll, coll_t=None if math.isnan(coll_t) else coll_t,
                          coll_marks=int(self._coll_marks[i]), done=bool(self._done[i]),
                          start_t=None if math.isnan(start_t) else start_t)

    def __getattr__(self, name: str) -> Any:
        """`_state` and `_recent`, built from the arrays: fields for the saved form, not kept as
        attributes, so every read (a save included) sees what the arrays hold."""
        if name == "_state":
            return {int(self._rank_at[i]): self._marks(i) for i in sorted(range(self._n),
                                                                         key=lambda i: int(self._rank_at[i]))}
        if name == "_recent":
            out: dict[int, list[float]] = {}
            w = self.window
            for i in np.nonzero(self._nrec[:self._n])[0].tolist():
                k = int(self._nrec[i])
                ring = self._rec[i].tolist()
                out[int(self._rank_at[i])] = ring[:k] if k <= w else ring[k % w:] + ring[:k % w]
            return dict(sorted(out.items()))
        raise AttributeError(name)

    # ------------------------------------------------------------------ events
    def _woken(self, t: float) -> None:
        """Progress was seen at `t`: a quiet period ends, and the first progress starts the clock."""
        self._quiet_until = None
        if self.started_at is None:
            self.started_at = t
            self._lower = None

    def _touch(self, rank: int, t: float) -> int:
        self._woken(t)
        i = self._row.get(rank)
        if i is None:
            i = self._add(rank)
            self.ranks = tuple(self._rank_at[:self._n].tolist()) if self._ident else tuple(sorted(self._row))
            self._lower = None
        return i

    def on_step(self, rank: int, step: int, t: float) -> None:
        """Rank ``rank`` finished ``step`` at time ``t``.

        A step not higher than the rank's last one is not progress and is ignored (an older
        report sent again after a reconnect among them, whatever its time); time running
        backwards for a rank's new step is refused.
        """
        rank, t = _rank(rank), _time("t", t)
        if type(step) is not int or step < 0:       # (an int subclass such as bool is refused)
            raise ValueError(f"step must be a non-negative integer (got {step!r})")
        i = self._row.get(rank)
        if i is not None and step <= self._step[i]:
            return
        self._advance(rank, self._touch(rank, t), step, t)

    def _advance(self, rank: int, i: int, step: int, t: float) -> None:
        """A known rank's new step `step` at `t` (progress: checked by the caller)."""
        last = float(self._step_t[i])
        if not math.isnan(last) and t < last:
            raise ValueError(f"rank {rank} reported step {step} at {t}, before its previous "
                             f"report at {last}")
        if not math.isnan(last):
            self._reports[i] += 1
            self._interval(i, int(self._reports[i]), t - last)
        else:
            self._first_mark(i, t)
            self._lower = None
        self._step[i], self._step_t[i] = step, t
        self._latched = None

    def on_steps(self, ranks: Sequence[int], step: int, t: float) -> None:
        """`on_step(rank, step, t)` for each rank in turn (one step that many ranks reported at
        once), with the checks of `step` and `t` made once and the known ranks' marks written as
        whole columns. A rank first seen, one listed twice or a malformed one takes the path of
        `on_step` rank by rank, as does a report older than some rank's last one (refused there,
        with the ranks before it taken)."""
        t = _time("t", t)
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative integer (got {step!r})")
        if not ranks:
            return
        rows = self._rows(ranks)
        if rows is None:
            for rank in ranks:
                self.on_step(rank, step, t)
            return
        sel = rows[self._step[rows] < step]
        if not len(sel):
            return
        last = self._step_t[sel]
        first = np.isnan(last)
        if (t < last[~first]).any():
            for rank in ranks:              # (raises at the first such rank, the ones before taken)
                self.on_step(rank, step, t)
            return
        self._woken(t)
        if first.any():
            # a first report's distance from its worker's start is a warm-up interval (`_advance`)
            assert self.started_at is not None
            starts = np.fmax(self._start_t[sel[first]], self.started_at)
            self._warmup_max = max(self._warmup_max, t - float(starts.min()))
            self._lower = None
        again = sel[~first]
        if len(again):
            gaps = t - last[~first]
            marks = self._reports[again] + 1
            self._reports[again] = marks
            cal = marks > self.policy.hang_warmup_steps
            if cal.any():
                on = again[cal]
                self._rec[on, self._nrec[on] % self.window] = gaps[cal]
                self._nrec[on] += 1
                self._longest = None
                if not self._calibrated:      # activity no longer counts: progress times may drop
                    self._lower = None
                self._calibrated = True
            if not cal.all():
                self._warmup_max = max(self._warmup_max, float(gaps[~cal].max()))
        self._step[sel] = step
        self._step_t[sel] = t
        self._latched = None

    def _rows(self, ranks: Sequence[int]) -> np.ndarray | None:
        """The rows of `ranks`, each a known rank listed once; None otherwise (or when one is no
        plain non-negative int)."""
        n = len(ranks)
        if isinstance(ranks, range):
            if ranks.step != 1 or ranks.start < 0:
                return None
            rows = np.arange(ranks.start, ranks.stop, dtype=np.int64)
            if not self._ident or ranks.stop > self._n:
                return None if self._ident else self._lookup(list(ranks))
            return rows
        if set(map(type, ranks)) != {int}:
            return None
        if self._ident and n == self._n and ranks == self.ranks:     # (every rank in order: a whole job's report)
            return np.arange(n, dtype=np.int64)
        if self._ident:
            try:
                rows = np.fromiter(ranks, dtype=np.int64, count=n)
            except OverflowError:
                return None
            if rows.min() < 0 or rows.max() >= self._n:
                return None
        else:
            found = self._lookup(ranks)
            if found is None:
                return None
            rows = found
        if n > 1:
            seen = np.zeros(self._n, dtype=np.bool_)        # (listed twice: fewer rows marked than listed)
            seen[rows] = True
            if int(np.count_nonzero(seen)) != n:
                return None
        return rows

    def _lookup(self, ranks: Sequence[int]) -> np.ndarray | None:
        row = self._row
        out = [row.get(r) for r in ranks]
        if None in out:
            return None
        return np.asarray(out, dtype=np.int64)

    def _interval(self, i: int, marks: int, interval: float) -> None:
        """One more interval between a rank's progress marks (steps, or collectives without the
        SDK): past the warm-up marks it calibrates the timeout."""
        if marks > self.policy.hang_warmup_steps:
            self._push(i, interval)
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
        i = self._touch(rank, t)
        coll, coll_t = int(self._coll[i]), float(self._coll_t[i])
        if self._step[i] != NO_STEP or (coll != NO_STEP and count <= coll) or \
                (not math.isnan(coll_t) and t < coll_t):
            return
        if not math.isnan(coll_t):
            self._coll_marks[i] += 1
            self._interval(i, int(self._coll_marks[i]), t - coll_t)
        else:
            self._first_mark(i, t)
        self._coll[i], self._coll_t[i] = count, t
        self._latched = None

    def on_activity(self, rank: int, t: float) -> None:
        """Rank ``rank`` showed progress other than a step report at ``t`` (CPU time or log
        growth, as judged by :func:`stalwart.analyzer.activity.progressed`)."""
        rank, t = _rank(rank), _time("t", t)
        i = self._touch(rank, t)
        act = float(self._act_t[i])
        if math.isnan(act) or t > act:
            self._act_t[i] = t
            if self._step[i] == NO_STEP or not self._calibrated:
                self._latched = None

    def on_started(self, ranks: Sequence[int], t: float) -> None:
        """The workers of ``ranks`` were started at ``t`` (their machine's agent says so): their
        clocks count from then, not from the run's start."""
        t = _time("t", t)
        for rank in ranks:
            i = self._touch(_rank(rank), t)
            start = float(self._start_t[i])
            if math.isnan(start) or t > start:
                self._start_t[i] = t
        self._lower = None
        self._latched = None

    def _first_mark(self, i: int, t: float) -> None:
        """Row `i`'s first step or collectives at `t`: the distance from its worker's start is a
        warm-up interval too."""
        start = self._start_of(i)
        if start is not None:
            self._warmup_max = max(self._warmup_max, t - start)

    def _start_of(self, i: int) -> float | None:
        """When row `i`'s worker started: its report, else the run's start (None: neither)."""
        start = float(self._start_t[i])
        if math.isnan(start):
            return self.started_at
        return start if self.started_at is None else max(start, self.started_at)

    def on_done(self, rank: int) -> None:
        """Rank ``rank``'s worker finished (exit 0): it makes no more progress and is never stalled;
        the ranks still running are judged on their own."""
        i = self._row.get(_rank(rank))
        if i is None or self._done[i]:
            return
        self._done[i] = True
        self._ending = True
        self._latched = None
        self._lower = self._quiet_until = None

    def done(self) -> list[int]:
        """The ranks whose worker finished."""
        return sorted(self._rank_at[:self._n][self._done[:self._n]].tolist())

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
        if self._longest is None:
            self._longest = float(np.nanmax(self._rec[:self._n]))
        return max(p.hang_timeout_floor_s, p.hang_safety_factor * self._longest)

    def _progress(self, warmup: float, current: float) -> tuple[np.ndarray, np.ndarray]:
        """(last progress time, nan where none; timeout that applies to it) of every row;
        `warmup` and `current` are `warmup_timeout()` and `timeout()`."""
        n = self._n
        nan = math.nan
        started = nan if self.started_at is None else self.started_at
        resumed = nan if self._resumed_at is None else self._resumed_at
        has_step = self._step[:n] != NO_STEP
        step_t, act_t = self._step_t[:n], self._act_t[:n]
        # a rank with steps: its step (and, before calibration or once some rank finished, what else
        # it does: no more steps come then), or the resume
        stepped = np.fmax(step_t, act_t) if not self._calibrated or self._ending else step_t
        stepped = np.fmax(stepped, resumed)
        # a rank without steps: its activity, its collectives, its worker's start (else the run's),
        # the resume
        start_t = self._start_t[:n]
        stepless = np.fmax(np.fmax(np.fmax(act_t, self._coll_t[:n]), np.fmax(start_t, started)), resumed)
        last = np.where(has_step, stepped, stepless)
        # a rank calibrated on its collectives is judged on the calibrated timeout
        calibrated_coll = (self._coll[:n] != NO_STEP) if self._calibrated else np.zeros(n, dtype=np.bool_)
        limit = np.where(has_step | calibrated_coll, current, warmup)
        grace = self._start_grace
        if grace > 0:
            # a worker not reported started that has shown nothing either is its agent's to start,
            # and the ranks without steps, judged together, may all be waiting for it
            unstarted = ~has_step & ~self._done[:n] & np.isnan(start_t) & np.isnan(act_t) & np.isnan(self._coll_t[:n])
            if unstarted.any():
                limit = np.where(has_step, limit, limit + grace)
        return last, limit

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
        n = self._n
        warmup, current = self.warmup_timeout(), self.timeout()
        last, limit = self._progress(warmup, current)
        running = ~self._done[:n]
        stepless = running & (self._step[:n] == NO_STEP)
        # step-less ranks are judged together (see the module docstring): the newest progress of any
        theirs = last[stepless]
        theirs = theirs[~np.isnan(theirs)]
        if len(theirs):
            last = np.where(stepless, theirs.max(), last)
        seen = running & ~np.isnan(last)
        self._lower = float(last[seen].min()) if seen.any() else None
        self._quiet_until = float((last[seen] + limit[seen]).min()) if seen.any() else None
        out = seen & (now - last > limit)
        if not out.any():
            return None
        order = np.argsort(self._rank_at[:n], kind="stable")
        rank_at = self._rank_at[:n]
        stalled = {int(rank_at[i]): float(last[i]) for i in order.tolist() if out[i]}
        has_step = self._step[:n] != NO_STEP
        last_step = {int(rank_at[i]): int(self._step[i]) for i in order.tolist() if has_step[i]}
        top = max(last_step.values()) if last_step else None
        laggards = [] if top is None else \
            [int(rank_at[i]) for i in order.tolist() if not has_step[i] or self._step[i] < top]
        since = min(stalled.values())
        timeout = float(limit[out].max())
        if top is None:
            what = ("no rank has reported a step" if not (self._coll[:n] != NO_STEP).any() else
                    "no rank entered a new collective or used CPU outside one")
        elif laggards:
            what = (f"ranks {laggards} never reported step {top} "
                    f"({n - len(laggards)} others did)")
        else:
            what = f"all ranks stopped after step {top}"
        reason = (f"{len(stalled)} of {n} ranks without progress for "
                  f"{now - since:.1f} s (timeout {timeout:.1f} s, "
                  f"{'calibrated' if self._calibrated else 'warm-up'}); {what}")
        self._latched = HangVerdict(
            detected_at=now, stalled_since=since, timeout_s=timeout, stalled=stalled,
            last_step=last_step, waiting_step=None if top is None else top + 1,
            laggards=laggards, calibrated=self._calibrated, reason=reason)
        return self._latched
