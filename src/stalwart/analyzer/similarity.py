"""Peer-similarity detection of a faulty machine (Minder-style, papers.md §2.1).

Under 3D parallelism the healthy machines of one job show near-identical
second-level metric patterns; a faulty machine is the one that stays dissimilar
to its peers (similarity) for minutes (continuity).  This module is pure numpy /
scipy: no model is trained (Minder's per-metric LSTM-VAE denoiser is replaced by
the raw min-max-normalized window).

Algorithm, per call of :func:`detect`:

1. align: every machine's array is cut to the shortest length and NaN gaps are
   filled with the nearest valid sample of the same machine and metric;
2. min-max normalize each metric across all machines over the data up to
   ``now_index``;
3. slide a window (default 8 samples); for each metric, in the order given
   (priority order, most fault-sensitive first), each machine's window is a
   vector, its score is the summed Euclidean distance to every other machine
   divided by the cluster size minus one (beyond 256 machines, the mean distance
   to 256 of them evenly spaced: :func:`window_scores`);
4. the machine with the maximal score is the window's candidate when that score
   is an outlier: ``z = (max - mean(rest)) / std(rest) > z_threshold`` (default
   3; ``std(rest)`` is floored at ``min_std`` so a perfectly flat peer set does
   not divide by zero) AND it stands clear of its peers in absolute terms:
   ``max - mean(rest) >= min_gap`` (default 0.2 in normalized units).  The z-score
   alone is not enough: among 8 machines carrying only sampling noise, the
   noisiest one has z > 3 in most windows.  The first metric (in priority order)
   that yields a candidate decides the window.

:class:`Continuity` then turns per-window candidates into a suspect only when the
same machine stays the candidate for ``continuity_s`` (Minder: 4 minutes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import numpy as np

DEFAULT_WINDOW = 8
DEFAULT_Z = 3.0
DEFAULT_CONTINUITY_S = 240.0
DEFAULT_MIN_GAP = 0.2
MAX_REFERENCES = 256        # peers a machine's score compares it with, at most (`window_scores`)


def _fill_nearest(col: np.ndarray) -> np.ndarray:
    """Fill NaNs in a 1-D array with the nearest valid sample (ties: earlier)."""
    valid = np.flatnonzero(~np.isnan(col))
    if valid.size == 0:
        return np.zeros_like(col)
    if valid.size == col.size:
        return col
    idx = np.arange(col.size)
    pos = np.clip(np.searchsorted(valid, idx), 1, max(valid.size - 1, 1))
    if valid.size == 1:
        return np.full_like(col, col[valid[0]])
    left, right = valid[pos - 1], valid[pos]
    nearest = np.where(idx - left <= right - idx, left, right)
    return col[nearest]


def align(series: Mapping[Hashable, np.ndarray], n_metrics: int) -> tuple[list, np.ndarray]:
    """Stack machines into one array of shape (machines, T, M), gaps filled.

    Raises ValueError on an empty input or an array of the wrong shape.
    """
    if len(series) < 3:
        raise ValueError(f"peer similarity needs at least 3 machines, got {len(series)}")
    machines = list(series)
    arrays = []
    for m in machines:
        a = np.asarray(series[m], dtype=float)
        if a.ndim != 2 or a.shape[1] != n_metrics:
            raise ValueError(f"machine {m!r}: expected shape (T, {n_metrics}), got {a.shape}")
        arrays.append(a)
    t = min(a.shape[0] for a in arrays)
    if t == 0:
        raise ValueError("peer similarity needs at least one sample per machine")
    return machines, fill_gaps(np.stack([a[:t] for a in arrays]))


def fill_gaps(data: np.ndarray) -> np.ndarray:
    """`data` (machines, T, M) with each NaN filled from the nearest valid sample of the same
    machine and metric (in place; returned)."""
    gaps = np.isnan(data).any(axis=1)          # (machine, metric) columns with a gap to fill
    for i, j in zip(*np.nonzero(gaps)):
        data[i, :, j] = _fill_nearest(data[i, :, j].copy())
    return data


def normalize(data: np.ndarray, rel_floor: float = 0.0) -> np.ndarray:
    """Min-max normalize each metric (last axis) across all machines and samples.

    With ``rel_floor`` the span is at least that fraction of the metric's largest magnitude, so
    sampling noise on a flat metric (45.0 to 45.9 degrees) is not stretched to the full scale.
    """
    lo = data.min(axis=(0, 1), keepdims=True)
    span = data.max(axis=(0, 1), keepdims=True) - lo
    if rel_floor > 0:
        span = np.maximum(span, rel_floor * np.abs(data).max(axis=(0, 1), keepdims=True))
    span[span == 0] = 1.0
    return (data - lo) / span


def reference_rows(n: int, max_refs: int = MAX_REFERENCES) -> np.ndarray | None:
    """The machines every machine is compared with in a group of `n`: None (all of them) up to
    `max_refs`, else `max_refs` machines evenly spaced through the group (see `window_scores`)."""
    if n <= max_refs:
        return None
    return np.unique(np.linspace(0, n - 1, max_refs).round().astype(np.int64))


def window_scores(windows: np.ndarray, max_refs: int = MAX_REFERENCES) -> np.ndarray:
    """Per-machine mean Euclidean distance to its peers: the summed distance divided by (N - 1).

    ``windows`` has shape (machines, window_len). Beyond ``max_refs`` machines the peers a machine
    is compared with are ``max_refs`` machines evenly spaced through the group (`reference_rows`;
    a reference is not compared with itself): the mean over them estimates the mean over all
    peers without bias, and all pairs would cost the square of the group. A healthy machine's
    score is a mean of hundreds of distances either way, so the estimate moves it by a small
    fraction of the spread between machines, and an outlier stays far off (the test
    `test_sampled_scores_find_the_outlier_of_a_large_group`). Measured on this host: 2,500 machines
    (a stage of a 100,000-GPU job) and 8 samples, all pairs 56 ms a window and metric, 256
    references 4.1 ms; 512 machines 1.6 ms and 0.6 ms.
    """
    from scipy.spatial.distance import cdist   # here: importing scipy slows the controller's start
    n = windows.shape[0]
    refs = reference_rows(n, max_refs)
    if refs is None:
        return cdist(windows, windows).sum(axis=1) / (n - 1)
    others = np.full(n, float(len(refs)))
    others[refs] -= 1.0                         # (a reference's distance to itself is 0)
    return cdist(windows, windows[refs]).sum(axis=1) / others


def outlier_z(scores: np.ndarray, min_std: float) -> tuple[int, float]:
    """Index of the max score and its z-score against the other machines."""
    top = int(np.argmax(scores))
    rest = np.delete(scores, top)
    std = max(float(rest.std()), min_std)
    return top, (float(scores[top]) - float(rest.mean())) / std


def all_window_scores(x: np.ndarray, window: int) -> np.ndarray:
    """:func:`window_scores` for every window of ``x`` (machines, T): shape (T-window+1, machines)."""
    w = np.lib.stride_tricks.sliding_window_view(x, window, axis=1)
    return np.stack([window_scores(w[:, i, :]) for i in range(w.shape[1])])


def detect(series: Mapping[Hashable, np.ndarray], metrics: Sequence[str], now_index: int,
           window: int = DEFAULT_WINDOW, z_threshold: float = DEFAULT_Z,
           min_std: float = 1e-3, min_gap: float = DEFAULT_MIN_GAP,
           start_index: int = 0, lookback: int | None = None,
           rel_floor: float = 0.0) -> list[tuple[int, Hashable, float]]:
    """Per-window candidates ``(t, machine, score)`` for windows ending at t <= now_index.

    ``series`` maps machine -> array (T, len(metrics)), one row per sample; ``t`` is
    the index of the window's last sample and ``score`` the candidate's distance
    score on the deciding metric.  Windows without a candidate are absent.  Only
    windows ending at ``t >= start_index`` are scored, and with ``lookback`` only
    the last ``lookback`` samples up to ``now_index`` are used (normalization
    included), like Minder's "last 15 minutes".
    """
    machines, data = align(series, len(metrics))
    return detect_aligned(machines, data, now_index, window, z_threshold, min_std, min_gap, start_index,
                          lookback, rel_floor)


def detect_aligned(machines: Sequence[Hashable], data: np.ndarray, now_index: int,
                   window: int = DEFAULT_WINDOW, z_threshold: float = DEFAULT_Z,
                   min_std: float = 1e-3, min_gap: float = DEFAULT_MIN_GAP,
                   start_index: int = 0, lookback: int | None = None,
                   rel_floor: float = 0.0) -> list[tuple[int, Hashable, float]]:
    """:func:`detect` over data already aligned (`align`: shape (machines, T, metrics), no gaps),
    machine i named ``machines[i]``."""
    if window < 2:
        raise ValueError(f"window must be at least 2 samples, got {window}")
    if lookback is not None and lookback < window:
        raise ValueError(f"lookback ({lookback}) must cover at least one window ({window})")
    if not 0 <= now_index < data.shape[1]:
        raise ValueError(f"now_index {now_index} outside the data (0..{data.shape[1] - 1})")
    first = 0 if lookback is None else max(0, now_index + 1 - lookback)
    data = normalize(data[:, first: now_index + 1, :], rel_floor)
    lo = max(window - 1, start_index - first)  # local index of the first window's end
    if lo >= data.shape[1]:
        return []
    n = len(machines)
    decided = np.full(data.shape[1] - lo, -1)
    score_of = np.zeros(data.shape[1] - lo)
    for j in range(data.shape[2]):
        open_ = decided < 0
        if not open_.any():
            break
        scores = all_window_scores(data[:, lo - window + 1:, j], window)
        top = scores.argmax(axis=1)
        top_val = scores[np.arange(len(top)), top]
        rest_mean = (scores.sum(axis=1) - top_val) / (n - 1)
        rest_var = ((scores ** 2).sum(axis=1) - top_val ** 2) / (n - 1) - rest_mean ** 2
        z = (top_val - rest_mean) / np.maximum(np.sqrt(np.maximum(rest_var, 0.0)), min_std)
        hit = open_ & (z > z_threshold) & (top_val - rest_mean >= min_gap)
        decided[hit] = top[hit]
        score_of[hit] = top_val[hit]
    return [(first + lo + i, machines[m], float(score_of[i]))
            for i, m in enumerate(decided) if m >= 0]


@dataclass
class Continuity:
    """Reports a machine that stays the candidate for ``continuity_s`` seconds.

    Feed it one observation per window with :meth:`observe`.  A run of one
    machine survives windows without any candidate for up to ``grace_s``
    seconds; another machine becoming the candidate, or a longer gap, ends it.
    """

    continuity_s: float = DEFAULT_CONTINUITY_S
    grace_s: float = 10.0
    machine: Hashable | None = field(default=None, init=False)
    since: float | None = field(default=None, init=False)
    last_seen: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.continuity_s <= 0:
            raise ValueError(f"continuity_s must be positive, got {self.continuity_s}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")

    def observe(self, now: float, candidate: Hashable | None) -> Hashable | None:
        """Record this window's candidate (or None); return the suspect, if any."""
        if self.last_seen is not None and now < self.last_seen:
            raise ValueError(f"observations must move forward in time ({now} < {self.last_seen})")
        if candidate is None:
            if self.last_seen is not None and now - self.last_seen > self.grace_s:
                self.machine = self.since = self.last_seen = None
            return self.suspect()
        if candidate != self.machine or self.last_seen is None or now - self.last_seen > self.grace_s:
            self.machine, self.since = candidate, now
        self.last_seen = now
        return self.suspect()

    def suspect(self) -> Hashable | None:
        """The machine whose candidacy has lasted ``continuity_s``, else None."""
        if self.machine is None or self.last_seen is None or self.since is None \
                or self.last_seen - self.since < self.continuity_s:
            return None
        return self.machine


def find_suspects(series: Mapping[Hashable, np.ndarray], metrics: Sequence[str],
                  now_index: int, period_s: float = 1.0,
                  continuity_s: float = DEFAULT_CONTINUITY_S, grace_s: float = 10.0,
                  window: int = DEFAULT_WINDOW,
                  z_threshold: float = DEFAULT_Z) -> list[tuple[int, Hashable]]:
    """Replay :func:`detect` through :class:`Continuity`: ``[(t, machine)]`` first reports.

    ``t`` is the sample index at which the machine first became a suspect;
    sample ``i`` is taken to be at ``i * period_s`` seconds.
    """
    by_t = {t: m for t, m, _ in detect(series, metrics, now_index, window, z_threshold)}
    cont = Continuity(continuity_s=continuity_s, grace_s=grace_s)
    reported: list[tuple[int, Hashable]] = []
    current = None
    for t in range(window - 1, now_index + 1):
        s = cont.observe(t * period_s, by_t.get(t))
        if s is not None and s != current:
            reported.append((t, s))
        current = s
    return reported
