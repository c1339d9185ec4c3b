"""The durations one simulation draws: the profile's, each from the scenario's distribution where
it gives one, and the few a scenario may add (`EXTRA`)."""
from __future__ import annotations

import random
from typing import Any, Callable

from stalwart.sim.failures import Model
from stalwart.sim.profile import Profile


# durations a scenario may give beyond the profile's (`scenario.EXTRA_DURATIONS`), and their defaults
EXTRA = {"storage_outage_s": 1800.0, "slow_replacement_s": 4 * 3600.0, "planned_s": 0.0, "user_fix_s": 5400.0,
         "warmup_s": 0.0}


class Durations:
    """The profile's durations, each drawn from the scenario's distribution where it gives one
    (`Model.durations`); one draw per name and instant, so the events an action sends at once
    agree on how long it took."""

    def __init__(self, profile: Profile, model: Model, seed: int, clock: Callable[[], float]):
        self._profile, self._clock = profile, clock
        self._draw = {k: d.sampler() for k, d in model.durations.items()}
        self._bound = {k: max(d.mean, d.max or 0.0) for k, d in model.durations.items()}
        self._rng = random.Random(f"{seed}/durations")
        self._last: dict[str, tuple[float, float]] = {}

    def bound(self, name: str) -> float:
        """The longest a duration usually takes (its distribution's max): what a timeout must allow."""
        b = self._bound.get(name)
        if b is not None:
            return b
        return EXTRA[name] if name in EXTRA else float(getattr(self._profile, name))

    def __getattr__(self, name: str) -> Any:
        draw = self.__dict__.get("_draw", {}).get(name)
        if draw is None:
            if name in EXTRA:
                return EXTRA[name]
            return getattr(self._profile, name)
        now = self._clock()
        last = self._last.get(name)
        if last is None or last[0] != now:
            last = self._last[name] = (now, draw(self._rng))
        return last[1]
