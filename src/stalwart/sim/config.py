"""The simulation's settings (`Config`, from `stalwart sim`'s options) and one submission of the
simulated job (`Segment`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Config:
    gpus: int = 9600
    gpus_per_machine: int = 8
    pp: int = 8
    days: float = 90.0
    step_s: float = 10.0
    durable_every_s: float = 1800.0
    standby: str = "auto"
    tick_min_s: float = 0.5
    tick_max_s: float = 30.0
    settle_s: float = 10.0
    tick_backoff: float = 0.1        # ticks spaced out by this share of the time since the last change
    compute_times: bool = False      # agents report per-rank compute times (the what-if mode)

    @property
    def machines(self) -> int:
        return self.gpus // self.gpus_per_machine

    def check(self) -> None:
        if self.gpus < 1 or self.gpus_per_machine < 1 or self.gpus % self.gpus_per_machine:
            raise ValueError(f"--gpus ({self.gpus}) must be a multiple of --gpus-per-machine ({self.gpus_per_machine})")
        if self.machines % self.pp or self.machines < 2 * self.pp:
            raise ValueError(f"{self.machines} machines cannot hold pipelines of {self.pp} stages "
                             f"(need a multiple of --pp, at least 2 pipelines)")
        if self.days <= 0 or self.step_s <= 0 or self.durable_every_s < self.step_s:
            raise ValueError("--days and --step-s must be > 0 and --durable-every-s >= --step-s")


@dataclass
class Segment:
    """One submission of the job (a requeue or a human's resubmission starts another)."""
    index: int
    start: float
    log: list[dict] = field(default_factory=list)
    end: float | None = None
    state: str | None = None
    reason: str | None = None
    resume_step: int = 0
    lost_after: int | None = None     # steps after this were redone by the next segment
