"""A warm standby's wait for its ranks, before the script builds its process groups.

A machine's warm spares run the job's command with STALWART_STANDBY=1 and no ranks: torch and the
script's imports are loaded, and the worker must block until the agent hands it its ranks (the
activation barrier). `worker.init()` waits inside itself. A script that builds its own groups
(`init_process_group`, a framework's strategy) would fail first for want of RANK, so the adapters
wait when they are imported (`stalwart.worker.adapters`), which such a script does before its
set-up: `wait_if_standby` then returns with the run's environment in `os.environ`. The link it
opened to the agent is the one the worker's context goes on with (`take_link`).
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable

from stalwart.protocol import Activate, Env, StandbyReady, ToWorker
from stalwart.worker.link import AgentLink
from stalwart.worker.warmup import untitle_warm, warm_up_torch

_link: AgentLink | None = None
_handler: Callable[[ToWorker], None] | None = None
_early: list[ToWorker] = []      # messages (chaos) that came before a context took the link


def _dispatch(msg: ToWorker) -> None:
    if _handler is not None:
        _handler(msg)
    else:
        _early.append(msg)


def _take_threads(value: str | None) -> None:
    """A run's OMP_NUM_THREADS, for a warm worker whose torch was loaded before the run existed."""
    torch = sys.modules.get("torch")
    if not value or torch is None:
        return
    try:
        n = int(value)
    except ValueError:
        return
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def wait_if_standby() -> None:
    """Block a warm standby until it is activated (its ranks land in os.environ); at once otherwise."""
    global _link, _handler
    if os.environ.get(Env.STANDBY) != "1" or _link is not None:
        return
    activated = threading.Event()
    env: dict[str, str] = {}

    def on_message(msg: ToWorker) -> None:
        if isinstance(msg, Activate):
            env.update(msg.env)
            activated.set()
        else:
            _early.append(msg)

    _handler = on_message
    _link = AgentLink(os.environ.get(Env.AGENT_SOCK), _dispatch)
    warm_up_torch()
    _link.send_now(StandbyReady(pid=os.getpid()))
    activated.wait()
    os.environ.update(env)
    os.environ.pop(Env.STANDBY, None)
    _take_threads(env.get("OMP_NUM_THREADS"))
    _handler = None
    untitle_warm()


def take_link(on_message: Callable[[ToWorker], None]) -> AgentLink | None:
    """The link a standby's wait opened (its later messages go to `on_message`), or None."""
    global _handler
    if _link is None:
        return None
    _handler = on_message
    while _early:
        on_message(_early.pop(0))
    return _link
