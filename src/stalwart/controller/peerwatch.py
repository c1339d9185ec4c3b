"""Peer-similarity watch (Minder-style, papers.md §2.1): per-machine metric rows in time buckets,
checked against the machine's peers with `analyzer.similarity`, a suspect only after it stays the
outlier for `continuity_s`.

Peers are the machines doing the same work: machines of one pipeline stage (a stage's first rank
decides). Stages compute different things (the last one also the loss), so comparing across
stages would name a healthy last stage; a stage needs at least 3 machines to have an outlier.
Pure apart from its own buffers: every method takes `now`/`t`.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from stalwart.analyzer.similarity import Continuity, detect

# Priority order (most fault-sensitive first): the first metric with an outlier decides a window.
METRICS = ("compute_s", "step_s", "gpu_clock", "gpu_temp", "cpu", "net_mbps", "rss_mb")
WINDOW = 8
# Live metrics carry noise that min-max normalization would stretch to full scale on a flat metric:
# a difference below this fraction of the metric's magnitude is never an outlier.
REL_FLOOR = 0.25


class PeerWatch:
    def __init__(self, peers: Sequence[Sequence[str]], period_s: float, lookback_s: float,
                 continuity_s: float, not_before: float = -math.inf):
        self.groups = [list(g) for g in peers if len(g) >= 3]
        self.period_s = period_s
        self.lookback = max(WINDOW, int(lookback_s / period_s))
        self.rows: dict[str, dict[int, dict[str, float]]] = {m: {} for g in self.groups for m in g}
        self.conts = [Continuity(continuity_s=continuity_s, grace_s=max(10.0, 4 * period_s))
                      for _ in self.groups]
        # rows before this time are ignored: a run's start (imports, first allocations, the first
        # steps) differs between machines for reasons that say nothing about their health; the job
        # runner creates the watch with not_before=inf and calls `start` after the warm-up steps
        self.not_before = not_before

    def start(self, t: float) -> None:
        """Accept rows from time `t` on, unless already started."""
        if self.not_before == math.inf:
            self.not_before = t

    def add(self, machine: str, t: float, values: Mapping[str, float]) -> None:
        """A metric row of `machine` at time `t` (later values of a bucket overwrite earlier)."""
        if machine not in self.rows or t < self.not_before:
            return
        row = self.rows[machine].setdefault(int(t // self.period_s), {})
        for k, v in values.items():
            if k in METRICS and isinstance(v, (int, float)) and math.isfinite(v):
                row[k] = float(v)

    def check(self, now: float) -> tuple[str | None, dict]:
        """The suspect (if any) after observing the latest complete bucket, and what was seen."""
        last = int(now // self.period_s) - 1
        first = last - self.lookback + 1
        for m, rows in self.rows.items():          # keep only what the lookback needs
            for b in [b for b in rows if b < first]:
                del rows[b]
        seen: dict = {}
        for g, (machines, cont) in enumerate(zip(self.groups, self.conts)):
            candidate, detail = self._candidate(machines, first, last)
            seen[g] = detail
            suspect = cont.observe(now, candidate)
            if suspect is not None:
                return suspect, {"group": machines, **detail}
        return None, seen

    def _candidate(self, machines: list[str], first: int, last: int) -> tuple[str | None, dict]:
        buckets = range(first, last + 1)
        have = [b for b in buckets if all(b in self.rows[m] for m in machines)]
        if len(have) < WINDOW:
            return None, {"samples": len(have)}
        metrics = [k for k in METRICS if all(any(k in self.rows[m][b] for b in have) for m in machines)]
        if not metrics:
            return None, {"samples": len(have)}
        series = {m: np.array([[self.rows[m][b].get(k, np.nan) for k in metrics] for b in have])
                  for m in machines}
        found = detect(series, metrics, now_index=len(have) - 1, window=WINDOW,
                       start_index=len(have) - 1, rel_floor=REL_FLOOR)
        if not found:
            return None, {"samples": len(have), "metrics": metrics}
        _, machine, score = found[-1]
        return machine, {"samples": len(have), "metrics": metrics, "candidate": machine,
                         "score": round(score, 3)}
