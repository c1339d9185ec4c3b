"""One run of the simulated job: where its steps stand at any time.

Steps are numbered globally (a resubmitted job goes on from its durable checkpoint). A run starts
stepping at `begins` (after the failover) at `pace` seconds per step; the pace can change (a slow
machine, a far standby) and the run can stop (`frozen`: a crash, a hang, a stop). Progress is
fractional, so a change of pace in the middle of a step is exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

EPS = 1e-9


@dataclass
class Training:
    run: int
    slots: list[str]
    start_step: int                 # the run's first step (global numbering)
    begins: float                   # workers step from this time on
    pace: float                     # seconds per step now
    anchors: list[tuple[float, float, float]] = field(default_factory=list)   # (t, steps done, pace)
    frozen: float | None = None     # no progress after this time
    reported: int = -1              # the last step reported to the job core
    reports: int = 0                # reports of this run's steps to the job core
    durable_reported: int = -1
    nan_from: float | None = None   # steps completing from this time on have a NaN loss
    version: int | None = None
    seg: int = 0                    # the job submission it belongs to (run numbers restart in each)

    def __post_init__(self) -> None:
        self.index = {m: i for i, m in enumerate(self.slots)}
        if not self.anchors:
            self.anchors = [(self.begins, 0.0, self.pace)]
        self.reported = max(self.reported, self.start_step - 1)

    # -- progress -------------------------------------------------------------------------------
    def progress(self, t: float) -> float:
        """Steps completed (fractional) by time t."""
        if self.frozen is not None:
            t = min(t, self.frozen)
        if t <= self.begins:
            return 0.0
        at, p, pace = self.anchors[0]
        for a in self.anchors[1:]:
            if a[0] > t:
                break
            at, p, pace = a
        return p + (t - at) / pace

    def last_done(self, t: float) -> int:
        """The last step completed by time t (start_step - 1: none yet)."""
        return self.start_step + int(math.floor(self.progress(t) + EPS)) - 1

    def done_at(self, step: int) -> float:
        """When `step` completed (`begins` for the step before the run's first)."""
        need = step - self.start_step + 1
        if need <= 0:
            return self.begins
        at, p, pace = self.anchors[0]
        for a in self.anchors[1:]:
            if a[1] > need + EPS:
                break
            at, p, pace = a
        return at + (need - p) * pace

    def set_pace(self, t: float, pace: float) -> None:
        if abs(pace - self.pace) < 1e-12:
            return
        if t <= self.begins:
            self.anchors = [(self.begins, 0.0, pace)]
        else:
            self.anchors.append((t, self.progress(t), pace))
        self.pace = pace

    def freeze(self, t: float) -> None:
        if self.frozen is None or t < self.frozen:
            self.frozen = max(t, self.begins)

    @property
    def stepping(self) -> bool:
        return self.frozen is None
