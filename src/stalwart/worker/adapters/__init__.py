"""Adapters that put scripts written for torch's and the frameworks' own APIs under stalwart.

- `dcp`: anything saving through `torch.distributed.checkpoint` (FSDP2, torchtitan): every-step
  in-memory checkpoint, backups, durable copies, resharding on restore;
- `ddp`: `DistributedDataParallel`: per-rank gradient checks from a communication hook;
- `lightning`: a Lightning `Callback` (extra `stalwart[lightning]`): steps, loss, gradient checks,
  every-step checkpoint and resume;
- `hf`: a `transformers.Trainer` `TrainerCallback` (extra `stalwart[hf]`): the same.

Each joins the script's own process groups through `stalwart.worker.attach()`. A framework
adapter whose framework is not installed stops the script with one line naming the extra.

Importing an adapter is where a warm standby waits for its ranks (`worker.standby`), once the
adapter's framework is loaded: a script imports its adapter before it builds its process groups,
which needs the ranks.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, NamedTuple


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import `module`, or stop with one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"error: stalwart's {what} adapter needs {module.split('.')[0]}, which is not "
                         f"installed: pip install 'stalwart[{extra}]'") from None


class Restored(NamedTuple):
    """The state a restarted run restores (the agent names it in the run's environment)."""
    rank: int
    step: int
    state: Any
    tier: str
    out_dir: str        # where a framework's own checkpoint of it is written


def restored_state() -> Restored | None:
    """This rank's restored state, or None on a fresh start."""
    from stalwart.protocol import Env
    from stalwart.worker import memckpt
    path = os.environ.get(Env.RESTORE_PATH)
    if not path:
        return None
    rank = int(os.environ.get("RANK", "0"))
    step, state = memckpt.load(path, rank)
    return Restored(rank, step, state, os.environ.get(Env.RESTORE_TIER, "?"),
                    os.environ.get(Env.CKPT_DIR) or os.path.abspath("checkpoints"))


def rng_state(plain: bool = False) -> dict:
    """The random generators' states, in the layout the Hugging Face Trainer saves (`rng_state.pth`):
    Python's, NumPy's, torch's CPU one and, with CUDA, the devices' (all of them under DDP, the
    current one's otherwise). A step trained again after a restore draws its dropout masks (and
    whatever else it samples) from here, so it gives the same loss as the first time. `plain`:
    NumPy's key as a list, so that `torch.load(weights_only=True)` (Lightning's) reads it."""
    import random

    import numpy as np
    import torch
    numpy: Any = np.random.get_state()
    if plain:
        numpy = (numpy[0], numpy[1].tolist(), *numpy[2:])
    out: dict[str, Any] = {"python": random.getstate(), "numpy": numpy, "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        out["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return out


def set_rng_state(state: dict) -> None:
    """Put back what `rng_state` took."""
    import random

    import numpy as np
    import torch
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            torch.cuda.random.set_rng_state(cuda)
