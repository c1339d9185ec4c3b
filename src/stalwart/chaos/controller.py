"""Chaos for the control plane: a controller that SIGKILLs itself right after a job enters a phase.

Restart-safety tests kill the controller mid-recovery, at a moment no outside signal can hit: they
write a job phase's name to `<state_dir>/chaos/controller-kill`; a controller started with
`--chaos-self-kill` checks that file after each transition a job carried out (its decision saved and
sent), and kills itself once, the file removed. A controller started without the flag never looks.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Callable

SELF_KILL_FILE = os.path.join("chaos", "controller-kill")
log = logging.getLogger("stalwart.controller")


def self_kill(state_dir: str) -> Callable[[int, str], None]:
    """The hook a controller calls with (job id, phase entered)."""
    path = os.path.join(os.path.abspath(state_dir), SELF_KILL_FILE)

    def phase_entered(job_id: int, phase: str) -> None:
        try:
            with open(path) as f:
                want = f.read().strip()
        except OSError:
            return
        if want != phase:
            return
        os.unlink(path)
        log.warning("chaos: killing the controller as job %s enters %s", job_id, phase)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
    return phase_entered
