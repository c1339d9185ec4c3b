"""Execution traces of collectives as windows of features, and a one-class model of healthy ones.

Every worker's flight-recorder hook (`worker/frhook.py`) sends, with its agent's activity events,
the collectives its rank entered: ``(kind, group, duration, bytes, gap since the previous one)``
(`protocol.TraceOp`; gloo records no duration, so there the gap carries the timing: a rank that
computes longer enters its next collective later, and its peers wait inside theirs). A rank's
window (a few seconds) becomes a few numbers per collective key (``kind@group description``),
each **relative to the rank's peers in the same window** (the ranks of its pipeline stage, which
run the same sequence):

- ``n:<key>``  how many it entered, log ratio to the peers' median count (a missing collective);
- ``g:<a>b>``  per transition (op b after op a), its mean log gap minus the peers' median (a slow
  compute, a late entry);
- ``d:<a>b>``  the same for durations, where they are recorded;
- ``order``    the L1 distance between its transitions (key -> next key) and the peers' median
  (a reordered sequence).

A job that slows down alike on every rank (a busy host, a slower data set) changes none of them.

A window in which a peer group entered no collective at all (a stall: too few operations for
features) is judged by a rule instead (`stall_laggards`): a rank whose newest collective is older
than its peers' newest, and that used no CPU outside a collective in the window, is stuck before the
collective its peers wait in (a hung stage, a stopped or frozen process, a rank blocked on I/O). A
rank that computes through the stall (a long evaluation on rank 0) is not; nor is a majority of the
group (then the odd ones are those ahead, not a culprit).

`DensityModel` learns, per feature, the median and a robust spread of these values over the job's
first healthy windows (every rank, every window), and the largest score seen then; a window's
score is its largest standardized deviation, and a rank whose score passes the threshold names the
features that did. Fitting is a median per feature; scoring a window is a few dictionary passes:
a 1,000-rank job's window scores in milliseconds on the controller's CPU. `bench/tracemodel.py`
compares it with a recurrent autoencoder (docs/trace-detector.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Iterable, Sequence

ORDER = "order"
MIN_SPREAD = {"n": 0.1, "g": 0.05, "d": 0.05, "o": 0.03}  # a spread never below (noise floors)
THRESHOLD_MARGIN = 1.5      # a window is abnormal past this many times the largest healthy score ...
MIN_THRESHOLD = 5.0         # ... and never below this many robust spreads
LOG_FLOOR_MS = 0.1          # timings are compared as log(ms + this): sub-0.1 ms jitter is no signal
MAX_KEYS = 64               # distinct collective keys a rank's window keeps (a bound on the state)
MIN_OPS = 8                 # a window with fewer collectives says nothing (a job slowed many times over)


def op_key(kind: str, desc: str) -> str:
    """The key of a collective across ranks: its kind and its group's description (not the group's
    name, which differs between, say, two data-parallel groups)."""
    return f"{kind}@{desc}" if desc else kind


@dataclass
class RankWindow:
    """One rank's collectives in the current window, as running sums (bounded: keys x 4 numbers)."""
    count: dict[str, int] = field(default_factory=dict)
    trans: dict[str, int] = field(default_factory=dict)          # "a>b" -> count
    gap: dict[str, float] = field(default_factory=dict)          # "a>b" -> sum of log gaps (ms)
    dur: dict[str, float] = field(default_factory=dict)          # "a>b" -> sum of log durations (ms)
    ndur: dict[str, int] = field(default_factory=dict)
    last: str | None = None
    groups: dict[str, str] = field(default_factory=dict)         # key -> a group name it ran in

    def add(self, key: str, group: str, dur_ms: float | None, gap_ms: float | None) -> None:
        if key not in self.count and len(self.count) >= MAX_KEYS:
            return
        self.count[key] = self.count.get(key, 0) + 1
        self.groups.setdefault(key, group)
        # timings are kept per transition (the op and the one before it): three all-reduces of one
        # step are told apart by what precedes them, so a slow bucket is not averaged away
        t = f"{self.last}>{key}" if self.last is not None else None
        self.last = key
        if t is None or (t not in self.trans and len(self.trans) >= MAX_KEYS * 2):
            return
        self.trans[t] = self.trans.get(t, 0) + 1
        if gap_ms is not None and gap_ms >= 0:
            self.gap[t] = self.gap.get(t, 0.0) + math.log(gap_ms + LOG_FLOOR_MS)
        if dur_ms is not None and dur_ms >= 0:
            self.dur[t] = self.dur.get(t, 0.0) + math.log(dur_ms + LOG_FLOOR_MS)
            self.ndur[t] = self.ndur.get(t, 0) + 1


