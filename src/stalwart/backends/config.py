"""A backend from its JSON config file: `kind` (slurm, kubernetes) picks the class.

The launcher and the controller each build their backend object from the same file; the
interface they use is `backends.base.Backend`.
"""
from __future__ import annotations

import json
from typing import Any

from stalwart.backends.base import Backend
from stalwart.backends.kubernetes import KubernetesBackend
from stalwart.backends.slurm import SlurmBackend


def load(path: str) -> Backend:
    """The backend a config file describes: JSON with `kind` (slurm, kubernetes) and its fields."""
    try:
        with open(path) as f:
            cfg: dict[str, Any] = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the backend config {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"the backend config {path} is not JSON: {e}") from None
    kind = cfg.get("kind")
    if kind == "slurm":
        return SlurmBackend.from_config(cfg)
    if kind == "kubernetes":
        return KubernetesBackend.from_config(cfg)
    raise ValueError(f"backend config {path}: kind must be slurm or kubernetes (got {kind!r})")
