"""Training-signal anomalies (pure): a NaN/inf or a jump in loss or gradient norm, and the ranks
whose local gradient norm is not finite (the machines that corrupted the update)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping, Sequence

from stalwart.controller.rules.hangwatch import DEFAULT_WINDOW, _rank


def _finite_values(name: str, values: Sequence[Any]) -> list[float]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must hold numbers (got {v!r})")
        out.append(float(v))
    return out


def _jump(name: str, history: list[float], factor: float, window: int, min_history: int) -> str | None:
    latest = history[-1]
    if not math.isfinite(latest):
        return f"{name} is {latest} at the latest step"
    base = [v for v in history[-1 - window:-1] if math.isfinite(v)]
    if len(base) < min_history:
        return None
    median = statistics.median(base)
    if median > 0 and latest >= factor * median:
        return (f"{name} jumped to {latest:.4g}, {latest / median:.1f}x the median {median:.4g} "
                f"of the last {len(base)} steps (threshold {factor:g}x)")
    return None


def anomaly(loss_history: Sequence[float], grad_norm: Sequence[float] | float | None = None,
            factor: float = 5.0, window: int = DEFAULT_WINDOW, min_history: int = 3) -> str | None:
    """Reason string when the latest loss or grad norm is NaN/inf or jumped, else None.

    ``loss_history`` and ``grad_norm`` (a history, or just the latest value) end with the
    latest step.  A jump is ``latest >= factor * median`` of up to ``window`` previous
    finite values, checked once ``min_history`` of them exist (papers.md: >= 5x or NaN).
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"factor must be > 1 (got {factor!r})")
    losses = _finite_values("loss_history", loss_history)
    if grad_norm is None:
        grads: list[float] = []
    elif isinstance(grad_norm, (int, float)) and not isinstance(grad_norm, bool):
        grads = [float(grad_norm)]
    else:
        grads = _finite_values("grad_norm", grad_norm)  # type: ignore[arg-type]  # a bool is refused there
    for name, hist in (("loss", losses), ("grad norm", grads)):
        if hist:
            why = _jump(name, hist, factor, window, min_history)
            if why:
                return why
    return None


def nan_culprits(local_grad_norms: Mapping[int, float]) -> list[int]:
    """Ranks whose LOCAL grad norm (before the data-parallel reduction) is NaN or inf.

    After the all-reduce every rank sees the same non-finite global norm; the local norms
    tell which rank produced it.  Map them to machines with :func:`culprit_machines`.
    """
    out = []
    for rank, norm in local_grad_norms.items():
        _rank(rank)
        if isinstance(norm, bool) or not isinstance(norm, (int, float)):
            raise ValueError(f"grad norm of rank {rank} must be a number (got {norm!r})")
        if not math.isfinite(norm):
            out.append(rank)
    return sorted(out)


def culprit_machines(local_grad_norms: Mapping[int, float], topo: Any) -> list[int]:
    """Machine indices (topology) holding the ranks named by :func:`nan_culprits`."""
    return topo.machines_of(nan_culprits(local_grad_norms))
