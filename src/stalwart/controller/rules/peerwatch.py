"""Peer-similarity watch (Minder-style, papers.md §2.1): per-machine metric samples in time
buckets, checked against the machine's peers with `analyzer.similarity`, a suspect only after it
stays the outlier for `continuity_s`.

Peers are the machines doing the same work: machines of one pipeline stage (a stage's first rank
decides). Stages compute different things (the last one also the loss), so comparing across
stages would name a healthy last stage; a stage needs at least 3 machines to have an outlier.
Pure apart from its own buffers: every method takes `now`/`t`.

The samples live in two arrays, a ring of `lookback` buckets per machine (bucket ids, and the
values with NaN where a metric is missing), written in place by `add` and read by one fancy index
per check. They are not part of the job's saved state: a 2,048-machine job's 240 s window is 3.4
million values, which a dict of rows carried into every save of the state (tens of MB of JSON)
and rebuilt at every check (seconds of CPU); after a controller restart the window fills again
while the continuity trackers, which are saved, keep their runs.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np

from stalwart.analyzer.similarity import Continuity, detect_aligned, fill_gaps

# Priority order (most fault-sensitive first): the first metric with an outlier decides a window.
METRICS = ("compute_s", "step_s", "gpu_clock", "gpu_temp", "cpu", "net_mbps", "rss_mb")
_COLUMN = {k: i for i, k in enumerate(METRICS)}
WINDOW = 8
# Live metrics carry noise that min-max normalization would stretch to full scale on a flat metric:
# a difference below this fraction of the metric's magnitude is never an outlier.
REL_FLOOR = 0.25
# buckets kept beyond the lookback: the current (incomplete) bucket and a little clock skew
# between the agents' sample times and the controller's
RING_SLACK = 8


class _Samples:
    """The ring of buckets of every watched machine: `ids[i, s]` is the bucket held in slot `s`
    of machine `i` (-1: none) and `vals[i, s]` its values in METRICS order."""

    def __init__(self, machines: list[str], size: int):
        self.index = {m: i for i, m in enumerate(machines)}
        self.size = size
        self.empty = True       # nothing was ever put: the arrays are made at the first row (a new
        # run's watch of a large job is tens of MB, and most runs see no metric row at all)

    def _make(self) -> None:
        self.ids = np.full((len(self.index), self.size), -1, dtype=np.int64)
        self.vals = np.full((len(self.index), self.size, len(METRICS)), np.nan)
        self.empty = False

    def put(self, i: int, bucket: int, values: Mapping[str, float]) -> None:
        if self.empty:
            self._make()
        s = bucket % self.size
        if self.ids[i, s] != bucket:
            if self.ids[i, s] > bucket:
                return                      # an older bucket than the slot holds: out of the window
            self.ids[i, s] = bucket
            self.vals[i, s] = np.nan
        row = self.vals[i, s]
        for k, v in values.items():
            col = _COLUMN.get(k)
            if col is not None and isinstance(v, (int, float)) and math.isfinite(v):
                row[col] = float(v)


    def put_columns(self, rows: np.ndarray, bucket: int, values: Mapping[str, np.ndarray]) -> None:
        """`put` for many machines (`rows`, distinct) at once, `values[k][i]` row i's metric k."""
        if self.empty:
            self._make()
        s = bucket % self.size
        held = self.ids[rows, s]
        keep = held <= bucket               # (an older bucket than the slot holds: out of the window)
        rows, fresh = rows[keep], held[keep] != bucket
        self.ids[rows[fresh], s] = bucket
        self.vals[rows[fresh], s] = np.nan
        for k, v in values.items():
            col = _COLUMN.get(k)
            if col is None:
                continue
            v = np.asarray(v, dtype=float)[keep]
            ok = np.isfinite(v)
            self.vals[rows[ok], s, col] = v[ok]


