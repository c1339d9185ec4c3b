"""What every flow shares: the job's fixed facts (`Ctx`), a few small derived views, and what one
flow may ask of another.

No flow imports another flow or the job core. `JobCore` builds the flows and gives each exactly
the flows it calls: at construction, or through `connect` right after for the two that call flows
built after them (the failure flow, the hot update). Each is typed by one of the small protocols
below, which name only the methods other flows call: `Incidents`/`Failures` (the failure
flow), `Restarts` (the run), `Detection` (the implicit detectors), `Diagnoses`, `Replays`,
`HotUpdates` and `Standbys` (the pool). Whether the control plane is still being reconciled after a
controller restart is read from the state (`JobState.reconciling`), not asked of a flow."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from stalwart.controller.rules.policy import Resolution, Snapshot
from stalwart.controller.cluster.standby import standby_count
from stalwart.controller.job.actions import Action, Record, UpdateIncident
from stalwart.controller.job.events import ClusterView
from stalwart.controller.job.state import Incident, JobState, PendingStep
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


# -- what one flow may ask of another -----------------------------------------------------------
class Incidents(Protocol):
    """The failure flow, as a detector or the hot update sees it: it opens incidents (and ends a job
    whose training is over)."""

    def open(self, st: JobState, symptom: str, now: float, trace: bool = False) -> Actions:
        """Open an incident and stop the run (with `trace`, capture every machine's stacks first)."""
        ...

    def stop_run(self, st: JobState, now: float) -> Actions:
        """Stop the run of the open incident."""
        ...

    def finish_stuck(self, st: JobState, ranks: list[int], reason: str, now: float) -> Actions:
        """The training ended, but `ranks` are stuck on their way out while the others finished:
        commit the steps their finished peers reported (no collective completes without them) and
        end the job as succeeded."""
        ...


class Failures(Incidents, Protocol):
    """The failure flow, as the run, the diagnosis, the replay and the reconciliation see it."""

    def resolution(self, st: JobState, inc: Incident, now: float, guesses: bool = True) -> Resolution:
        """What the incident's evidence so far says."""
        ...

    def recover(self, st: JobState, inc: Incident, res: Resolution, now: float) -> Actions:
        """Record how the incident was localized and restart (or fail) accordingly."""
        ...

    def finish(self, st: JobState, state: str, reason: str | None, now: float) -> Actions:
        """End the job (succeeded, failed or cancelled)."""
        ...

    def on_machine_lost(self, st: JobState, machine: str, now: float) -> Actions:
        """A machine fell silent."""
        ...

    def check_stopped(self, st: JobState, now: float) -> Actions:
        """While stopping: lost machines, and the recovery once every machine stopped."""
        ...


class Restarts(Protocol):
    """The run flow, as the failure and the hot update flows see it."""

    def restart(self, st: JobState, now: float) -> Actions:
        """A new run on the current slots from the newest step every rank can restore."""
        ...

    def fill_steps(self, st: JobState, ranks: list[int], now: float) -> Actions:
        """Commit, in order, the pending steps every finished rank reported, for `ranks` too."""
        ...


class Detection(Protocol):
    """The implicit detectors (`ImplicitFlow`), as the run and the failure flows see them."""

    def new_run(self, st: JobState, now: float) -> None:
        """A run starts: its signals are judged afresh."""
        ...

    def training_anomaly(self, st: JobState, s: int, acc: PendingStep, now: float) -> Actions | None:
        """A committed step's NaN or jump (None when the step is fine)."""
        ...

    def on_committed(self, st: JobState, acc: PendingStep, now: float) -> Actions:
        """Every rank reported a step, and it was not a training anomaly."""
        ...

    def finish_trace(self, st: JobState, now: float) -> Actions:
        """End a hang's stack capture with what arrived."""
        ...


class Diagnoses(Protocol):
    """The diagnosis flow (stop-time checks), as the failure and the reconcile flows see it."""

    def maybe_diagnose(self, st: JobState, inc: Incident, res: Resolution, now: float) -> Actions | None:
        """Start the checks when `res` needs them; None when it does not."""
        ...

    def start(self, st: JobState, inc: Incident, checks: list[str], now: float) -> Actions:
        """Start the named checks."""
        ...

    def on_lost(self, st: JobState, machine: str, now: float) -> Actions:
        """A machine fell silent during the checks."""
        ...


class Replays(Protocol):
    """The replay flow, as the diagnosis, the failure and the reconcile flows see it."""

    def possible(self, st: JobState) -> tuple[bool, str]:
        """Whether this job's layout admits a dual-phase replay, and why not."""
        ...

    def start(self, st: JobState, inc: Incident, res: Resolution, now: float) -> Actions:
        """Start the replay of the incident."""
        ...

    def on_lost(self, st: JobState, machine: str, now: float) -> Actions:
        """A machine fell silent during the replay."""
        ...

    def restart_phase(self, st: JobState, now: float) -> Actions:
        """Run the current phase again."""
        ...


class HotUpdates(Protocol):
    """The hot update flow, as the run and the failure flows see it."""

    def apply_planned(self, st: JobState, inc: Incident, now: float) -> Actions:
        """A planned restart: the same machines, the new code."""
        ...

    def rollback(self, st: JobState, why: str, now: float) -> Actions:
        """Roll the applied version back (`why`: the reason recorded)."""
        ...

    def apply_due_at_failure(self, st: JobState, inc: Incident, now: float) -> Actions:
        """Lazy updates ride on the restart after a failure."""
        ...

    def promote_if_healthy(self, st: JobState, now: float) -> Actions:
        """Promote the applied version once it has trained healthy long enough."""
        ...


class Standbys(Protocol):
    """The pool flow, as the run, the hot update and the reconcile flows see it."""

    def prewarm(self, st: JobState, machine: str) -> Actions:
        """Pre-spawn the workers of a machine."""
        ...

    def warm_standbys(self, st: JobState) -> Actions:
        """Pre-spawn the workers of the standbys that have none yet."""
        ...
