"""ETTR ledger: effective training time ratio, rebuilt from a job's event log alone.

ETTR = productive time / wall time.  The wall interval [job_submitted, end] (end is
``job_finished`` or ``now``) is partitioned into disjoint labelled segments by a sweep
over every interval boundary.  Where intervals overlap, the label with the highest
priority wins:

1. ``productive``     - intervals of *kept* step executions;
2. ``lost_progress``  - intervals of step executions that a later run redid;
2b. ``control_plane`` - the controller's absence: from its predecessor's last sign of life to
                        the end of the new one's reconciliation (``control_plane_down`` and
                        ``control_plane_reconciled`` events); steps that went on meanwhile stay
                        productive;
3. incident phases    - ``detection`` / ``localization`` / ``failover`` (or ``hot_update``
                        for planned incidents); between two incidents the one *opened
                        earlier* wins, so when a second incident opens during the first
                        one's failover the overlap is charged to the first one;
4. ``startup``        - job_submitted -> start of the first step;
5. ``other``          - everything else (gaps between steps, idle time, ...).

An execution of step ``s`` is kept iff it is the last execution of ``s`` (the latest run
in run order; within one run, the last to complete).  Every other execution is lost.

Incident phases (all times clipped to the wall interval):

- detection: max(end of the last kept step ending at or before detection, injected_at)
  -> detected.  With no kept step yet, the start of the latest run started at or before
  detection (or job start) stands in for the last kept step.
- localization: detected -> localized; if never localized, -> start of the next run
  started at or after detection, or -> end when there is none.
- failover: (localized, or that next run start) -> start of the first kept step starting
  then or later, taken from a run started at or after detection (or from any run when no
  run started after detection: the incident was resolved in place); -> end if none
  (unresolved).  ``resumed_at`` is when that step completed.

Per-incident ``lost_progress`` is the lost time between the start of the run that was
running at detection (but not before the previous incident's attribution window) and
the start of the next run (or end); this includes steps that ran during localization
and were redone.  Lost time outside every such window counts in the bucket only.

Bucket totals add up exactly to wall - productive: the sweep runs on integer
nanoseconds relative to job start, and floats are produced only at the end.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass

BUCKETS = ("detection", "localization", "failover", "lost_progress", "control_plane", "hot_update", "startup",
           "other")
PHASES = ("detection", "localization", "failover")
PRODUCTIVE = "productive"
_LABELS = (PRODUCTIVE,) + BUCKETS
_NS = 1_000_000_000

# Priority keys of the sweep: smaller tuples win.
_K_PRODUCTIVE = (0,)
_K_LOST = (1,)
_K_CONTROL = (1, 1)
_K_STARTUP = (3,)


@dataclass
class Ledger:
    """ETTR accounting of one job up to ``end``; all durations in seconds."""

    wall_s: float
    productive_s: float
    ettr: float
    unproductive: dict[str, float]
    incidents: dict[int, dict]
    window_ettr: float
    steps_kept: int
    steps_lost: int

    def to_dict(self) -> dict:
        """Plain-data copy (JSON-serialisable; incident ids stay ints)."""
        return asdict(self)


@dataclass
class _Exec:
    run: int
    step: int
    lo: int
    hi: int
    order: tuple


@dataclass
class _Incident:
    ident: int
    index: int
    symptom: str
    planned: bool
    detected: int
    injected: int | None
    localized: int | None = None


class _Timeline:
    """Merged labelled segments with per-label prefix sums, for measures over [0, x]."""

    def __init__(self, segments: list[tuple[int, int, str]]):
        self.los = [s[0] for s in segments]
        self.segments = segments
        self.prefix: list[dict[str, int]] = []
        acc = dict.fromkeys(_LABELS, 0)
        for lo, hi, label in segments:
            self.prefix.append(dict(acc))
            acc[label] += hi - lo
        self.total = acc

    def upto(self, x: int) -> dict[str, int]:
        """Time per label in [0, x] (nanoseconds)."""
        i = bisect_right(self.los, x) - 1
        if i < 0:
            return dict.fromkeys(_LABELS, 0)
        out = dict(self.prefix[i])
        lo, hi, label = self.segments[i]
        out[label] += min(x, hi) - lo
        return out

    def between(self, a: int, b: int, label: str) -> int:
        """Time labelled ``label`` in [a, b] (nanoseconds)."""
        if b <= a:
            return 0
        return self.upto(b)[label] - self.upto(a)[label]


@dataclass
class _Built:
    t0: float
    wall: int
    timeline: _Timeline
    incidents: dict[int, dict]
    steps_kept: int
    steps_lost: int


def _num(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _int(data: dict, key: str, kind: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{kind} event needs an integer data[{key!r}], got {value!r}")
    return value


def _wall_bounds(events: list[dict], now: float) -> tuple[float, float]:
    """Validate the log's shape and return (start, end) in unix seconds."""
    now = _num(now, "now")
    start = finished = None
    prev = -math.inf
    for i, ev in enumerate(events):
        if not isinstance(ev, dict) or not isinstance(ev.get("kind"), str):
            raise ValueError(f"event #{i} must be a dict with a string 'kind', got {ev!r}")
        t = _num(ev.get("t"), f"event #{i} t")
        if t < prev:
            raise ValueError(f"events must be sorted by t: event #{i} ({t}) is before {prev}")
        prev = t
        if not isinstance(ev.get("data", {}), dict):
            raise ValueError(f"event #{i} data must be a dict, got {ev.get('data')!r}")
        if ev["kind"] == "job_submitted" and start is None:
            start = t
        elif ev["kind"] == "job_finished" and start is not None and finished is None:
            finished = t
    if start is None:
        raise ValueError("event log has no job_submitted event")
    if now < start:
        raise ValueError(f"now ({now}) is before job_submitted ({start})")
    end = finished if finished is not None and finished <= now else now
    return start, end


