"""What the machine runs now: the job, the run, the run's `start` command and each local rank's
last reported step. One value shared by the agent's parts: the command executor changes it (a
`start`, an adopted run), the worker server records steps in it, the registration and the
progress watch read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from stalwart import protocol as p


@dataclass
class RunState:
    job: int | None = None
    run: int | None = None
    start: p.Start | None = None        # the run's command (kept for a successor, agent/succession.py)
    last_step: dict[int, int] = field(default_factory=dict)     # rank -> the last step its SDK reported
