"""The warm standby pool's size: the P99 of Binomial(machines, daily failure rate) (papers.md
§1.7.2). The job core keeps the pool at this size (`job/flows/pool.py`)."""
from __future__ import annotations


def p99_standbys(machines: int, daily_failure_rate: float, quantile: float = 0.99) -> int:
    """Machines to keep warm so that, with probability `quantile`, a day's failures are covered."""
    if machines < 1:
        raise ValueError(f"machines must be >= 1 (got {machines})")
    if not 0.0 <= daily_failure_rate <= 1.0:
        raise ValueError(f"daily failure rate must be within [0, 1] (got {daily_failure_rate})")
    from scipy.stats import binom      # here, not at import: scipy.stats costs a controller seconds to start
    return int(binom.ppf(quantile, machines, daily_failure_rate))


def standby_count(spec) -> int:
    """The number of standbys a job spec asks for (`auto` = P99 sizing, at least 1)."""
    if spec.standby == "auto":
        return max(1, p99_standbys(spec.machines, spec.policy.daily_failure_rate))
    return int(spec.standby)