def _parse(events: list[dict], start: float, end: float):
    """Runs (id -> start ns), step executions, incidents and control-plane gaps (down -> back) from
    events in [start, end]."""
    rel = lambda t: round((t - start) * _NS)  # noqa: E731 - tiny local converter
    gaps: dict[float, list[int]] = {}
    run_start: dict[int, int] = {}
    run_rank: dict[int, int] = {}
    execs: list[_Exec] = []
    incidents: dict[int, _Incident] = {}
    for ev in events:
        t = float(ev["t"])
        if t > end:
            break
        kind, data = ev["kind"], ev.get("data") or {}
        if kind == "run_started":
            run = _int(data, "run", kind)
            run_rank.setdefault(run, len(run_rank))
            run_start.setdefault(run, rel(t))
        elif kind == "step":
            run, step = _int(data, "run", kind), _int(data, "step", kind)
            dur = _num(data.get("dur"), "step data['dur']")
            if dur < 0 or step < 0:
                raise ValueError(f"step event needs step >= 0 and dur >= 0, got {data!r}")
            run_rank.setdefault(run, len(run_rank))
            hi = rel(t)
            execs.append(_Exec(run, step, hi - round(dur * _NS), hi, (run_rank[run], hi, len(execs))))
        elif kind == "incident_opened":
            ident = _int(data, "incident", kind)
            if ident in incidents:
                raise ValueError(f"incident {ident} opened twice")
            inj = data.get("injected_at")
            injected = None if inj is None else rel(_num(inj, "incident_opened injected_at"))
            incidents[ident] = _Incident(ident, len(incidents), str(data.get("symptom", "")),
                                         bool(data.get("planned", False)), rel(t), injected)
        elif kind == "control_plane_down":
            down = _num(data.get("down_at"), "control_plane_down down_at")
            gaps[down] = [rel(down), rel(_num(data.get("up_at"), "control_plane_down up_at"))]
        elif kind == "control_plane_reconciled":
            down = _num(data.get("down_at"), "control_plane_reconciled down_at")
            if down in gaps:
                gaps[down][1] = max(gaps[down][1], rel(t))
        elif kind == "incident_localized":
            ident = _int(data, "incident", kind)
            if ident not in incidents:
                raise ValueError(f"incident_localized for unknown incident {ident}")
            if incidents[ident].localized is None:
                incidents[ident].localized = rel(t)
            inj = data.get("injected_at")   # the injection time is often known only by now
            if inj is not None and incidents[ident].injected is None:
                incidents[ident].injected = rel(_num(inj, "incident_localized injected_at"))
    return run_start, run_rank, execs, list(incidents.values()), [tuple(g) for g in gaps.values()]


def _split_kept(execs: list[_Exec]) -> tuple[list[_Exec], list[_Exec]]:
    best: dict[int, _Exec] = {}
    for ex in execs:
        if ex.step not in best or ex.order > best[ex.step].order:
            best[ex.step] = ex
    kept_ids = {id(ex) for ex in best.values()}
    kept = [ex for ex in execs if id(ex) in kept_ids]
    lost = [ex for ex in execs if id(ex) not in kept_ids]
    return kept, lost


def _first_kept_from(kept_by_lo: list[_Exec], kept_los: list[int], lo: int,
                     runs: set[int] | None) -> _Exec | None:
    """First kept execution starting at or after ``lo`` (from ``runs`` if given)."""
    i = bisect_left(kept_los, lo)
    for ex in kept_by_lo[i:]:
        if runs is None or ex.run in runs:
            return ex
    return None


