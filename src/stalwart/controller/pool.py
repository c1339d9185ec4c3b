"""The warm standby pool: its size, the P99 of Binomial(machines, daily failure rate)
(papers.md §1.7.2), and its refill in the job runner from idle machines of the backend."""
from __future__ import annotations

from scipy.stats import binom


def p99_standbys(machines: int, daily_failure_rate: float, quantile: float = 0.99) -> int:
    """Machines to keep warm so that, with probability `quantile`, a day's failures are covered."""
    if machines < 1:
        raise ValueError(f"machines must be >= 1 (got {machines})")
    if not 0.0 <= daily_failure_rate <= 1.0:
        raise ValueError(f"daily failure rate must be within [0, 1] (got {daily_failure_rate})")
    return int(binom.ppf(quantile, machines, daily_failure_rate))


def standby_count(spec) -> int:
    """The number of standbys a job spec asks for (`auto` = P99 sizing, at least 1)."""
    if spec.standby == "auto":
        return max(1, p99_standbys(spec.machines, spec.policy.daily_failure_rate))
    return int(spec.standby)


REFILL_EVERY_S = 1.0


class PoolFlow:
    """A mixin of `JobRunner` (jobs.py): keep the standby pool at its size while the job runs by
    taking idle machines (a spare of the local backend, any agent that registers later), warming
    their workers at once so the next failover does not wait for `import torch`."""

    def _refill_pool(self, now: float) -> None:
        if now < getattr(self, "pool_next", 0.0):
            return
        self.pool_next = now + REFILL_EVERY_S
        want = standby_count(self.spec)
        self.standby = [m for m in self.standby if self.ctl.machine_alive(m)]
        short = want - len(self.standby)
        if short <= 0:
            return
        for m in self.ctl.free_machines()[:short]:
            self.standby.append(m)
            self.ctl.set_machine(m, state="standby", job_id=self.job_id)
            self._prewarm(m)
            self.event("standby_added", {"machine": m, "pool": len(self.standby), "want": want}, t=now)
