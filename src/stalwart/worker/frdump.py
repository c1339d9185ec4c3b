"""PyTorch Flight Recorder inside a worker: switch it on, dump it on demand.

The flight recorder keeps the last N collectives of every process group of this process
(``pg_id``, ``collective_seq_id``, ``profiling_name``, ``retired``, ...).  It works with
gloo and NCCL when ``TORCH_FR_BUFFER_SIZE`` is set **before the process group is
created** (environment.md); the dump is a JSON text produced in well under a millisecond
and can be taken from a side thread while the main thread is blocked inside a collective,
which is how the SDK answers the controller's "dump your recorder" during a hang.

Dumps of all ranks go to :func:`stalwart.analyzer.flightrec.laggards`.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_BUFFER = 2000


def enable(buffer_size: int = DEFAULT_BUFFER) -> int:
    """Turn the flight recorder on for process groups created after this call.

    Sets ``TORCH_FR_BUFFER_SIZE`` to ``buffer_size`` unless it is already set (a value the
    user or the agent chose wins).  Returns the size in force.  Raises RuntimeError when
    the default process group already exists and the variable was not set before it was
    created (too late: that group records nothing), and ValueError for a bad size.
    """
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"flight recorder buffer_size must be a positive integer (got {buffer_size!r})")
    current = os.environ.get(ENV)
    if current:
        try:
            return int(current)
        except ValueError:
            raise ValueError(f"{ENV}={current!r} is not an integer") from None
    try:
        import torch.distributed as dist
        initialized = dist.is_available() and dist.is_initialized()
    except ImportError:
        initialized = False
    if initialized:
        raise RuntimeError(f"flight recorder enabled too late: call enable() before "
                           f"init_process_group (or set {ENV} in the worker's environment)")
    os.environ[ENV] = str(buffer_size)
    return buffer_size


def dump(only_active: bool = False) -> dict[str, Any] | None:
    """This process' flight-recorder trace, parsed (``{"entries": [...], "pg_config": ...}``).

    None when this torch has no flight recorder or nothing was recorded (recorder off, or
    no collective yet).  ``only_active`` keeps only unfinished entries.  Safe to call from
    any thread, also while another thread is blocked in a collective.
    """
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    fn = getattr(c10d, "_dump_fr_trace_json", None)
    if fn is None:
        return None
    raw = fn(includeCollectives=True, onlyActive=only_active)
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode("utf-8", "replace")
    trace = json.loads(raw)
    if not isinstance(trace, dict) or "entries" not in trace:
        return None
    return trace