@dataclass
class PeerWatch:
    """The groups, the window and one continuity tracker per stage (plain data, saved with the
    job's state), and the samples (`_Samples`, kept in memory only)."""
    groups: list[list[str]]
    period_s: float
    lookback: int
    conts: list[Continuity]
    # rows before this time are ignored: a run's start (imports, first allocations, the first
    # steps) differs between machines for reasons that say nothing about their health; the job
    # runner creates the watch unstarted (None) and calls `start` after the warm-up steps
    since: float | None = None

    @classmethod
    def create(cls, peers: Sequence[Sequence[str]], period_s: float, lookback_s: float,
               continuity_s: float, not_before: float | None = -math.inf) -> "PeerWatch":
        """A watch over `peers` (groups of machines doing the same work; a group needs at least
        3 machines to have an outlier). `not_before` None (or inf): unstarted."""
        groups = [list(g) for g in peers if len(g) >= 3]
        return cls(groups=groups, period_s=period_s, lookback=max(WINDOW, int(lookback_s / period_s)),
                   conts=[Continuity(continuity_s=continuity_s, grace_s=max(10.0, 4 * period_s))
                          for _ in groups],
                   since=None if not_before is None or not_before == math.inf
                   else max(not_before, -sys.float_info.max))   # finite: the state is JSON

    def __post_init__(self) -> None:
        self._samples = _Samples([m for g in self.groups for m in g], self.lookback + RING_SLACK)
        # a group's machines are consecutive rows of the samples: its rows are a slice
        ends = np.cumsum([len(g) for g in self.groups]).tolist()
        self._rows = [slice(end - len(g), end) for g, end in zip(self.groups, ends)]

    @property
    def not_before(self) -> float:
        """Rows before this time are ignored (inf while unstarted)."""
        return math.inf if self.since is None else self.since

    def start(self, t: float) -> None:
        """Accept rows from time `t` on, unless already started."""
        if self.since is None:
            self.since = t

    def add(self, machine: str, t: float, values: Mapping[str, float]) -> None:
        """A metric row of `machine` at time `t` (later values of a bucket overwrite earlier)."""
        i = self._samples.index.get(machine)
        if i is None or t < self.not_before:
            return
        self._samples.put(i, int(t // self.period_s), values)

    def add_columns(self, machines: Sequence[str], t: float, values: Mapping[str, np.ndarray]) -> None:
        """`add` for many machines at once: `values[k][i]` is `machines[i]`'s metric k."""
        if t < self.not_before:
            return
        index = self._samples.index
        rows = np.asarray([index.get(m, -1) for m in machines], dtype=np.int64)
        at = np.flatnonzero(rows >= 0)
        if len(at) == 0:
            return
        self._samples.put_columns(rows[at], int(t // self.period_s),
                                  {k: np.asarray(v, dtype=float)[at] for k, v in values.items()})

    def check(self, now: float) -> tuple[Hashable | None, dict]:
        """The suspect (if any) after observing the latest complete bucket, and what was seen."""
        last = int(now // self.period_s) - 1
        first = last - self.lookback + 1
        seen: dict = {}
        for g, (machines, cont) in enumerate(zip(self.groups, self.conts)):
            candidate, detail = self._candidate(machines, self._rows[g], first, last)
            seen[g] = detail
            suspect = cont.observe(now, candidate)
            if suspect is not None:
                return suspect, {"group": machines, **detail}
        return None, seen

    def _candidate(self, machines: list[str], rows: slice, first: int, last: int) -> tuple[Hashable | None, dict]:
        sm = self._samples
        if sm.empty:            # every slot holds bucket -1 (none): only that bucket is "held"
            return None, {"samples": int(first <= -1 <= last)}
        buckets = np.arange(first, last + 1)
        slots = buckets % sm.size
        held = (sm.ids[rows, slots] == buckets).all(axis=0)     # buckets every machine has
        have = slots[held]
        if len(have) < WINDOW:
            return None, {"samples": int(len(have))}
        data = sm.vals[rows, have]                              # (machines, buckets, METRICS)
        shared = (~np.isnan(data)).any(axis=1).all(axis=0)      # each machine has it somewhere
        metrics = [k for k, ok in zip(METRICS, shared) if ok]
        if not metrics:
            return None, {"samples": int(len(have))}
        if not shared.all():
            data = data[:, :, shared]
        found = detect_aligned(machines, fill_gaps(data), now_index=len(have) - 1, window=WINDOW,
                               start_index=len(have) - 1, rel_floor=REL_FLOOR)
        if not found:
            return None, {"samples": int(len(have)), "metrics": metrics}
        _, machine, score = found[-1]
        return machine, {"samples": int(len(have)), "metrics": metrics, "candidate": machine,
                         "score": round(score, 3)}
