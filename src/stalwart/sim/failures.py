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

import math
import random
from dataclasses import dataclass
from typing import Annotated, Any, Callable

import msgspec

DAY = 86400.0
MACHINES_PER_SWITCH = 4      # as sim/cluster.py's layout (a leaf switch per 4 machines)


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


NonNeg = Annotated[float, msgspec.Meta(ge=0)]
Share = Annotated[float, msgspec.Meta(ge=0, le=1)]


class Dist(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A duration: `mean` seconds, and the paper's observed maximum `max`, read as the 99th
    percentile of a lognormal with that mean (none: always the mean)."""
    mean: float
    max: float | None = None

    def sampler(self) -> Callable[[random.Random], float]:
        m, q = self.mean, self.max
        if q is None or q <= m or m <= 0:
            return lambda rng: m
        z = 2.3263                           # the normal's 99th percentile
        disc = z * z - 2.0 * math.log(q / m)
        sigma = z - math.sqrt(disc) if disc > 0 else z
        mu = math.log(m) - sigma * sigma / 2.0
        return lambda rng: rng.lognormvariate(mu, sigma)


class Model(msgspec.Struct, forbid_unknown_fields=True):
    """The failure model's knobs: a scenario file's `failures` section (`sim/scenarios/`), and
    `stalwart sim --set KEY=VALUE` overrides any number. The defaults are the dense job's
    explicit/implicit/manual streams alone (no correlated events, no tails): a scenario adds the rest."""
    daily_rate: NonNeg = 0.0012          # explicit incidents per machine per day
    implicit_ratio: NonNeg = 6096 / 39687
    updates_per_day: NonNeg = 20 / 90    # Table 4, dense job: 20 hot updates in ~3 months
    urgent_share: Share = 0.25
    faulty_update_share: Share = 12 / 20
    multi_machine_share: Share = 0.02    # explicit incidents that take a whole leaf switch (4 machines)
    ambiguous_share: Share = 0.3
    sdc_share: Share = 0.75
    recur_mean_s: NonNeg = 900.0
    slowdown: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    # streams beyond Table 1's (per machine per day, or per job per day)
    sdc_per_machine_day: NonNeg = 0.0    # silent data corruption: a machine computes wrong values
    user_faults_per_day: NonNeg = 0.0    # the job's own code fails outside an update (Table 2)
    planned_per_day: NonNeg = 0.0        # planned interruptions (maintenance): checkpoint and requeue
    switch_per_day: NonNeg = 0.0         # a switch failure taking `switch_machines` machines at once
    switch_machines: Annotated[int, msgspec.Meta(ge=1)] = 32
    storage_per_day: NonNeg = 0.0        # the storage service is out for every machine (durations.storage_outage_s)
    # time-varying rates: hardware and user-code streams run `early_factor` times faster for the
    # first `early_days`, and `late_factor` times faster from `late_from` of the run on
    early_days: NonNeg = 0.0
    early_factor: NonNeg = 1.0
    late_from: Share = 1.0
    late_factor: NonNeg = 1.0
    # how faults look and how recovery goes wrong
    cascade_ranks: Annotated[int, msgspec.Meta(ge=0)] = 0   # other machines whose ranks exit with a
    #                                                        secondary NCCL error after a crash
    tail_missing_share: Share = 0.0      # the primary's log tail is lost (the classifier sees an exit only)
    false_positive: Share = 0.0          # a healthy machine fails a stop-time check run (per machine, per run)
    restart_fail_share: Share = 0.0      # a restart fails in its first step (rendezvous, NCCL init)
    slow_replacement_share: Share = 0.0  # a replacement machine takes durations.slow_replacement_s
    recall: dict[str, float] = msgspec.field(default_factory=dict)   # stop-time check recall per fault kind
    durations: dict[str, Dist] = msgspec.field(default_factory=dict)  # profile values drawn from a lognormal

    def __post_init__(self) -> None:
        # a mapping's values are checked here, so that the error names the key (msgspec's would not)
        for k, v in self.recall.items():
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"recall.{k} must be within [0, 1] (got {v})")
        for k, d in self.durations.items():
            if d.mean < 0 or (d.max is not None and d.max < 0):
                raise ValueError(f"durations.{k} must be >= 0 (got mean {d.mean}, max {d.max})")

    def set(self, key: str, value: str) -> None:
        names = [f.name for f in msgspec.structs.fields(self) if f.name not in ("recall", "durations")]
        if key not in names:
            raise ValueError(f"unknown failure-model key {key!r} (known: {', '.join(names)})")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"--set {key}: {value!r} is not a number") from None
        try:
            setattr(self, key, msgspec.convert({**self.as_dict(), key: int(v) if key in INT_KEYS else v},
                                               Model).__getattribute__(key))
        except msgspec.ValidationError as e:
            raise ValueError(f"--set {key}: {v} is out of range ({e})") from None
        if key in INT_KEYS and v != int(v):
            raise ValueError(f"--set {key}: {v} is not a whole number")

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def rate_factor(self, t: float, end: float) -> float:
        """How much faster than their base rate the time-varying streams run at `t` (seconds)."""
        f = 1.0
        if t < self.early_days * DAY:
            f *= self.early_factor
        if t >= self.late_from * end:
            f *= self.late_factor
        return f


INT_KEYS = ("switch_machines", "cascade_ranks")


@dataclass(frozen=True)
class Fault:
    """One incident of the trace.

    kind: gpu (a CUDA error; certain unless ambiguous), ecc, gpu_lost, disk, network, lost
    (the machine's agent and workers vanish), kernel (panic), crash, oom, io (an exception from a
    library), hang, slow, nan, update, user (the job's own code fails), planned (maintenance: the
    job is checkpointed and requeued), storage (the storage service is out for every machine).
    slot: the job slot it hits (the machine there at that time); switch: for a multi-machine
    incident, the switches whose job machines it takes down.
    """
    t: float
    category: str
    kind: str
    slot: int
    persistent: bool
    ambiguous: bool = False
    switch: tuple[str, ...] | None = None
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


def _switches(label: str, machines: int) -> tuple[str, ...]:
    """The leaf switches a failure of `machines` machines around switch `label` takes down: the
    aligned block of switches (a spine's share) that holds it."""
    n = max(1, -(-machines // MACHINES_PER_SWITCH))
    k = int(label.lstrip("s"))
    first = k - k % n
    return tuple(f"s{i}" for i in range(first, first + n))


# stream -> does it follow the time-varying factor (hardware ages, first-time features fail)
STREAMS = ("explicit", "implicit", "manual", "sdc", "user", "planned", "switch", "storage")
VARYING = {"explicit", "implicit", "sdc", "user", "switch", "storage"}


def trace(model: Model, machines: int, days: float, seed: int,
          switch_of_slot: Callable[[int], str] | None = None) -> list[Fault]:
    """The incidents of one seed over `days`, sorted by time. `switch_of_slot(i)`: the switch
    label of slot i's first machine (for multi-machine incidents). Time-varying streams are drawn
    by thinning: at their highest rate, each kept with its factor's share."""
    end = days * DAY
    out: list[Fault] = []
    explicit = [c for c in TABLE1 if c.stream == "explicit"]
    implicit = [c for c in TABLE1 if c.stream == "implicit"]
    rates = {"explicit": model.daily_rate * machines, "implicit": model.daily_rate * machines * model.implicit_ratio,
             "manual": model.updates_per_day, "sdc": model.sdc_per_machine_day * machines,
             "user": model.user_faults_per_day, "planned": model.planned_per_day,
             "switch": model.switch_per_day if switch_of_slot is not None else 0.0,
             "storage": model.storage_per_day}
    top = max(1.0, model.early_factor, model.late_factor, model.early_factor * model.late_factor)
    for stream in STREAMS:
        srng = random.Random(f"{seed}/{stream}")   # one generator per stream: a knob of one leaves the others
        peak = top if stream in VARYING else 1.0
        rate = rates[stream] * peak / DAY
        t = 0.0
        while rate > 0:
            t += srng.expovariate(rate)
            if t >= end:
                break
            slot = srng.randrange(machines)
            fseed = srng.getrandbits(32)
            if peak > 1.0 and srng.random() * peak >= model.rate_factor(t, end):
                continue
            out.append(_fault(model, stream, t, slot, fseed, srng, explicit, implicit, switch_of_slot))
    out.sort(key=lambda f: (f.t, f.seed))
    return out


def _fault(model: Model, stream: str, t: float, slot: int, fseed: int, rng: random.Random,
           explicit: list[Category], implicit: list[Category],
           switch_of_slot: Callable[[int], str] | None) -> Fault:
    if stream == "manual":
        bug = rng.choice(("hang", "nan", "exception")) if rng.random() < model.faulty_update_share else None
        return Fault(t, "update", "update", slot, False, urgent=rng.random() < model.urgent_share, bug=bug, seed=fseed)
    if stream == "sdc":
        return Fault(t, "sdc", "nan", slot, True, ambiguous=True, seed=fseed)
    if stream == "user":
        return Fault(t, "user_code", "user", slot, False, seed=fseed)
    if stream == "planned":
        return Fault(t, "planned", "planned", slot, False, seed=fseed)
    if stream == "storage":
        return Fault(t, "storage", "storage", slot, False, ambiguous=True, seed=fseed)
    if stream == "switch":
        assert switch_of_slot is not None
        return Fault(t, "switch", "network", slot, True, switch=_switches(switch_of_slot(slot), model.switch_machines),
                     seed=fseed)
    cat = _pick(rng, explicit if stream == "explicit" else implicit)
    persistent = rng.random() >= cat.transient
    if stream == "explicit" and switch_of_slot is not None and rng.random() < model.multi_machine_share:
        # a leaf switch fails: labelled as what it is, not as the category drawn before
        return Fault(t, "switch", "network", slot, True, switch=(switch_of_slot(slot),), seed=fseed)
    kind = cat.kind
    ambiguous = not persistent or (kind in ("gpu", "ecc") and rng.random() < model.ambiguous_share)
    if kind == "nan":
        persistent = rng.random() < model.sdc_share
        ambiguous = True
    return Fault(t, cat.key, kind, slot, persistent, ambiguous=ambiguous, seed=fseed)
