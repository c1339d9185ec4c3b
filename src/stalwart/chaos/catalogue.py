"""The chaos catalogue: every fault stalwart can inject, and the `KIND@step=S,machine=M` syntax."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Collection, Sequence

from stalwart.errors import InvalidRequest

# kind -> what it does: `stalwart inject --help` prints it; docs/cli.md has it as a table, chaos/machine.py
# a handler for each (tests/unit/test_chaos_catalogue.py checks all three).
KINDS: dict[str, str] = {
    "crash": "SIGKILL one worker (the given rank, else the machine's first)",
    "machine-down": "kill the machine's agent and all its workers (the machine is lost)",
    "sigstop": "SIGSTOP one worker: a silent hang",
    "freeze": "freeze all the machine's workers in a cgroup freezer (processes in state D)",
    "stage-hang": "the machine's workers block forever inside the pipeline's send/recv from that "
                  "step on (with pp=1: in the data-parallel all-reduce): a stage hung in a "
                  "collective; the processes stay alive and runnable",
    "gpu-xid": "the GPU reports Xid code=N (default 79, fallen off the bus); kernel log line too",
    "gpu-lost": "the GPU disappears (NVML handle errors; workers fail with a CUDA error)",
    "ecc": "an uncorrectable (double-bit) ECC error on the GPU",
    "gpu-hot": "the GPU overheats and throttles: the machine's workers slow down",
    "nic-down": "the machine's NIC goes down (ip link set down; needs root)",
    "nic-flap": "the NIC goes down and up times=N times (needs root)",
    "link-slow": "the machine's link is limited to rate=R (tc tbf, default 1mbit; needs root)",
    "partition": "drop all traffic between this machine and peer=M (nftables; needs root)",
    "disk-full": "the machine's local disk reports no free space",
    "cpu-throttle": "limit the machine's workers to fraction=F of a CPU (cgroup v1 or v2)",
    "nan": "the worker SDK fills that machine's gradients with NaN from that step on",
    "user-error": "the worker raises an exception from the user's code",
    "sdc": "the machine's GPUs silently corrupt arithmetic: no probe sees it, per-rank gradient "
           "norms look fine, the update goes non-finite after the reduction",
}


# Kinds that need root here: network namespaces, tc, nftables, cgroups.
ROOT_KINDS = {"nic-down": "network namespaces", "nic-flap": "network namespaces",
              "link-slow": "network namespaces and tc", "partition": "network namespaces and nftables",
              "freeze": "the cgroup freezer", "cpu-throttle": "cgroup CPU quotas"}


# Kinds that act on a machine's own network: they need machines isolated in network namespaces
# (`stalwart run --isolate-network`); on machines sharing the host's network they would cut the host.
NETWORK_KINDS = frozenset({"nic-down", "nic-flap", "link-slow", "partition"})
ISOLATE_HINT = "start the cluster with `stalwart run --isolate-network` (as root)"


class ChaosError(InvalidRequest):
    """A chaos request that cannot be understood or cannot be applied."""


@dataclass(frozen=True)
class ChaosSpec:
    kind: str
    machine: int
    step: int | None = None
    rank: int | None = None
    params: dict = field(default_factory=dict)

    def machine_id(self) -> str:
        return f"m{self.machine}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "machine": self.machine, "step": self.step, "rank": self.rank,
                "params": dict(self.params)}


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ChaosError(f"unknown chaos kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}")


def parse(text: str) -> ChaosSpec:
    """Parse `KIND@step=S,machine=M[,rank=R][,key=value...]`."""
    m = re.fullmatch(r"\s*([a-z][a-z0-9-]*)\s*(?:@(.*))?", text)
    if not m:
        raise ChaosError(f"cannot parse chaos {text!r}; expected KIND@step=S,machine=M[,rank=R]")
    kind, rest = m.group(1), m.group(2) or ""
    check_kind(kind)
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        if "=" not in part:
            raise ChaosError(f"chaos {text!r}: {part!r} is not key=value")
        k, v = (s.strip() for s in part.split("=", 1))
        fields[k] = v
    ints = {}
    for k in ("step", "machine", "rank"):
        if k in fields:
            try:
                ints[k] = int(fields.pop(k))
            except ValueError:
                raise ChaosError(f"chaos {text!r}: {k} must be an integer") from None
            if ints[k] < 0:
                raise ChaosError(f"chaos {text!r}: {k} must be >= 0")
    if "machine" not in ints:
        raise ChaosError(f"chaos {text!r}: machine=M is required")
    return ChaosSpec(kind=kind, machine=ints["machine"], step=ints.get("step"), rank=ints.get("rank"),
                     params=fields)


def check_runnable(kind: str, euid: int | None = None) -> None:
    """Refuse, with the reason, a kind this host cannot inject (no root)."""
    euid = os.geteuid() if euid is None else euid
    if kind in ROOT_KINDS and euid != 0:
        raise ChaosError(f"chaos {kind} needs root ({ROOT_KINDS[kind]}); this runs as uid {euid}")


def check_isolated(kind: str, isolated: bool) -> None:
    """Refuse a network fault on machines that share the host's network."""
    if kind in NETWORK_KINDS and not isolated:
        raise ChaosError(f"chaos {kind} needs machines with their own network: {ISOLATE_HINT}; here the "
                         f"machines share the host's network, which the fault would cut")


def validate_against(spec: ChaosSpec, machines_total: int, gpus_per_machine: int,
                     active_machines: int, slots: Sequence[str] | None = None,
                     known: Collection[str] | None = None) -> None:
    """Check a chaos request against the cluster: machine exists, rank lives on it, host can do it.

    At submit time the layout is the initial one (machines m0.., the first `active_machines` hold
    the ranks in order). For a running job, `slots` (the machine of each slot, now) and `known`
    (every machine the controller knows) say where ranks live after standbys took over."""
    check_runnable(spec.kind)
    name = f"m{spec.machine}"
    if known is not None:
        if name not in known:
            raise ChaosError(f"chaos {spec.kind}: machine {name} does not exist "
                             f"(machines: {', '.join(sorted(known, key=_machine_order)) or 'none'})")
    elif spec.machine >= machines_total:
        raise ChaosError(f"chaos {spec.kind}: machine {spec.machine} does not exist "
                         f"(machines are m0..m{machines_total - 1})")
    if spec.rank is None:
        return
    slots = list(slots) if slots is not None else [f"m{i}" for i in range(active_machines)]
    if name not in slots:
        raise ChaosError(f"chaos {spec.kind}: machine {name} holds no rank of the job "
                         f"(its machines are {', '.join(slots)})")
    lo = slots.index(name) * gpus_per_machine
    if not lo <= spec.rank < lo + gpus_per_machine:
        raise ChaosError(f"chaos {spec.kind}: rank {spec.rank} does not live on machine "
                         f"{name} (it holds ranks {lo}..{lo + gpus_per_machine - 1})")


def _machine_order(name: str) -> tuple[int, str]:
    return (int(name[1:]) if name[1:].isdigit() else 1 << 30, name)
