"""The simulated GPU, for the modules that still name it here; it lives in `stalwart.devices.simgpu`."""

from stalwart.devices.simgpu import SimGpu, fatal_line, slowdown_factor

__all__ = ["SimGpu", "fatal_line", "slowdown_factor"]