def window_features(windows: dict[int, RankWindow], peers: Sequence[Sequence[int]]) -> dict[int, dict[str, float]]:
    """Each rank's peer-relative features for one window (module docstring). `peers` partitions
    the ranks into groups that run the same sequence; a rank alone in its group, or with fewer than
    MIN_OPS collectives in the window (its transition frequencies would be noise), gets none."""
    out: dict[int, dict[str, float]] = {}
    for group in peers:
        ranks = [r for r in group if r in windows and sum(windows[r].count.values()) >= MIN_OPS]
        if len(ranks) < 2:
            continue
        keys = sorted({k for r in ranks for k in windows[r].count})
        med_n = {k: median(windows[r].count.get(k, 0) for r in ranks) for k in keys}
        mean_g = {r: {t: w.gap[t] / w.trans[t] for t in w.gap} for r in ranks for w in [windows[r]]}
        mean_d = {r: {t: w.dur[t] / w.ndur[t] for t in w.dur if w.ndur.get(t)} for r in ranks for w in [windows[r]]}
        hist = {r: _normalized(windows[r].trans) for r in ranks}
        all_t = sorted({t for h in hist.values() for t in h})
        med_g = {t: median(vs) for t in all_t if len(vs := [mean_g[r][t] for r in ranks if t in mean_g[r]]) > 1}
        med_d = {t: median(vs) for t in all_t if len(vs := [mean_d[r][t] for r in ranks if t in mean_d[r]]) > 1}
        med_h = {t: median(hist[r].get(t, 0.0) for r in ranks) for t in all_t}
        for r in ranks:
            w, f = windows[r], dict[str, float]()
            for k in keys:
                f[f"n:{k}"] = math.log((w.count.get(k, 0) + 1) / (med_n[k] + 1))
            for t, x in mean_g[r].items():
                if t in med_g:
                    f[f"g:{t}"] = x - med_g[t]
            for t, x in mean_d[r].items():
                if t in med_d:
                    f[f"d:{t}"] = x - med_d[t]
            f[ORDER] = 0.5 * sum(abs(hist[r].get(t, 0.0) - med_h[t]) for t in all_t)
            out[r] = f
    return out


def stall_laggards(windows: dict[int, RankWindow], last_seq: dict[int, int], active: Iterable[int],
                   peers: Sequence[Sequence[int]], last_key: dict[int, str] | None = None) -> dict[int, int]:
    """Ranks stuck outside the collective their peers wait in (module docstring), each with how many
    collectives it is behind the newest of its group. A group is judged only when none of its ranks
    entered a collective in the window and at least two have entered one in the run; the recorders'
    ids (`TraceOp.seq`) count each process's collectives, so ranks that run the same sequence
    (`peers`) are compared by them. The ids of two ranks can differ by a constant (a rank that
    runs a collective more than its peers), so with `last_key` a rank whose newest collective is
    the one its peers wait in (it waits there too) is never named."""
    moving = set(active)
    out: dict[int, int] = {}
    for group in peers:
        known = [r for r in group if r in last_seq]
        if len(known) < 2 or any(sum(windows[r].count.values()) for r in group if r in windows):
            continue
        top = max(last_seq[r] for r in known)
        waited = {last_key[r] for r in known if last_seq[r] == top and r in last_key} if last_key else set()
        behind = [r for r in known if last_seq[r] < top and r not in moving
                  and not (last_key and last_key.get(r) in waited)]
        if behind and 2 * len(behind) <= len(known):
            out.update({r: top - last_seq[r] for r in behind})
    return out


