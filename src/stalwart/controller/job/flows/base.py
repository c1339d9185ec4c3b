"""What every flow shares: the job's fixed facts (`Ctx`) and a few small derived views."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from stalwart.controller.policy import Snapshot
from stalwart.controller.pool import standby_count
from stalwart.controller.job.actions import Action, Record, UpdateIncident
from stalwart.controller.job.events import ClusterView
from stalwart.controller.job.state import Incident, JobState
from stalwart.spec import JobSpec, Policy
from stalwart.topology import Topology


@dataclass(frozen=True)
class Ctx:
    """The job's fixed facts and the machines' view; flows hold nothing else."""
    spec: JobSpec
    topo: Topology
    cluster: ClusterView

    @classmethod
    def of(cls, spec: JobSpec, cluster: ClusterView) -> "Ctx":
        return cls(spec=spec, topo=spec.topology(), cluster=cluster)

    @cached_property
    def standbys(self) -> int:
        """The standby pool's size (the P99 sizing needs scipy: computed once, not every refill)."""
        return standby_count(self.spec)

    @cached_property
    def stages(self) -> list[int]:
        """The pipeline stage of every rank (the topology never changes: computed once)."""
        return [self.topo.coords(r)["pp"] for r in range(self.topo.world_size)]

    @property
    def G(self) -> int:
        return self.spec.gpus_per_machine

    @property
    def world(self) -> int:
        return self.topo.world_size

    @property
    def policy(self) -> Policy:
        return self.spec.policy

    def placement_group(self, slot: int) -> list[int]:
        """The slots of the parallel group a replacement for `slot` should stay near (`placement`):
        its pipeline when the job has one (send/recv suffers most from crossing switches), else its
        data-parallel group; `slot` itself first."""
        t = self.topo
        kind = "pp" if t.pp > 1 else "dp"
        slots = sorted({r // self.G for r in t.group(kind, slot * self.G)} - {slot})
        return [slot] + slots

    def ready_standbys(self, st: JobState) -> tuple[str, ...]:
        """Standbys that can take ranks now (their agent is heard from)."""
        return tuple(m for m in st.pool.standby if self.cluster.alive(m))

    def snapshot(self, st: JobState) -> Snapshot:
        p = self.policy
        return Snapshot(active=tuple(st.slots), standby_ready=self.ready_standbys(st),
                               restarts_without_progress=st.restarts_without_progress,
                               max_restarts_without_progress=p.max_restarts_without_progress,
                               network_alert_count=p.network_alert_count,
                               network_alert_window_s=p.network_alert_window_s,
                               recent_alerts=tuple(st.alerts))


def record(kind: str, t: float, /, **data) -> Record:
    return Record(kind=kind, data=data, t=t)


def save_data(inc: Incident) -> UpdateIncident:
    """The open incident's data (analysis, stacks, checks, replay) as its row holds it."""
    return UpdateIncident(seq=inc.seq, fields={"data": dict(inc.data)})


Actions = list[Action]
