"""The failure model: which incidents hit a long job, when, and what they look like.

From the paper (papers.md §1.2, §1.7, §1.9):

- **explicit** incidents arrive at `daily_rate` per machine per day (0.12%: the rate behind Table
  5's P99 standby counts; 1,200 machines x 90 days gives ~130, Table 4's dense job had 128) and
  split by Table 1's explicit counts (CUDA error 36%, CPU overload, CPU OOM, disk space, ...);
- **implicit** ones (hang, MFU decline, NaN) come at Table 1's ratio to the explicit ones
  (6,096 : 39,687) and split by its counts;
- **code/data adjustments** (manual restarts) at Table 4's rate for the dense job (20 hot updates
  in 3 months), `urgent_share` of them urgent (not in the paper: an assumption), and
  `faulty_update_share` of them with a bug the rollback must undo (Table 4: 12 rollbacks for 20
  updates);
- `multi_machine_share` of explicit incidents take down every machine under one switch (Table 5's
  "catastrophic" switch case, rare); `ambiguous_share` of the machine faults that a probe could
  name show only an ambiguous crash (an illegal memory access, an NCCL error), so stop-time checks
  must find the machine; `sdc_share` of NaNs come from silent data corruption on a machine
  (Table 2: 3 of 4 NaNs were infrastructure), the others from the data (once);
- a category's `transient` share does not stay with the machine (a flapping link, a full page
  cache, a storage glitch): a reattempt fixes it. A persistent fault comes back after each restart
  while its machine stays in the job (at once for dead hardware, after `recur_mean_s` on average
  for intermittent faults), until the machine is evicted.

A trace is drawn once per seed and replayed unchanged under every policy; every fault carries its
own random seed, so the draws made about it (does the check catch it, when does it come back) are
the same under every policy that asks.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

DAY = 86400.0


@dataclass(frozen=True)
class Category:
    key: str
    label: str            # Table 1's symptom
    count: int            # Table 1's count
    stream: str           # explicit | implicit | manual
    kind: str             # how it shows (see Fault.kind)
    transient: float      # share that a reattempt fixes


# Table 1 (778,135 jobs, three months); kinds and transient shares are this model's reading of them
TABLE1 = (
    Category("cuda_error", "CUDA error", 19968, "explicit", "gpu", 0.2),
    Category("cpu_overload", "CPU overload", 6095, "explicit", "crash", 1.0),
    Category("cpu_oom", "CPU OOM", 5567, "explicit", "oom", 1.0),
    Category("disk_space", "Insufficient disk space", 2755, "explicit", "disk", 0.0),
    Category("infiniband", "InfiniBand error", 1599, "explicit", "network", 0.5),
    Category("filesystem", "Filesystem mount", 1176, "explicit", "io", 1.0),
    Category("hdfs", "HDFS error", 1104, "explicit", "io", 1.0),
    Category("container", "Container error", 781, "explicit", "lost", 0.0),
    Category("kernel_panic", "OS kernel panic", 203, "explicit", "kernel", 0.0),
    Category("gpu_memory", "GPU memory error", 188, "explicit", "ecc", 0.0),
    Category("external", "External service error", 128, "explicit", "io", 1.0),
    Category("gpu_unavailable", "GPU unavailable", 76, "explicit", "gpu_lost", 0.0),
    Category("disk_fault", "Disk fault", 47, "explicit", "disk", 0.0),
    Category("hang", "Job hang", 5506, "implicit", "hang", 0.3),
    Category("mfu_decline", "MFU decline", 442, "implicit", "slow", 0.0),
    Category("nan", "NaN value", 148, "implicit", "nan", 0.0),
    Category("update", "Code/data adjustment", 9582, "manual", "update", 0.0),
)
BY_KEY = {c.key: c for c in TABLE1}
# faults whose hardware is dead: they come back at once when their machine is restarted
HARD = ("gpu_lost", "ecc", "disk", "lost", "kernel")


@dataclass
class Model:
    """The failure model's knobs (`stalwart sim --set KEY=VALUE` overrides any of them)."""
    daily_rate: float = 0.0012          # explicit incidents per machine per day
    implicit_ratio: float = 6096 / 39687
    updates_per_day: float = 20 / 90    # Table 4, dense job: 20 hot updates in ~3 months
    urgent_share: float = 0.25
    faulty_update_share: float = 12 / 20
    multi_machine_share: float = 0.02
    ambiguous_share: float = 0.3
    sdc_share: float = 0.75
    recur_mean_s: float = 900.0
    slowdown: float = 1.5               # an MFU decline makes the job's steps this much slower
    sources: dict[str, str] = field(default_factory=lambda: {
        "daily_rate": "Table 5's P99 standby counts imply 0.118-0.124% per machine per day",
        "implicit_ratio": "Table 1: 6,096 implicit vs 39,687 explicit incidents",
        "updates_per_day": "Table 4: 20 code/data adjustments (hot updates) in the dense job's ~3 months",
        "urgent_share": "assumption (the paper gives no split between urgent and lazy updates)",
        "faulty_update_share": "Table 4: 12 incidents resolved by rollback for 20 hot updates (dense job)",
        "multi_machine_share": "assumption: Table 5 weighs a switch failure at < 1%; here 2% of explicit incidents",
        "ambiguous_share": "assumption: machine faults no probe names (Table 2: 21 of 62 illegal memory accesses "
                           "were infrastructure); found by stop-time checks",
        "sdc_share": "Table 2: 3 of 4 NaN values had an infrastructure cause",
        "recur_mean_s": "assumption: an intermittent machine fault comes back ~15 min after a restart",
        "slowdown": "assumption: a degraded machine (MFU decline) slows every step by 1.5x",
    })

    def set(self, key: str, value: str) -> None:
        names = [f.name for f in dataclasses.fields(self) if f.name != "sources"]
        if key not in names:
            raise ValueError(f"unknown failure-model key {key!r} (known: {', '.join(names)})")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"--set {key}: {value!r} is not a number") from None
        if v < 0 or (key.endswith("share") and v > 1):
            raise ValueError(f"--set {key}: {v} is out of range")
        setattr(self, key, v)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}


