"""The pieces of a run: its layout, its spec, its workers' slots and their restore sources, its
checkpoint plan (what a `start` command carries, and what a worker's environment is built from)."""
from __future__ import annotations

import msgspec


class Layout(msgspec.Struct, kw_only=True, frozen=True):
    """A run's parallel layout (what the workers build their process groups from)."""
    machines: int
    gpus_per_machine: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.machines * self.gpus_per_machine


class RunSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What every worker of one run (or a machine's warm spares) is started with.

    `run` is None for warm spares (they learn their run at activation). `replay` marks a
    throw-away run of the stop-time replay: it never reads or writes the job's checkpoints.
    `master` is the rendezvous store's (host, port), None for spares. `spares`: the job's
    `warm_spares` policy.
    """
    job: int
    run: int | None
    command: list[str]
    cwd: str | None
    user_env: dict[str, str]
    layout: Layout
    steps: int
    ckpt_every: int
    ckpt_dir: str
    mem_slots: int
    version: int | None = None
    code_path: str | None = None          # a code version's snapshot (prepended to PYTHONPATH)
    replay: bool = False
    replay_layers: int = 0
    restore_step: int = -1
    master: tuple[str, int] | None = None
    spares: bool = True                   # keep warm spare workers on the machine once the run trains

    def warm_key(self) -> tuple:
        """Which runs a warm worker started for this spec can serve: the same command,
        directory, code and shape (what a worker may read before its activation)."""
        return (tuple(self.command), self.cwd, self.code_path, self.layout, self.steps, self.replay)


class RestoreSource(msgspec.Struct, kw_only=True, frozen=True):
    """One candidate copy of a rank's checkpoint shard, best first in a worker's list."""
    tier: str                              # own | backup | durable
    step: int
    holder: str | None = None              # machine holding an in-memory copy
    addr: tuple[str, int] | None = None    # the holder's peer server (backup tier)
    location: str | None = None            # durable tier URL


class WorkerSlot(msgspec.Struct, kw_only=True, frozen=True):
    rank: int
    local_rank: int
    group_rank: int                        # the machine's index in the run
    restore: list[RestoreSource] = []


class Backup(msgspec.Struct, kw_only=True, frozen=True):
    machine: str
    addr: tuple[str, int]


class CkptPlan(msgspec.Struct, kw_only=True, frozen=True):
    durable_dir: str
    every: int
    backup: Backup | None = None
    key: str | None = None                 # the job's checkpoint key, hex (peer auth, shard MACs)
    backup_every: int = 0                  # steps between pushes to the backup peer; 0: paced by cost
