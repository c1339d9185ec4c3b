"""What an agent tells a (re)started controller when it registers."""
from __future__ import annotations

import msgspec


class Registration(msgspec.Struct, kw_only=True):
    """An agent's registration: who it is, and what it runs now (so a controller that restarted
    can adopt a run that kept training)."""
    address: str
    gpus: int
    hostname: str = ""
    pid: int = 0
    workdir: str = ""
    peer: tuple[str, int] | None = None
    running_run: int | None = None
    job: int | None = None
    ranks: dict[int, int] = {}             # rank -> pid of its live worker
    done_ranks: list[int] = []             # ranks of `running_run` whose worker finished (exit 0)
    last_step: dict[int, int] = {}         # rank -> last step it reported
    inventory: dict[str, dict[int, list[int]]] = {}
    warm: int = 0                          # warm spare workers waiting at the barrier
    labels: dict[str, str] = {}
    isolated: bool = False                 # its workers have a network namespace of their own