def _normalized(counts: dict[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


def _spread_floor(feature: str) -> float:
    return MIN_SPREAD["o" if feature == ORDER else feature[0]]


@dataclass
class DensityModel:
    """Per feature, the healthy windows' median and robust spread (1.4826 x MAD, floored), and the
    threshold a window's score must pass (module docstring). Plain data: saved with the job."""
    center: dict[str, float] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)
    threshold: float = MIN_THRESHOLD
    windows: int = 0

    @classmethod
    def fit(cls, samples: dict[str, list[float]], windows: int = 0) -> "DensityModel":
        """The model of healthy `samples` (per feature, its values over ranks and windows): the
        threshold is THRESHOLD_MARGIN times the largest deviation among them, at least
        MIN_THRESHOLD."""
        m = cls(windows=windows)
        worst = 0.0
        for k, vs in samples.items():
            if not vs:
                continue
            c = median(vs)
            spread = max(1.4826 * median(abs(v - c) for v in vs), _spread_floor(k))
            m.center[k], m.spread[k] = c, spread
            worst = max(worst, max(abs(v - c) for v in vs) / spread)
        m.threshold = max(MIN_THRESHOLD, THRESHOLD_MARGIN * worst)
        return m

    @classmethod
    def fit_rows(cls, rows: Iterable[dict[str, float]]) -> "DensityModel":
        """The model of healthy windows' rows (every rank's features of every window)."""
        samples: dict[str, list[float]] = {}
        n = 0
        for row in rows:
            n += 1
            for k, v in row.items():
                samples.setdefault(k, []).append(v)
        return cls.fit(samples, windows=n)

    def deviations(self, row: dict[str, float]) -> dict[str, float]:
        """Each feature's standardized deviation; a feature never seen while healthy (a collective
        the job did not run then) is measured against 0 with its kind's noise floor."""
        return {k: abs(v - self.center.get(k, 0.0)) / self.spread.get(k, _spread_floor(k)) for k, v in row.items()}

    def score(self, row: dict[str, float]) -> tuple[float, list[str]]:
        """(the window's score, the features past the threshold, largest first)."""
        dev = self.deviations(row)
        if not dev:
            return 0.0, []
        worst = sorted(dev, key=dev.__getitem__, reverse=True)
        return dev[worst[0]], [k for k in worst if dev[k] > self.threshold]


def describe(features: list[str]) -> list[str]:
    """What abnormal features say, in words (for an alert)."""
    words = {"n": "count", "g": "entered late/early (gap)", "d": "duration"}
    out = []
    for f in features:
        if f == ORDER:
            out.append("collective order")
        else:
            out.append(f"{f[2:]} {words.get(f[0], f[0])}")
    return out


SAMPLES_MAX = 32            # healthy values kept per feature for the fit (thinned evenly)


@dataclass
class TraceWatch:
    """The trace detector's state for one job (saved with it): the open window of every rank, the
    healthy values learned so far (at most SAMPLES_MAX per feature: the state stays small), the
    model once fitted, and each rank's run of abnormal windows."""
    peers: list[list[int]]
    window_s: float
    train_s: float
    window_end: float = 0.0                   # 0: no trace yet (the window opens at the first)
    train_until: float = 0.0
    current: dict[int, RankWindow] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)           # values offered per feature
    stride: dict[str, int] = field(default_factory=dict)         # ... of which every stride-th is kept
    learned: int = 0                                             # windows learned from
    model: DensityModel | None = None
    streak: dict[int, int] = field(default_factory=dict)
    last_alert: dict[str, float] = field(default_factory=dict)      # machine -> when it was named
    windows_seen: int = 0
    busy_windows: int = 0                     # windows of this run with features (steady training)
    last_seq: dict[int, int] = field(default_factory=dict)       # rank -> its newest collective's id
    last_key: dict[int, str] = field(default_factory=dict)       # ... and key
    active: set[int] = field(default_factory=set)                # ranks that computed in this window
    stall_streak: dict[int, int] = field(default_factory=dict)

    def add(self, rank: int, key: str, group: str, dur_ms: float | None, gap_ms: float | None,
            seq: int | None = None) -> None:
        self.current.setdefault(rank, RankWindow()).add(key, group, dur_ms, gap_ms)
        if seq is not None:            # a rank's operations arrive in order
            self.last_seq[rank], self.last_key[rank] = seq, key

    def computed(self, ranks: Iterable[int]) -> None:
        """Ranks that used CPU outside a collective in this window (the agents' activity)."""
        self.active.update(ranks)

    def stalls(self) -> dict[int, int]:
        """The open window's stuck ranks (`stall_laggards`), before it is closed; none until the run
        trained steadily for a window."""
        if not self.busy_windows:
            return {}
        return stall_laggards(self.current, self.last_seq, self.active, self.peers, self.last_key)

    def start(self, now: float, warmup_s: float) -> None:
        """The first trace of a run: windows start now; a model not fitted yet learns from
        `warmup_s` on (the run's start-up is no healthy pace) for `train_s`."""
        self.window_end = now + self.window_s
        if self.model is None and not self.train_until:
            self.train_until = now + warmup_s + self.train_s

    def close(self, now: float) -> dict[int, dict[str, float]]:
        """Close the window: every rank's features."""
        closed, self.current = self.current, {}
        self.active = set()
        self.window_end = now + self.window_s
        self.windows_seen += 1
        feats = window_features(closed, self.peers)
        if feats:
            self.busy_windows += 1
        return feats

    def learn(self, feats: dict[int, dict[str, float]]) -> None:
        """Keep a healthy window's values: per feature every stride-th, the stride doubling (and
        the kept values thinned to every other) whenever SAMPLES_MAX would be passed."""
        self.learned += 1
        for row in feats.values():
            for k, v in row.items():
                n, stride = self.seen.get(k, 0), self.stride.get(k, 1)
                self.seen[k] = n + 1
                if n % stride:
                    continue
                kept = self.samples.setdefault(k, [])
                kept.append(v)
                if len(kept) > SAMPLES_MAX:
                    self.samples[k], self.stride[k] = kept[::2], stride * 2

    def fit(self) -> DensityModel:
        self.model = DensityModel.fit(self.samples, windows=self.learned)
        self.samples, self.seen, self.stride = {}, {}, {}
        return self.model
