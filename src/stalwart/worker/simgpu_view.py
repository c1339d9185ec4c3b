"""The worker's view of its (simulated) GPU: what a real one would do to this process.

Where no GPU exists the agent keeps the machine's simulated GPUs in a JSON file
(STALWART_SIMGPU); a worker on a faulted device fails the way a real one does (the CUDA error
line, a non-zero exit), runs slower when it is hot, and corrupts gradients when it has silent
data corruption. The file is re-read only when it changes.
"""
from __future__ import annotations

import json
import os

from stalwart.devices.simgpu import default_device, fatal_line, slowdown_factor


class SimGpuView:
    def __init__(self, path: str | None, device: int):
        self.path = path
        self.device = device
        self._mtime: int | None = None
        self._state: dict = default_device(device)

    def state(self) -> dict:
        if not self.path:
            return self._state
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return self._state
        if mtime != self._mtime:
            try:
                with open(self.path) as f:
                    devices = json.load(f)["devices"]
                self._state = {**default_device(self.device), **devices[self.device]}
                self._mtime = mtime
            except (OSError, ValueError, KeyError, IndexError):
                pass  # mid-replace: keep the last state, re-read next step
        return self._state

    def fatal(self) -> str | None:
        return fatal_line(self.state())

    def slowdown(self) -> float:
        return slowdown_factor(self.state())

    def corrupts(self) -> bool:
        s = self.state()
        return bool(s.get("present", True) and s.get("sdc"))


def corrupt_(t) -> None:
    """Perturb tensor `t` in place the way a mercurial core would: a few elements (about one
    in every numel/7, spread over the tensor) come out slightly wrong (relative error 2**-8),
    enough to change every bit-exact digest and to fail a matmul check, with no NaN or crash."""
    if t.numel() == 0:
        return
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
    flat[:: max(1, t.numel() // 7)].mul_(1 + 2**-8)
    if not t.is_contiguous():
        t.copy_(flat.view_as(t))