@dataclass(frozen=True)
class Fault:
    """One incident of the trace.

    kind: gpu (a CUDA error; certain unless ambiguous), ecc, gpu_lost, disk, network, lost
    (the machine's agent and workers vanish), kernel (panic), crash, oom, io (an exception from a
    library), hang, slow, nan, update.
    slot: the job slot it hits (the machine there at that time); switch: for a multi-machine
    incident, every job machine under that switch.
    """
    t: float
    category: str
    kind: str
    slot: int
    persistent: bool
    ambiguous: bool = False
    switch: str | None = None
    urgent: bool = False
    bug: str | None = None          # a faulty update's symptom: hang | nan | exception
    seed: int = 0

    @property
    def hard(self) -> bool:
        """Broken hardware that health checks and a scheduler's node checks see (and that fails
        again at once when its machine restarts)."""
        return self.kind in HARD or (self.kind in ("gpu", "ecc") and self.persistent and not self.ambiguous)

    @property
    def freezes(self) -> bool:
        """It leaves the workers stuck or slow without an exit: only a timeout or a probe sees it."""
        return self.kind in ("hang", "gpu_lost", "slow") or (self.kind == "network" and self.persistent)


def _pick(rng: random.Random, cats: list[Category]) -> Category:
    return rng.choices(cats, weights=[c.count for c in cats])[0]


def trace(model: Model, machines: int, days: float, seed: int,
          switch_of_slot=None) -> list[Fault]:
    """The incidents of one seed over `days`, sorted by time. `switch_of_slot(i)`: the switch
    label of slot i's first machine (for multi-machine incidents)."""
    rng = random.Random(seed)
    end = days * DAY
    out: list[Fault] = []
    explicit = [c for c in TABLE1 if c.stream == "explicit"]
    implicit = [c for c in TABLE1 if c.stream == "implicit"]
    rates = (("explicit", model.daily_rate * machines / DAY),
             ("implicit", model.daily_rate * machines * model.implicit_ratio / DAY),
             ("manual", model.updates_per_day / DAY))
    for stream, rate in rates:
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= end:
                break
            slot = rng.randrange(machines)
            fseed = rng.getrandbits(32)
            if stream == "manual":
                bug = rng.choice(("hang", "nan", "exception")) if rng.random() < model.faulty_update_share else None
                out.append(Fault(t, "update", "update", slot, False, urgent=rng.random() < model.urgent_share,
                                 bug=bug, seed=fseed))
                continue
            cat = _pick(rng, explicit if stream == "explicit" else implicit)
            persistent = rng.random() >= cat.transient
            if stream == "explicit" and switch_of_slot is not None and rng.random() < model.multi_machine_share:
                out.append(Fault(t, cat.key, "network", slot, True, switch=switch_of_slot(slot), seed=fseed))
                continue
            kind = cat.kind
            ambiguous = not persistent or (kind in ("gpu", "ecc") and rng.random() < model.ambiguous_share)
            if kind == "nan":
                persistent = rng.random() < model.sdc_share
                ambiguous = True
            out.append(Fault(t, cat.key, kind, slot, persistent, ambiguous=ambiguous, seed=fseed))
    out.sort(key=lambda f: f.t)
    return out
