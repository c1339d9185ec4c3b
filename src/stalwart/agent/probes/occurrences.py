"""Names for the underlying occurrences behind a probe's repeated observations.

A probe sees the same condition again on every check while it lasts (a NIC that stays down) and
sometimes several readings of one event at once (the down and the carrier change of one flap).
The controller's network rule counts *occurrences* (ByteRobust: evict when an alert recurs within
5 minutes), so each observation carries the ids of the occurrences it saw: a condition keeps one
id from the check that first sees it to the check that no longer does, and changes a counter
recorded between two checks (a link that went down and up in between) get ids of their own.
"""
from __future__ import annotations

from typing import Hashable


class Occurrences:
    """Per key (an interface and a condition), the occurrence open now, if any."""

    def __init__(self) -> None:
        self._stamp: str | None = None   # ids stay unique across agent restarts
        self._n = 0
        self._open: dict[Hashable, str] = {}

    def is_open(self, key: Hashable) -> bool:
        """Whether the condition held at the last check."""
        return key in self._open

    def observe(self, key: Hashable, began: int, holds: bool, now: float) -> tuple[list[str], str | None]:
        """One check of `key`: `began` occurrences started since the last check (0 when the probe
        cannot tell), `holds` whether the condition holds now.

        Returns the ids this check saw (the occurrence open before, if any, then the new ones)
        and the id still open now (None when the condition does not hold). A condition that holds
        with nothing open before began now, whatever `began` says.
        """
        if self._stamp is None:
            self._stamp = f"{now:.3f}"
        before = self._open.pop(key, None)
        if holds and began == 0 and before is None:
            began = 1
        new = [self._next(key) for _ in range(max(0, began))]
        standing = (new[-1] if new else before) if holds else None
        if standing is not None:
            self._open[key] = standing
        return ([before] if before else []) + new, standing

    def _next(self, key: Hashable) -> str:
        self._n += 1
        name = key if isinstance(key, str) else "/".join(map(str, key)) if isinstance(key, tuple) else str(key)
        return f"{name}@{self._stamp}#{self._n}"


def down_transitions(changes: int, was_down: bool) -> int:
    """How many times a link went down in `changes` carrier changes since a check that saw it
    down (`was_down`) or up: changes alternate, so from up the odd ones are downs."""
    if changes <= 0:
        return 0
    return changes // 2 if was_down else (changes + 1) // 2
