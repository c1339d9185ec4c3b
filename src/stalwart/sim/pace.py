"""Training pace: how fast the simulated job steps, and what its progress looks like to the core.

A run steps at `cfg.step_s` seconds, stretched by the in-memory checkpoint's overhead, by the
worst placement penalty of its slots (a standby far from its pipeline's switch, `cluster.PENALTY`),
and by the model's slowdown while a slow machine is in the job. `Pace` computes that pace, keeps
the machines that are slow now, and turns a run's progress into what the job core and the ETTR
ledger read: the per-rank compute times of a step report (evidence for the slowdown detectors and
the what-if analysis), the `step` log records of the stretches the core was not told of one by
one, and the newest durable checkpoints of a stopped run. It also keeps the furthest step any run
completed (`max_step`: where a requeue resumes, and the job's throughput).

It reads the cluster's true labels and the job's placement groups through two functions passed in,
and nothing else of the simulation.
"""
from __future__ import annotations

import random
from typing import Callable

from stalwart import protocol as p
from stalwart.controller.cluster import placement
from stalwart.controller.job.events import AgentEvents
from stalwart.sim.cluster import PENALTY, job_labels
from stalwart.sim.config import Config
from stalwart.sim.training import Training

MEM_KEEP = 3              # steps kept one by one at the end of a stretch (restores from memory land there)


class Pace:
    def __init__(self, cfg: Config, dp: int, ckpt_every: int, seed: int, slowdown: float, overhead: Callable[[], float],
                 labels: Callable[[str], dict[str, str]], pipeline_slots: Callable[[int], list[int]]):
        self.cfg, self.dp, self.ckpt_every, self.seed = cfg, dp, ckpt_every, seed
        self.slowdown = slowdown            # a slow machine's step-time factor
        self.overhead = overhead            # the in-memory checkpoint's share of a step (0 without it), drawn now
        self.labels = labels                # a machine's true topology labels
        self.pipeline_slots = pipeline_slots  # the slots of a slot's pipeline
        self.penalty: dict[int, float] = {}   # slot -> the placement penalty of the machine in it
        self._penalties: dict[tuple[int, str], float] = {}
        self.slow: set[str] = set()           # machines computing slowly in the current run
        self.max_step = -1                    # the furthest step any run completed

    # -- the pace ---------------------------------------------------------------------------------
    def slot_penalty(self, slot: int, machine: str) -> float:
        """The step-time penalty of `machine` in `slot` (its distance from the slot's pipeline);
        a machine's labels never change, so each pair is computed once."""
        key = (slot, machine)
        got = self._penalties.get(key)
        if got is None:
            home = [job_labels(j, self.cfg.pp, self.dp) for j in self.pipeline_slots(slot)]
            got = self._penalties[key] = PENALTY[placement.distance(self.labels(machine), home)]
        return got

    def seat(self, slot: int, machine: str) -> None:
        """`machine` takes `slot` in the next run."""
        self.penalty[slot] = self.slot_penalty(slot, machine)

    def of(self, slots: list[str]) -> float:
        """Seconds per step of a run on `slots` now."""
        p_ = self.cfg.step_s * (1 + self.overhead())
        p_ *= 1 + max((self.penalty.get(i, 0.0) for i in range(len(slots))), default=0.0)
        if any(m in self.slow for m in slots):
            p_ *= self.slowdown
        return p_

    def repace(self, tr: Training | None, now: float) -> None:
        if tr is not None:
            tr.set_pace(now, self.of(tr.slots))

    def freeze(self, tr: Training | None, t: float) -> None:
        if tr is not None:
            self.max_step = max(self.max_step, tr.last_done(t))
            tr.freeze(t)

    # -- progress as the core and the ledger read it ----------------------------------------------
    def compute_times(self, tr: Training, dur: float) -> list[float] | None:
        """Per-rank compute seconds: reported while a machine is slow (evidence) and in what-if mode."""
        if not (self.slow or self.cfg.compute_times):
            return None
        rng = random.Random(hash((self.seed, tr.run, tr.reported)))
        base = dur / (self.slowdown if self.slow else 1.0) * 0.6
        out = []
        for i, m in enumerate(tr.slots):
            c = base * (1.15 if i // self.dp == self.cfg.pp - 1 else 1.0) * rng.lognormvariate(0.0, 0.02)
            out.append(c * (self.slowdown if m in self.slow else 1.0))
        return out

    def stretch(self, tr: Training, lo: int, hi: int, log: list[dict]) -> None:
        """Append to `log` the records of steps lo..hi, which the core was not told of one by one:
        one record per stretch, split at durable checkpoints and at the last `MEM_KEEP` steps."""
        if hi < lo:
            return
        ends = {hi} | set(range(max(lo, hi - MEM_KEEP + 1), hi + 1))
        first = lo + (self.ckpt_every - 1 - lo % self.ckpt_every) % self.ckpt_every
        ends |= set(range(first, hi + 1, self.ckpt_every))
        prev = lo - 1
        for e in sorted(ends):
            t0, t1 = tr.done_at(prev), tr.done_at(e)
            log.append({"t": t1, "kind": "step", "data": {
                "run": tr.run, "step": e, "dur": t1 - t0, "steps": e - prev, "sim": "stretch"}})
            prev = e

    def durable_reports(self, tr: Training, now: float, memory_ckpt: bool) -> list[AgentEvents]:
        """The newest durable checkpoints of stopped run `tr` not reported yet (one, two without
        memory copies), oldest first, as its agents reported them when written."""
        k = tr.last_done(now)
        d0 = k - (k + 1) % self.ckpt_every          # the newest durable checkpoint (after step d0)
        newest = [d for d in (d0, d0 - self.ckpt_every)[:1 if memory_ckpt else 2]
                  if d > tr.durable_reported and d >= tr.start_step - 1]
        out = []
        for d in reversed(newest):
            t_d, where = tr.done_at(d), f"durable/{d}"
            out.append(AgentEvents(items=tuple(
                (m, p.Ckpt(run=tr.run, rank=i, step=d, tier="durable", location=where, t=t_d))
                for i, m in enumerate(tr.slots))))
        if newest:
            tr.durable_reported = newest[0]
        return out
