"""Every `STALWART_*` environment variable a worker reads, and the environment a worker gets.

Agents decide from the typed command they received (a run's job, layout, replay flag, restore
plan), never from the workers' environment; the environment a worker sees is built here, once,
from the command (`run_env`, `rank_env`).
"""
from __future__ import annotations

from typing import Any

from stalwart.protocol.run import RunSpec, WorkerSlot


class Env:
    """Every `STALWART_*` variable a worker (the SDK, the bundled GPT) reads, by name."""
    JOB = "STALWART_JOB"
    RUN = "STALWART_RUN"
    TP, PP, DP, CP, EP = "STALWART_TP", "STALWART_PP", "STALWART_DP", "STALWART_CP", "STALWART_EP"
    MACHINES = "STALWART_MACHINES"
    GPUS_PER_MACHINE = "STALWART_GPUS_PER_MACHINE"
    STEPS = "STALWART_STEPS"
    CKPT_EVERY = "STALWART_CKPT_EVERY"
    CKPT_DIR = "STALWART_CKPT_DIR"
    MEM_SLOTS = "STALWART_MEM_SLOTS"
    MEM_OVERLAP = "STALWART_MEM_OVERLAP"     # "1": the in-memory checkpoint's copy overlaps the next step
    REPLAY = "STALWART_REPLAY"
    REPLAY_LAYERS = "STALWART_REPLAY_LAYERS"
    RESTORE_STEP = "STALWART_RESTORE_STEP"
    RESTORE_PATH = "STALWART_RESTORE_PATH"
    RESTORE_TIER = "STALWART_RESTORE_TIER"
    CODE_VERSION = "STALWART_CODE_VERSION"
    STANDBY = "STALWART_STANDBY"
    AGENT_SOCK = "STALWART_AGENT_SOCK"
    # seconds the SDK's link waits for its agent to come back (a restarted agent adopts the
    # worker, agent/adopt.py) before the worker gives up and exits; absent or 0: at once
    RELINK_S = "STALWART_RELINK_S"
    SIMGPU = "STALWART_SIMGPU"
    MACHINE = "STALWART_MACHINE"
    SHM_DIR = "STALWART_SHM_DIR"
    SEED = "STALWART_SEED"
    FORCE_CPU = "STALWART_FORCE_CPU"
    # the flight-recorder hook (worker/frhook.py, loaded through worker/hookdir/sitecustomize.py):
    # where it writes each process' recorder summary, and how often
    FR_DIR = "STALWART_FR_DIR"
    FR_PERIOD = "STALWART_FR_PERIOD"
    # "1" in a worker's environment: the worker SDK or an adapter reports this process' steps
    # (`worker.init()` and `worker.attach()` set it in their own process at start), so the
    # start-up hook does not count the optimizer's steps as steps too; a job's environment may
    # set it to switch that counting off
    SDK_STEPS = "STALWART_SDK_STEPS"


# what the command line of a warm worker forked by its machine's fork server ends with while it
# waits for its ranks (`ps` shows the spares); the SDK takes it off at activation
WARM_TITLE_MARK = "  [stalwart: warm, waiting for ranks]"


def run_env(spec: RunSpec) -> dict[str, str]:
    """The environment every worker started for `spec` gets (on top of the machine's own)."""
    lay = spec.layout
    env: dict[str, Any] = dict(spec.user_env)
    env.update({"WORLD_SIZE": lay.world, "LOCAL_WORLD_SIZE": lay.gpus_per_machine,
                Env.JOB: spec.job, Env.TP: lay.tp, Env.PP: lay.pp, Env.DP: lay.dp, Env.CP: lay.cp,
                Env.EP: lay.ep, Env.MACHINES: lay.machines, Env.GPUS_PER_MACHINE: lay.gpus_per_machine,
                Env.STEPS: spec.steps, Env.CKPT_EVERY: spec.ckpt_every, Env.CKPT_DIR: spec.ckpt_dir,
                Env.MEM_SLOTS: spec.mem_slots, Env.REPLAY: int(spec.replay),
                "TORCHELASTIC_RUN_ID": f"stalwart-{spec.job}"})
    if spec.replay:
        env[Env.REPLAY_LAYERS] = spec.replay_layers
    if spec.version is not None:
        env[Env.CODE_VERSION] = spec.version
    if spec.run is not None:
        env.update({Env.RUN: spec.run, Env.RESTORE_STEP: spec.restore_step,
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCHELASTIC_RESTART_COUNT": max(0, spec.run - 1)})   # as torchrun: 0 at the first start
        if spec.master is not None:
            env.update({"MASTER_ADDR": spec.master[0], "MASTER_PORT": spec.master[1]})
    return {k: str(v) for k, v in env.items()}


def rank_env(w: WorkerSlot) -> dict[str, str]:
    """What differs between the workers of one run on one machine."""
    return {"RANK": str(w.rank), "LOCAL_RANK": str(w.local_rank), "GROUP_RANK": str(w.group_rank)}


def python_path(code_path: str | None, inherited: str | None) -> str | None:
    """PYTHONPATH of a worker running a code version's snapshot (the snapshot first)."""
    if not code_path:
        return inherited
    return code_path + (":" + inherited if inherited else "")
