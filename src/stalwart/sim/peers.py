"""The policies a trace is replayed under: stalwart, stalwart without one mechanism, and peers.

Every policy runs stalwart's own job core (the same flows and rules as the controller) with its
`policy` overrides; what differs is the platform around it, which the simulated machines and
agents play:

- `inspection`: real-time probes (GPU, NIC, disk, kernel log) raise alerts; without them a lost
  GPU or a dead link leaves the workers stuck until a timeout;
- `log_tails`: a crashed worker's last lines reach the classifier (machine-certain CUDA errors,
  OOM, user-code exceptions); without them an exit is only an exit code;
- `tracer`: stacks of every training process on demand (for hangs and slowdowns);
- `checks`: `full` (stalwart's self-test, all-to-all, neighbour all-gather, bitwise alignment),
  `health` (GPU and NIC health only: catches dead hardware, not intermittent faults) or `none`;
- `memory_ckpt`: the every-step in-memory checkpoint with backups on peers; without it restores
  come from the durable tier (every `--durable-every-s`, default 30 min);
- `standby`: warm standby machines; without them an eviction cannot be served in place: the job
  fails and is requeued by the scheduler on healthy machines;
- `hot_update`: code updates applied in place (lazy or urgent); without it every update is a
  requeue of the whole job;
- `restart`: an in-place restart with warm spares (`warm`, profile `restart_s`), an in-job restart
  of cold workers (`cold`, `peer_restart_s`), or a requeue of the whole job (`requeue`,
  `requeue_s`) each time;
- `topology`: the job core sees the machines' switch and pod labels (nearest standby first).

`requeue` and `nvrx-like` are models of those systems built this way (stalwart's core with their
mechanisms switched off), not their code.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

OFF_FAILSLOW = 0.999        # a throughput drop of 99.9%: no slowdown is ever acted on


@dataclass(frozen=True)
class Platform:
    name: str
    about: str
    policy: dict[str, Any] = field(default_factory=dict)
    inspection: bool = True
    log_tails: bool = True
    tracer: bool = True
    checks: str = "full"
    memory_ckpt: bool = True
    standby: bool = True
    hot_update: bool = True
    restart: str = "warm"
    topology: bool = True
    nccl_hang: bool = False     # hangs are noticed at the collective timeout, not by the hang watch
    reschedule: bool = False    # an eviction beyond the warm pool waits for the shortfall's new pods


STALWART = Platform("stalwart", "every mechanism on", reschedule=True)
# ByteRobust as the paper describes it (papers.md 1.4-1.7): a hang is seen when RDMA traffic has been
# zero for 10 minutes (the profile's nccl_timeout_s), its stacks over-evict the parallel group they
# point at (the shortfall beyond the P99 warm pool rescheduled), stop-time checks, reattempt, rollback
# and dual-phase replay, every-step in-memory checkpoints, hot update, warm standby at P99
BYTEROBUST = replace(STALWART, name="byterobust", about="the paper's design: 10-minute zero-traffic hang "
                     "signal, over-eviction with the shortfall rescheduled, stop-time checks, dual-phase "
                     "replay, hot update, warm standby at P99", nccl_hang=True)
_NO_ANALYSIS = {"replay": False, "alignment_test": False, "over_evict": False, "similarity_evict": False,
                "failslow_drop": OFF_FAILSLOW}
POLICIES: dict[str, Platform] = {p.name: p for p in (
    Platform("requeue", "torchrun-style: any failure restarts the whole job from the last durable "
                        "checkpoint; no probes, no localization (the scheduler replaces dead machines)",
             policy={**_NO_ANALYSIS, "stop_time_checks": False}, inspection=False, log_tails=False,
             tracer=False, checks="none", memory_ckpt=False, hot_update=False, restart="requeue",
             topology=False, nccl_hang=True),
    Platform("nvrx-like", "NVRx ft_launcher defaults: in-job restart of every worker from the last durable "
                          "checkpoint, node health checks at restart, no spare nodes (a dead node requeues "
                          "the job), a hang ends at the NCCL timeout; no probes while training, no "
                          "over-eviction, no replay, no hot update",
             policy=dict(_NO_ANALYSIS), inspection=False, log_tails=False, tracer=False, checks="health",
             memory_ckpt=False, hot_update=False, restart="cold", topology=False, standby=False, nccl_hang=True),
    BYTEROBUST,
    STALWART,
    replace(STALWART, name="stalwart-no-standby", about="no warm standbys: an eviction ends the job, "
                                                         "the scheduler requeues it", standby=False),
    replace(STALWART, name="stalwart-no-inmem-ckpt", about="no in-memory checkpoint: restores from the "
                                                         "durable tier", memory_ckpt=False),
    replace(STALWART, name="stalwart-no-over-evict", about="stacks do not evict a group: checks and replay "
                                                           "look for the culprit", policy={"over_evict": False}),
    replace(STALWART, name="stalwart-no-hot-update", about="code updates requeue the job", hot_update=False),
    replace(STALWART, name="stalwart-no-topology", about="standbys taken in the pool's order, not by "
                                                          "switch and pod", topology=False),
)}
DEFAULT = tuple(POLICIES)


def parse(names: str) -> list[Platform]:
    """A comma list of policy names (`all` for every one)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if wanted == ["all"]:
        return list(POLICIES.values())
    unknown = [n for n in wanted if n not in POLICIES]
    if unknown or not wanted:
        raise ValueError(f"unknown policy {', '.join(unknown) or '(none given)'} "
                         f"(known: {', '.join(POLICIES)}, or all)")
    return [POLICIES[n] for n in wanted]