def _phase_windows(inc: _Incident, wall: int, kept_by_lo: list[_Exec], kept_los: list[int],
                   kept_ends: list[int], run_start: dict[int, int]) -> tuple[list[tuple[int, int, int]], _Exec | None]:
    """[(lo, hi, phase_index)] of one incident and the step that resumed training."""
    d = inc.detected
    i = bisect_right(kept_ends, d) - 1
    if i >= 0:
        det_lo = kept_ends[i]
    else:
        earlier = [s for s in run_start.values() if s <= d]
        det_lo = max(earlier) if earlier else 0
    if inc.injected is not None:
        det_lo = max(det_lo, inc.injected)
    det_lo = max(0, min(det_lo, d))
    later_runs = {r for r, s in run_start.items() if s >= d}
    next_run = min((run_start[r] for r in later_runs), default=None)
    if inc.localized is not None:
        loc_hi = inc.localized
    else:
        loc_hi = next_run if next_run is not None else wall
    resume = _first_kept_from(kept_by_lo, kept_los, loc_hi, later_runs if later_runs else None)
    fail_hi = resume.lo if resume is not None else wall
    windows = [(det_lo, d, 0), (d, loc_hi, 1), (loc_hi, max(loc_hi, fail_hi), 2)]
    return windows, resume


def _sweep(intervals: list[tuple[int, int, tuple]], wall: int) -> list[tuple[int, int, tuple | None]]:
    """Partition [0, wall] into maximal segments labelled by the smallest active key."""
    points = []
    for lo, hi, key in intervals:
        lo, hi = max(lo, 0), min(hi, wall)
        if hi > lo:
            points.append((lo, 1, key))
            points.append((hi, -1, key))
    points.sort(key=lambda p: p[0])
    counts: dict[tuple, int] = {}
    heap: list[tuple] = []
    segments: list[tuple[int, int, tuple | None]] = []
    pos, i, n = 0, 0, len(points)
    while pos < wall:
        while i < n and points[i][0] <= pos:
            _, delta, key = points[i]
            counts[key] = counts.get(key, 0) + delta
            if delta > 0 and counts[key] == 1:
                heapq.heappush(heap, key)
            i += 1
        nxt = min(points[i][0], wall) if i < n else wall
        while heap and counts.get(heap[0], 0) == 0:
            heapq.heappop(heap)
        top: tuple | None = heap[0] if heap else None
        if segments and segments[-1][2] == top:
            segments[-1] = (segments[-1][0], nxt, top)
        else:
            segments.append((pos, nxt, top))
        pos = nxt
    return segments


def _build(events: list[dict], now: float) -> _Built:
    start, end = _wall_bounds(events, now)
    wall = round((end - start) * _NS)
    run_start, _, execs, incidents, gaps = _parse(events, start, end)
    kept, lost = _split_kept(execs)
    kept_by_lo = sorted(kept, key=lambda ex: (ex.lo, ex.hi))
    kept_los = [ex.lo for ex in kept_by_lo]
    kept_ends = sorted(ex.hi for ex in kept)

    intervals: list[tuple[int, int, tuple]] = [(ex.lo, ex.hi, _K_PRODUCTIVE) for ex in kept]
    intervals += [(ex.lo, ex.hi, _K_LOST) for ex in lost]
    intervals += [(lo, hi, _K_CONTROL) for lo, hi in gaps]
    first_step = min((ex.lo for ex in execs), default=wall)
    intervals.append((0, first_step, _K_STARTUP))
    resumes: dict[int, _Exec | None] = {}
    for inc in incidents:
        windows, resumes[inc.ident] = _phase_windows(inc, wall, kept_by_lo, kept_los, kept_ends,
                                                      run_start)
        intervals += [(lo, hi, (2, inc.index, phase)) for lo, hi, phase in windows]

    by_index = {inc.index: inc for inc in incidents}
    phase_ns: dict[tuple[int, int], int] = {}
    labelled = []
    for lo, hi, key in _sweep(intervals, wall):
        if key is None:
            label = "other"
        elif key == _K_PRODUCTIVE:
            label = PRODUCTIVE
        elif key == _K_LOST:
            label = "lost_progress"
        elif key == _K_CONTROL:
            label = "control_plane"
        elif key == _K_STARTUP:
            label = "startup"
        else:
            inc = by_index[key[1]]
            label = "hot_update" if inc.planned else PHASES[key[2]]
            phase_ns[key[1:]] = phase_ns.get(key[1:], 0) + hi - lo
        labelled.append((lo, hi, label))
    timeline = _Timeline(labelled)

    report: dict[int, dict] = {}
    run_starts = sorted(run_start.values())
    prev_hi = 0
    for inc in incidents:
        j = bisect_right(run_starts, inc.detected) - 1
        lo = max(run_starts[j] if j >= 0 else 0, prev_hi)
        k = bisect_left(run_starts, inc.detected)
        hi = max(lo, run_starts[k] if k < len(run_starts) else wall)
        prev_hi = hi
        phases = {p: phase_ns.get((inc.index, n), 0) / _NS for n, p in enumerate(PHASES)}
        resume = resumes[inc.ident]
        report[inc.ident] = {
            "symptom": inc.symptom,
            "planned": inc.planned,
            "detection": 0.0 if inc.planned else phases["detection"],
            "localization": 0.0 if inc.planned else phases["localization"],
            "failover": 0.0 if inc.planned else phases["failover"],
            "hot_update": sum(phases.values()) if inc.planned else 0.0,
            "lost_progress": timeline.between(lo, hi, "lost_progress") / _NS,
            "injected_at": None if inc.injected is None else inc.injected / _NS,
            "detected_at": inc.detected / _NS,
            "localized_at": None if inc.localized is None else inc.localized / _NS,
            "resumed_at": None if resume is None else resume.hi / _NS,
        }
    return _Built(start, wall, timeline, report, len(kept), len(lost))


