"""What the jobs ask of the cluster's backend (`backends/base.py`): to evict a machine, and to add
machines when a standby pool is short and none is free. The jobs' `ClusterBackend`
(`job/ports.py`); without a backend (a static set of agents) both do nothing.

An eviction is passed on with the incident as the reason and the labels the agent registered with
(the Slurm node to drain, the Kubernetes node to cordon); only for a machine whose agent proved
its identity where the controller checks identities (`trusted`). A request for machines counts
those asked before and not registered yet, for REQUEST_TTL_S.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from stalwart.controller import clock
from stalwart.backends.base import drain_reason
from stalwart.controller.cluster.machines import Registry
from stalwart.controller.store.db import Store
from stalwart.controller.store.ops import Record

log = logging.getLogger("stalwart.controller")
REQUEST_TTL_S = 600.0     # a machine asked of the backend counts as coming for this long


class Supply:
    def __init__(self, backend: Any, registry: Registry, store: Store, trusted: Callable[[str], bool]):
        """`backend`: a `backends.base.Backend` or None. `trusted(machine)`: whether the cluster
        may be told to act on the machine named so (an identity check)."""
        self.backend = backend
        self.registry = registry
        self.store = store
        self.trusted = trusted
        self._lock = threading.Lock()
        self._requested: dict[str, float] = {}     # machines asked of the backend -> when

    def evict(self, machine: str, reason: str | None, incident: int | None) -> None:
        """A job evicted the machine (its role is already `evicted`): tell the cluster."""
        if self.backend is None:
            return
        if not self.trusted(machine):
            # (draining a Slurm node or cordoning a Kubernetes node named by an agent's labels is
            # for machines that proved who they are, not for any caller of a machine id)
            log.warning("not asking the backend to evict %s: its identity was not verified", machine)
            return
        try:
            self.backend.evict(machine, drain_reason(incident, reason), self.registry.labels(machine))
        except Exception:       # the cluster keeps its own view; the job goes on
            log.exception("the backend could not evict %s", machine)

    def request(self, job_id: int, count: int) -> list[str]:
        """Ask the backend for `count` machines, less those asked before that have not registered
        yet; the names it gave (recorded as the job's `machines_requested` event)."""
        if self.backend is None or count <= 0:
            return []
        now = clock.now()
        with self._lock:
            for m, t in list(self._requested.items()):
                if m in self.registry or now - t > REQUEST_TTL_S:
                    del self._requested[m]
            count -= len(self._requested)
        if count <= 0:
            return []
        try:
            names = self.backend.request(count)
        except Exception:
            log.exception("the backend could not provide %d machine(s)", count)
            return []
        with self._lock:
            self._requested.update({m: now for m in names})
        if names:
            log.info("job %s: asked the cluster for %s", job_id, ", ".join(names))
            self.store.commit(job_id, [Record(kind="machines_requested", t=now,
                                              data={"machines": names, "backend": self.backend.kind})], None)
        return names
