"""The warm standby pool while the job runs: keep it at its size (`--standby N|auto`, the P99 of
Binomial(machines, daily failure rate)) by taking idle machines (a spare of the local backend, an
agent that registers later), warming their workers so the next failover does not wait for
`import torch` (from the job's first step on: until then they would slow the first start)."""
from __future__ import annotations

from stalwart.controller.cluster.roles import Role
from stalwart.controller.job.actions import AssignMachine, Prewarm, RequestMachines
from stalwart.controller.job.flows.base import Actions, Ctx, record
from stalwart.controller.job.state import JobState

REFILL_EVERY_S = 1.0
REQUEST_EVERY_S = 5.0     # asks the cluster again at most this often (the controller counts those coming)


class PoolFlow:
    def __init__(self, ctx: Ctx):
        self.ctx = ctx

    def prewarm(self, st: JobState, machine: str) -> Actions:
        st.pool.warm.add(machine)
        keep = set(st.pool.standby) | set(st.slots)
        st.pool.ready = {m: pids for m, pids in st.pool.ready.items() if m in keep and m != machine}
        st.pool.ready[machine] = []
        return [Prewarm(machine=machine, code_path=st.code_path, version=st.version_id)]

    def on_standby_ready(self, st: JobState, machine: str, pid: int | None) -> Actions:
        """A pre-spawned worker (a standby's, or an active machine's spare for the next restart)
        imported everything and waits for its ranks."""
        if pid is None or not (machine in st.pool.warm or machine in st.slots):
            return []
        pids = st.pool.ready.setdefault(machine, [])
        if pid not in pids:
            pids.append(pid)
        return []

    def spares_ready(self, st: JobState) -> list[str]:
        """The active machines whose spare workers all wait at the barrier: the next restart
        there is warm. A run's start uses them up (`RunFlow.start_run`)."""
        return [m for m in st.slots if len(st.pool.ready.get(m, ())) >= self.ctx.G]

    def warm_ready(self, st: JobState) -> list[str]:
        """The standbys whose every worker waits at the barrier: a failover to them is warm."""
        return [m for m in st.pool.standby
                if m in st.pool.warm and len(st.pool.ready.get(m, ())) >= self.ctx.G]

    def warm_standbys(self, st: JobState) -> Actions:
        """Pre-spawn the workers of the standbys that have none yet (not a plain script's: it
        cannot wait at an activation barrier; its standbys start it when they get its ranks)."""
        acts: Actions = []
        if st.script:
            return acts
        for m in [m for m in st.pool.standby if m not in st.pool.warm]:
            acts += self.prewarm(st, m)
        return acts

    def refill(self, st: JobState, now: float) -> Actions:
        if now < st.pool.next_refill:
            return []
        st.pool.next_refill = now + REFILL_EVERY_S
        want = self.ctx.standbys
        for m in [m for m in st.pool.standby if not self.ctx.cluster.alive(m)]:
            st.pool.standby.remove(m)
            st.pool.warm.discard(m)
        short = want - len(st.pool.standby)
        acts: Actions = []
        started = st.best_steps > 0          # the job's first step is done
        if started:
            acts += self.warm_standbys(st)
        # the cluster's free list is as of the last actions carried out: a machine this very tick's
        # start took (or the pool holds) is not free for the pool, whatever the list still says
        free = self.ctx.cluster.free() if short > 0 else []
        taken = set(st.slots) | set(st.pool.standby) if free else set()
        for m in [m for m in free if m not in taken][:max(0, short)]:
            st.pool.standby.append(m)
            acts += [AssignMachine(machine=m, state=Role.STANDBY)] + (
                self.prewarm(st, m) if started and not st.script else [])
            acts.append(record("standby_added", now, machine=m, pool=len(st.pool.standby), want=want))
        short = want - len(st.pool.standby)
        if short > 0 and now >= st.pool.next_request:
            # nothing free: the cluster's backend may provide (a Slurm allocation, a new pod)
            st.pool.next_request = now + REQUEST_EVERY_S
            acts.append(RequestMachines(count=short))
        return acts