def _ratio(num: int, den: int) -> float:
    return num / den if den > 0 else 0.0


def _check_window(window_s: float) -> int:
    window_s = _num(window_s, "window_s")
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    return round(window_s * _NS)


def compute(events: list[dict], now: float, window_s: float = 3600.0) -> Ledger:
    """Rebuild the ETTR ledger of one job from its event log, as of ``now``.

    ``events`` are ``{"t", "kind", "data"}`` dicts sorted by ``t``; the wall interval runs
    from ``job_submitted`` to ``job_finished`` (or ``now``; events after ``now`` are
    ignored).  ETTR is 0.0 for a zero-length wall.  ``window_ettr`` covers the last
    ``window_s`` seconds ending at the end (clipped to job start).  ``incidents`` maps an
    incident id to {symptom, planned, detection, localization, failover, hot_update,
    lost_progress, injected_at, detected_at, localized_at, resumed_at}; the *_at fields
    are seconds since job start (None when unknown).  Raises ValueError on a malformed or
    unsorted log.
    """
    win = _check_window(window_s)
    built = _build(events, now)
    total = built.timeline.total
    w_lo = max(0, built.wall - win)
    return Ledger(
        wall_s=built.wall / _NS,
        productive_s=total[PRODUCTIVE] / _NS,
        ettr=_ratio(total[PRODUCTIVE], built.wall),
        unproductive={b: total[b] / _NS for b in BUCKETS},
        incidents=built.incidents,
        window_ettr=_ratio(built.timeline.between(w_lo, built.wall, PRODUCTIVE), built.wall - w_lo),
        steps_kept=built.steps_kept,
        steps_lost=built.steps_lost,
    )


def series(events: list[dict], now: float, points: int = 50, window_s: float = 3600.0) -> list[dict]:
    """Cumulative and sliding-window ETTR at ``points`` evenly spaced times (for plots).

    Point k (1..points) sits at job start + k/points of the wall interval.  Each point is
    ``{"t", "elapsed_s", "ettr", "window_ettr", "productive_s", "unproductive"}``.  The
    labelling is the one known at the end (hindsight): a step later redone counts as lost
    progress at every point, so the curve never has to be revised.
    """
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise ValueError(f"points must be an integer >= 1, got {points!r}")
    win = _check_window(window_s)
    built = _build(events, now)
    out = []
    for k in range(1, points + 1):
        x = built.wall * k // points
        upto = built.timeline.upto(x)
        w_lo = max(0, x - win)
        out.append({
            "t": built.t0 + x / _NS,
            "elapsed_s": x / _NS,
            "ettr": _ratio(upto[PRODUCTIVE], x),
            "window_ettr": _ratio(built.timeline.between(w_lo, x, PRODUCTIVE), x - w_lo),
            "productive_s": upto[PRODUCTIVE] / _NS,
            "unproductive": {b: upto[b] / _NS for b in BUCKETS},
        })
    return out


def productive_upto(events: list[dict], now: float, times: list[float]) -> list[float]:
    """Productive seconds from the job's start up to each of ``times`` (seconds since the start,
    clipped to the wall interval), with the end's hindsight labelling as in :func:`series`."""
    built = _build(events, now)
    out = []
    for x in times:
        ns = min(max(0, round(float(x) * _NS)), built.wall)
        out.append(built.timeline.upto(ns)[PRODUCTIVE] / _NS)
    return out
