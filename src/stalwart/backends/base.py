"""The backend interface: what stalwart needs from a cluster.

A backend gives the job's machines: it starts one agent per machine (N active + S standby + P
spare), names them (`m0 … m{K-1}`, the names chaos and the CLI use everywhere; the cluster's own
name of a machine, a Slurm node or a Kubernetes node, travels as a label), tells each agent the
machine's topology labels where the cluster knows them (`switch`, `pod`, `zone`, passed with
`stalwart agent --label`), takes an evicted machine out of the cluster's rotation, asks for a
replacement when the standby pool runs short, says when the cluster took the job's machines away
(a time limit, a preemption, a cancel), and releases everything at the end.

Two processes use one backend object each, built from the same JSON config
(`backends.config.load`):

- the launcher (`stalwart run`, `stalwart slurm submit`) calls `start_agents` and `release`;
- the controller (`stalwart controller --backend-config FILE`) calls `evict` and `request` from
  its job executor (the side effects of a decision, after it is saved) and `ended` from a watcher
  thread. Its calls must not raise for a cluster's refusal: they log and return, the job goes on.

- local: agent processes on this host, started with the cluster. Evict: nothing (the controller's
  role keeps the machine out). Request: none (a fixed cluster refills from its `--spare` machines).
- slurm: the nodes of an `sbatch --no-kill` allocation. Evict: `scontrol update state=drain
  reason=…`. Request: a new single-node allocation.
- kubernetes: one agent pod per node. Evict: cordon and label the node, delete the pod. Request:
  a new agent pod.
"""
from __future__ import annotations

import abc
import fcntl
import json
import os
from typing import Any, Callable, ClassVar

REASON_MAX = 120          # Slurm and Kubernetes show reasons on one line


def drain_reason(incident: int | None, reason: str | None) -> str:
    """What the cluster records for an evicted machine: `stalwart: incident 3: gpu_xid 79 ...`."""
    text = f"stalwart: incident {incident if incident is not None else '-'}: {reason or 'evicted'}"
    text = " ".join(text.split())           # one line
    return text if len(text) <= REASON_MAX else text[:REASON_MAX - 3] + "..."


class Backend(abc.ABC):
    """A cluster that gives stalwart its machines (see the module's doc for who calls what)."""

    kind: ClassVar[str] = ""

    @abc.abstractmethod
    def start_agents(self, controller_url: str, count: int) -> list[str]:
        """Start agents on `count` machines that report to `controller_url`; their names, in
        order (they may take a while to register: an allocation can wait in a queue)."""

    def labels(self, node: str) -> dict[str, str]:
        """The topology labels the cluster knows for one of its nodes (a Slurm node, a Kubernetes
        node: the cluster's own name, which the node's agent wrapper knows), as the agent
        registers with them (`--label`); {} where it knows none."""
        return {}

    @abc.abstractmethod
    def evict(self, machine: str, reason: str, labels: dict[str, str]) -> None:
        """Take the machine out of the cluster's rotation so it is not handed out again.
        `labels` are the ones its agent registered with (they name the cluster's node)."""

    @abc.abstractmethod
    def request(self, count: int) -> list[str]:
        """Ask the cluster for `count` more machines (to refill the standby pool); the names
        their agents will register as, [] where the cluster cannot grow."""

    def ended(self) -> str | None:
        """Why the cluster took the job's machines away (time limit, preemption, a cancel), or
        None while it holds them."""
        return None

    @abc.abstractmethod
    def release(self) -> None:
        """Give every machine back to the cluster and stop every agent this backend started."""


class BackendState:
    """A backend's small state file shared by the launcher and the controller (and a restarted
    controller): its allocations or pods, the next machine index. Read and changed under a lock."""

    def __init__(self, directory: str, defaults: dict[str, Any]):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "state.json")
        self.defaults = defaults

    def read(self, update: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(self.path) as f:
                    st = json.load(f)
            except (OSError, ValueError):
                st = json.loads(json.dumps(self.defaults))
            if update is not None:
                update(st)
                with open(self.path + ".tmp", "w") as f:
                    json.dump(st, f)
                os.replace(self.path + ".tmp", self.path)
            return st

    def take_names(self, count: int) -> list[str]:
        """`count` new machine names, m<next>…, never handed out twice."""
        got: list[int] = []

        def take(st: dict[str, Any]) -> None:
            got.append(int(st.get("next", 0)))
            st["next"] = got[0] + count
        self.read(take)
        return [f"m{got[0] + i}" for i in range(count)]

