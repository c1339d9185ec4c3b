"""One line for a refused job spec field: its name, what it may be, and the value given.

msgspec checks the fields (``Meta`` bounds, patterns, types) and says where it failed
(``Expected `int` >= 1 - at `$.policy.missed_beats```); ``explain`` reads the field's declared
type with ``msgspec.inspect`` and writes what the user reads:
``policy.missed_beats must be >= 1 (got 0)``. A type may carry its own wording in
``Meta(extra={"must": "be a path string"})``.
"""
from __future__ import annotations

import difflib
import math
import re
from typing import Any

from msgspec import inspect as mi

_AT = re.compile(r" - at (?:`key` in )?`\$([^`]*)`$")


def what_failed(error: str) -> tuple[str, list[str], bool]:
    """msgspec's ValidationError text split into the problem, the path's names and whether a
    key (not a value) at that path failed
    (``"Expected `int` - at `$.policy.x`"`` -> ``("Expected `int`", ["policy", "x"], False)``)."""
    m = _AT.search(error)
    if m is None:
        return error, [], False
    return error[:m.start()], re.findall(r"\.(\w+)", m.group(1)), "`key` in" in m.group(0)


def unknown_key_error(key: Any, known: list[str], where: str) -> ValueError:
    """An unknown key, with the closest known one or else all of them."""
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
    return ValueError(f"unknown field {key!r} in {where}{hint}")


def _unwrap(t: mi.Type) -> tuple[mi.Type, dict[str, Any]]:
    """The type under its Metadata layers, and their `extra` merged."""
    extra: dict[str, Any] = {}
    while isinstance(t, mi.Metadata):
        extra.update(t.extra or {})
        t = t.type
    return t, extra


def _int(name: str, t: mi.IntType, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be an integer (got {value!r})"
    if t.ge is not None and value < t.ge:
        return f"{name} must be >= {t.ge} (got {value!r})"
    if t.le is not None and value > t.le:
        return f"{name} must be <= {t.le} (got {str(value)[:40]})"
    return f"{name} must be an integer within the field's bounds (got {value!r})"


def _float(name: str, t: mi.FloatType, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} must be a number (got {value!r})"
    try:
        x = float(value)
    except OverflowError:
        return f"{name} must be a finite number (got {str(value)[:40]}...)"
    if math.isnan(x):
        return f"{name} must be a number (got {value!r})"
    for bound, op, fails in ((t.gt, ">", lambda b: x <= b), (t.ge, ">=", lambda b: x < b),
                             (t.lt, "<", lambda b: x >= b), (t.le, "<=", lambda b: x > b)):
        if bound is not None and fails(bound):
            return f"{name} must be {op} {bound:g} (got {x:g})"
    return f"{name} must be a number within the field's bounds (got {value!r})"


def _env(name: str, value: Any) -> str:
    if not isinstance(value, dict):
        return f"{name} must be a mapping of names to strings (got {value!r})"
    for key, v in value.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            return f"{name} name must be a valid variable name (got {key!r})"
        if not isinstance(v, str):
            return f"{name}.{key} must be a string (got {v!r})"
    return f"{name} must be a mapping of names to strings (got {value!r})"


def explain(name: str, annotation: Any, value: Any) -> str:
    """Why `value` does not fit the field `name` declared as `annotation` (one line)."""
    t, extra = _unwrap(mi.type_info(annotation))
    if isinstance(t, mi.UnionType):
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if isinstance(value, str) and extra.get("must"):     # (standby: a count or "auto")
            return f"{name} must {extra['must']} (got {value!r})"
        numeric = [m for m in members if isinstance(_unwrap(m)[0], (mi.IntType, mi.FloatType))]
        t, more = _unwrap((numeric or members)[0])
        extra = {**more, **extra} if not numeric else more
    if extra.get("must"):
        return f"{name} must {extra['must']} (got {value!r})"
    if isinstance(t, mi.IntType):
        return _int(name, t, value)
    if isinstance(t, mi.FloatType):
        return _float(name, t, value)
    if isinstance(t, mi.BoolType):
        return f"{name} must be true or false (got {value!r})"
    if isinstance(t, mi.StructType):
        return f"{name} must be a mapping (got {type(value).__name__})"
    if isinstance(t, mi.DictType):
        return _env(name, value)
    return f"{name} is not valid (got {value!r})"
