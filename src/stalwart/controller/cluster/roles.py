"""A machine's role: the registry's (`machines.py`), the job core's (`AssignMachine`), the store's
`machines.state` column and `/api/machines` all hold one of these values.

A module of its own, importing nothing, so that the store (`controller/store/ops.py`) and the job
core can name a role without depending on the registry.
"""
from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """A machine's role, written unchanged (its string value) to the store and the API."""
    PROVISIONING = "provisioning"      # a row written before its agent registered (a lost beat's write)
    IDLE = "idle"                      # free: any job may take it
    STANDBY = "standby"                # a job's warm spare
    ACTIVE = "active"                  # holds ranks of a job's run
    EVICTED = "evicted"                # taken out of service by a job's incident
