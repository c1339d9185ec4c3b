"""Durations as a job spec writes them: seconds as a number, or text such as ``"90s"``,
``"5m"``, ``"24h"``, ``"1d"``, ``"250ms"`` or ``"1h30m"``.

``PATTERN`` is the same grammar as a JSON Schema ``pattern`` (ECMA-262 and Python read it
alike), so the published schema accepts exactly the text ``parse_duration`` does.
"""
from __future__ import annotations

import math
import re
from typing import Any

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_UNIT = r"(?:[mM][sS]|[sSmMhHdD])"
PATTERN = rf"^\s*(?:{_NUMBER}|(?:\s*{_NUMBER}\s*{_UNIT})+)\s*$"
_PLAIN_SECONDS = re.compile(rf"\s*({_NUMBER})\s*")
_WITH_UNITS = re.compile(rf"(?:\s*{_NUMBER}\s*{_UNIT})+\s*")
_PART = re.compile(rf"({_NUMBER})\s*({_UNIT})")


def parse_duration(s: Any) -> float:
    """Seconds in a duration: a number (seconds) or a string such as ``"90s"``, ``"5m"``,
    ``"24h"``, ``"1d"``, ``"250ms"``, ``"1.5"`` or ``"1h30m"``.  Raises ValueError otherwise
    (negative, NaN, infinite, empty or unparsable)."""
    bad = ValueError(f"invalid duration {s!r} (expected e.g. 90s, 5m, 24h or seconds)")
    if isinstance(s, bool):
        raise bad
    if isinstance(s, (int, float)):
        value = float(s)
    elif isinstance(s, str) and (plain := _PLAIN_SECONDS.fullmatch(s)):
        value = float(plain.group(1))
    elif isinstance(s, str) and _WITH_UNITS.fullmatch(s):
        value = sum(float(n) * _UNITS[u.lower()] for n, u in _PART.findall(s))
    else:
        raise bad
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"invalid duration {s!r} (must be a finite number of seconds >= 0)")
    return value
