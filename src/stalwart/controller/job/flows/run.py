"""Runs: the first start (enough free machines), each restart (the newest step every rank can
restore), the steps the ranks report (committed when every rank reported), the scheduled chaos,
and the checkpoint copies the agents announce."""
from __future__ import annotations

import logging
from typing import AbstractSet

from stalwart import protocol
from stalwart.controller.rules import scriptsteps
from stalwart.controller.rules.hangwatch import HangWatch
from stalwart.controller.cluster.roles import Role
from stalwart.controller.job.actions import (AddCheckpoint, AssignMachine, CreateRun, Record, RestoreCopies,
                                             SendChaos, StartRun, UpdateIncident, UpdateRun)
from stalwart.controller.job.events import StepReport
from stalwart.controller.job.flows.base import Actions, Ctx, Detection, Failures, HotUpdates, Standbys, record
from stalwart.controller.job.state import BadSteps, ChaosPlan, JobPhase, JobState, PendingStep, RunState

log = logging.getLogger("stalwart.controller")
STEP_TIMES_KEPT = 50
# Every this many committed steps of a run, the step's per-rank step and compute times go into the
# event log (`rank_times`): what `stalwart whatif` replays a finished job's critical path from.
RANK_TIMES_EVERY = 20


class RunFlow:
    def __init__(self, ctx: Ctx, *, failure: Failures, implicit: Detection, pool: Standbys, hotupdate: HotUpdates):
        self.ctx = ctx
        self.failure = failure
        self.implicit = implicit
        self.pool = pool
        self.hotupdate = hotupdate

    # -- the first start ----------------------------------------------------------------------
    def try_start(self, st: JobState, now: float) -> Actions:
        """Waiting: take the machines (and the standbys) once enough are free; after
        `max_standby_wait_s`, start with the active ones alone."""
        spec = self.ctx.spec
        free = self.ctx.cluster.free()
        want = self.ctx.standbys
        waited = now - st.created_at > spec.policy.max_standby_wait_s
        if len(free) < spec.machines + want and not (len(free) >= spec.machines and waited):
            return []
        st.slots = free[:spec.machines]
        st.pool.standby = free[spec.machines:spec.machines + want]
        acts: Actions = [AssignMachine(machine=m, state=Role.ACTIVE) for m in st.slots]
        # standbys warm up once the first step is done (pool.refill): their `import torch` must not
        # compete with the first run's start-up for the machines' (or, locally, the host's) CPUs
        acts += [AssignMachine(machine=m, state=Role.STANDBY) for m in st.pool.standby]
        if st.versioning_off:
            log.info("job %s: hot update off: %s", st.job_id, st.versioning_off)
        return acts + self.start_run(st, -1, RestoreCopies(), now)

    # -- runs -------------------------------------------------------------------------------------
    def start_run(self, st: JobState, restore_step: int, copies: RestoreCopies, now: float) -> Actions:
        """A new run on the slots from `restore_step` (-1: from the start), rank r restoring from
        `copies[r]`, best first."""
        settled = self._settle(st, restore_step)
        if st.script and st.run is not None:
            st.script_unsettled = {s: acc for s, acc in st.run.pending.items() if s > st.run.last_committed}
            st.script_unsettled_run = st.run.seq
        st.run_seq += 1
        start_step = restore_step + 1
        # a plain script has no activation barrier to wait at: no warm workers, no spares (an agent
        # would wait for them to be ready, then start cold)
        warm = [] if st.script else [m for m in st.slots if m in st.pool.warm]
        st.pool.warm -= set(warm)
        for m in st.slots:          # the start takes their waiting workers (standby's or spares)
            st.pool.ready.pop(m, None)
        acts: Actions = [
            StartRun(run=st.run_seq, slots=list(st.slots), restore_step=restore_step, restore=copies,
                     warm=warm, code_path=st.code_path, version=st.version_id, spares=not st.script),
            CreateRun(seq=st.run_seq, start_step=start_step, started_at=now, machines=list(st.slots),
                      restore_step=restore_step),
            record("run_started", now, run=st.run_seq, start_step=start_step, machines=list(st.slots))]
        st.move(JobPhase.RUNNING)
        st.run = RunState(seq=st.run_seq, started_at=now, start_step=start_step, restore_step=restore_step,
                          machines=list(st.slots),
                          hang=HangWatch(self.ctx.policy, ranks=range(self.ctx.world), started_at=now))
        self.implicit.new_run(st, now)
        lost = max(0, st.steps_done - start_step)
        if lost:            # the rolling signals forget the steps this run trains again
            sig = st.signals
            sig.loss_hist, sig.grad_hist = sig.loss_hist[:-lost], sig.grad_hist[:-lost]
        st.steps_done = start_step
        st.progress_at_run_start = st.best_steps
        self._close_bad_steps(st)
        st.avail.forget_after(restore_step)
        return settled + acts

    def _settle(self, st: JobState, restore_step: int) -> Actions:
        """The steps up to the restore step that some rank's report is missing for are done: every
        rank holds a copy of the restore step, made after them. (A lost machine's last reports
        die with it, or with its agent's outbox, where a fast job's wait a moment: `Outbox.PACED`.)
        They are recorded as the reports that came have them; a step nobody reported is not."""
        run = st.run
        if run is None or restore_step < 0:
            return []
        acts: Actions = []
        for s in sorted(x for x in run.pending if run.last_committed < x <= restore_step):
            acts.append(self._step_record(st, s, run.pending.pop(s)))
            st.steps_done = max(st.steps_done, s + 1)
            st.best_steps = max(st.best_steps, st.steps_done)
            run.last_committed = s
        return acts

    @staticmethod
    def _step_record(st: JobState, s: int, acc: PendingStep) -> Record:
        return record("step", acc.t, run=st.run_seq, step=s, dur=acc.dur, loss=acc.loss,
                      grad_norm=acc.grad_norm, tokens=acc.tokens)

    def _close_bad_steps(self, st: JobState) -> None:
        """A run starts from before every bad range: an open range ends at the newest copy held
        now (the bad run's), and lapses once this run's copies have replaced those (its commits
        past the range, plus the memory slots a backup may trail by)."""
        if not st.bad_steps:
            return
        held = st.avail.held_steps()
        for b in st.bad_steps:
            if b.until is None:
                b.hi = min(b.hi, max([s + 1 for s in held if s >= b.lo], default=b.lo + 1))
                b.until = b.hi + self.ctx.policy.mem_slots

    def _lapse_bad_steps(self, st: JobState) -> None:
        st.bad_steps = [b for b in st.bad_steps if b.until is None or st.steps_done <= b.until]

    def restart(self, st: JobState, now: float) -> Actions:
        """A new run on the current slots from the newest step every rank can restore."""
        slots, G = st.slots, self.ctx.G        # (rank r is on machine r // G: `Topology.machine_of`)
        next_machine = [slots[r // G] for r in range(self.ctx.world)]
        alive = {m for m in st.slots if self.ctx.cluster.alive(m)}
        bad = st.bad_step_set(st.avail.held_steps()) if st.bad_steps else frozenset()
        step, cols = st.avail.plan_columns(self.ctx.world, next_machine, alive, bad)
        return self.start_run(st, step, RestoreCopies(step, cols), now)

    # -- steps ------------------------------------------------------------------------------------
    def on_step(self, st: JobState, ev: protocol.Step, now: float) -> Actions:
        run = st.run
        if run is None or ev.run != st.run_seq or st.phase != JobPhase.RUNNING:
            return []
        if ev.step <= run.last_committed:
            # a step this run committed already: a report sent again (an agent resends what it
            # had no ack for after a reconnect), not a new one. (Steps commit in order: a rank
            # reports a step before the next, so a step completes before any later one.)
            return []
        acc = run.pending.get(ev.step)
        if acc is None:
            acc = run.pending[ev.step] = PendingStep()
        acc.ranks.add(ev.rank)
        acc.local[ev.rank] = ev.local_grad_norm
        acc.times[ev.rank] = (ev.dur, ev.compute_s)
        if ev.compute_s is not None:
            acc.timed = True
        if run.hang is not None:
            run.hang.on_step(ev.rank, ev.step, now)     # (received: no other host's clock)
        acc.t = max(acc.t, ev.t)
        acc.dur = max(acc.dur, ev.dur or 0.0)
        if ev.rank == 0 or acc.loss is None:      # rank 0's metrics win; else the first reported
            _take_metrics(acc, ev.loss, ev.grad_norm, ev.tokens)
        if len(acc.ranks) == self.ctx.world:
            return self.commit(st, ev.step, run.pending.pop(ev.step), now)
        return []

    def on_steps(self, st: JobState, rep: StepReport, now: float) -> Actions:
        """One step of many ranks (`StepReport`): what `on_step` does for each in turn, on whole
        columns. The step commits when its last missing rank reports; the ranks listed after that
        one would change nothing (their step is committed), so they are not looked at."""
        run = st.run
        if run is None or rep.run != st.run_seq or st.phase != JobPhase.RUNNING or rep.step <= run.last_committed:
            return []
        ranks = rep.ranks
        acc = run.pending.get(rep.step)
        if acc is None:
            acc = run.pending[rep.step] = PendingStep()
        before = len(acc.ranks)
        new: AbstractSet[int] | range
        whole = not before and isinstance(ranks, range) and ranks.step == 1 and ranks.start == 0 \
            and len(ranks) == self.ctx.world
        if whole:
            # every rank once, the step's first report (the simulator's whole-job report): the step
            # commits below, and a committed step's set of ranks is never read, so none is made
            assert isinstance(ranks, range)
            new, n = ranks, len(ranks)
        else:
            new = set(ranks)
            if len(new) != len(ranks) or not acc.ranks.isdisjoint(new):
                # a rank listed twice or reported already: one by one (the rare case)
                acts: Actions = []
                for one in rep.as_agent_events().items:
                    acts += self.on_step(st, one[1], now)   # type: ignore[arg-type]
                return acts
            # distinct new ranks: the set grows by one per rank, full at the k-th
            k = self.ctx.world - before
            n = k if 0 < k <= len(ranks) else len(ranks)
            if n < len(ranks):
                ranks = ranks[:n]
                new = set(ranks)
            if n == 0:
                return []
            # (a step's first report, the usual one of every rank: its columns become the step's tables)
            if acc.ranks:
                acc.ranks |= new
            else:
                acc.ranks = new
        local: dict[int, float | None] = dict.fromkeys(ranks, rep.local_grad_norm)
        if acc.local:
            acc.local.update(local)
        else:
            acc.local = local
        times: dict[int, tuple[float | None, float | None]]
        if rep.compute_s is None:       # (every rank's times the same pair: one tuple for all)
            times = dict.fromkeys(ranks, (rep.dur, None))
        else:
            times = dict(zip(ranks, zip((rep.dur,) * n, rep.compute_s[:n])))
            acc.timed = acc.timed or rep.compute_s[:n].count(None) < n
        if acc.times:
            acc.times.update(times)
        else:
            acc.times = times
        if run.hang is not None:
            run.hang.on_steps(ranks, rep.step, now)
        acc.t = max(acc.t, rep.t)
        acc.dur = max(acc.dur, rep.dur or 0.0)
        if acc.loss is None or 0 in new:          # rank 0's metrics win; else the first reported
            _take_metrics(acc, rep.loss, rep.grad_norm, rep.tokens)
        if whole or len(acc.ranks) == self.ctx.world:
            return self.commit(st, rep.step, run.pending.pop(rep.step), now)
        return []

    def fill_steps(self, st: JobState, ranks: list[int], now: float) -> Actions:
        """The training ended with `ranks` stuck on their way out (their last reports may never
        come: a process deadlocked holding the interpreter lock writes nothing). A step every
        finished rank reported needed every rank's collectives, so it is theirs too: committed,
        in order, up to the first one a finished rank did not report."""
        run = st.run
        if run is None or not run.done_ranks:
            return []
        acts: Actions = []
        for s in sorted(run.pending):
            acc = run.pending[s]
            if s <= run.last_committed or not run.done_ranks <= acc.ranks:
                break
            acc.ranks |= set(ranks)
            if len(acc.ranks) < self.ctx.world:
                break
            acts += self.commit(st, s, run.pending.pop(s), now)
            if st.phase != JobPhase.RUNNING:
                break
        return acts

    def commit(self, st: JobState, s: int, acc: PendingStep, now: float) -> Actions:
        assert st.run is not None
        acts: Actions = [self._step_record(st, s, acc)]
        first = st.best_steps == 0
        st.steps_done = max(st.steps_done, s + 1)
        st.best_steps = max(st.best_steps, st.steps_done)
        if first:                   # the job trains: the standbys may warm up now
            acts += self.pool.warm_standbys(st)
        if st.bad_steps:
            self._lapse_bad_steps(st)
        st.run.committed += 1
        st.run.last_committed = max(st.run.last_committed, s)
        if st.run.committed % RANK_TIMES_EVERY == 0 and acc.times:
            times = [acc.times.get(r, (None, None)) for r in range(self.ctx.world)]
            acts.append(record("rank_times", acc.t, run=st.run_seq, step=s, step_s=[x[0] for x in times],
                               compute_s=[x[1] for x in times]))
        if acc.loss is not None:
            st.last_loss = acc.loss
        anomaly = self.implicit.training_anomaly(st, s, acc, now)
        if anomaly is not None:
            return acts + anomaly
        acts += self.implicit.on_committed(st, acc, now)
        acts += self.hotupdate.promote_if_healthy(st, now)
        sig = st.signals
        sig.step_times = (sig.step_times + [(acc.t, s)])[-STEP_TIMES_KEPT:]
        sig.committed_at = now
        for seq in st.awaiting_resume:
            acts += [UpdateIncident(seq=seq, fields={"resumed_at": acc.t}),
                     record("incident_resumed", acc.t, incident=seq)]
        st.awaiting_resume.clear()
        return acts + self.fire_chaos(st, now)

    def on_script(self, st: JobState, ev: protocol.Script, now: float) -> Actions:
        """A plain script's step-hook records: its steps, numbered from its own snapshots
        (controller/rules/scriptsteps.py), go where an SDK's step reports go."""
        run = st.run
        if run is None or ev.run != st.run_seq or not 0 <= ev.rank < self.ctx.world:
            return []
        acts: Actions = []
        if not st.script:       # said once: the report shows what is known, not a target it cannot have
            st.script = True
            acts.append(record("script_steps", now, run=st.run_seq, rank=ev.rank))
        records = [[r.kind, r.n, r.t, r.path, r.steps if r.kind == "load" else r.dest] for r in ev.records]
        numbered = scriptsteps.number(run.script, st.script_marks, ev.rank, records)
        base = run.script.base
        if base is not None and st.script_unsettled:
            # the run before ran these, and the snapshot this run resumed from holds them: done, as
            # the reports that came have them (`_settle` for a restore from stalwart's copies)
            for s in sorted(x for x in st.script_unsettled if x < base):
                acc = st.script_unsettled[s]
                acts.append(record("step", acc.t, run=st.script_unsettled_run, step=s, dur=acc.dur, loss=acc.loss,
                                   grad_norm=acc.grad_norm, tokens=acc.tokens))
            st.script_unsettled = {}
        for one in numbered:
            acts += self.on_step(st, protocol.Step(run=ev.run, rank=one.rank, step=one.step, t=one.t, dur=one.dur), now)
        return acts

    def on_done(self, st: JobState, ev: protocol.Done, now: float) -> Actions:
        """An SDK worker finished its last step (it exits right after)."""
        run = st.run
        if run is None or ev.run != st.run_seq or st.phase != JobPhase.RUNNING:
            return []
        run.finished(ev.rank)
        if len(run.done_ranks) == self.ctx.world and st.steps_done >= self.ctx.spec.steps:
            return self.failure.finish(st, "succeeded", None, now)
        return []

    def on_activity(self, st: JobState, ev: protocol.Activity, now: float) -> Actions:
        """Progress without step reports (CPU outside a collective, new collectives): the hang
        timer's evidence for a plain script, and for any rank before its first step. Timed by
        when the controller handles it (the agent's clock is another host's)."""
        run = st.run
        if run is None or run.hang is None or ev.run != st.run_seq or st.phase != JobPhase.RUNNING:
            return []
        world = self.ctx.world
        for r in ev.ranks:
            if 0 <= r < world:
                run.hang.on_activity(r, now)
        for r, count in ev.collectives.items():
            if 0 <= r < world and count >= 0:
                run.hang.on_collectives(r, count, now)
        return []

    def on_hello(self, st: JobState, ev: protocol.Hello) -> Actions:
        """A worker's SDK is up; once every rank of the run is, the run's start-up is recorded
        (the ledger splits the job's start-up into waiting, spawn, import, rendezvous, first step)."""
        run = st.run
        if run is None or ev.run != st.run_seq or ev.rank is None or ev.imported is None or ev.ready is None:
            return []
        if ev.rank in run.hello_ranks:
            return []
        run.hello_ranks.add(ev.rank)
        run.imported_at = max(run.imported_at, ev.imported)
        run.ready_at = max(run.ready_at, ev.ready)
        if len(run.hello_ranks) < self.ctx.world:
            return []
        return [record("workers_ready", run.ready_at, run=run.seq, imported=run.imported_at,
                       ready=run.ready_at)]

    # -- chaos ------------------------------------------------------------------------------------
    def fire_chaos(self, st: JobState, now: float) -> Actions:
        """Send the scheduled faults, armed with their step (agent/armed.py): the agent applies
        one the moment its own ranks completed that many steps, however late the commits here."""
        due = [c for c in st.chaos if c.step is not None]
        acts: Actions = []
        for c in due:
            st.chaos.remove(c)
            acts += self.inject(st, c, now)
        return acts

    def inject(self, st: JobState, c: ChaosPlan, now: float) -> Actions:
        data = {"kind": c.kind, "machine": c.machine, "rank": c.rank, "step": c.step, "params": c.params}
        return [record("chaos_sent", now, **data),
                SendChaos(machine=f"m{c.machine}", kind=c.kind, rank=c.rank,
                          step=c.step if c.step is not None else st.steps_done, params=dict(c.params),
                          at_step=c.step)]

    def on_chaos_applied(self, st: JobState, machine: str, ev: protocol.ChaosApplied, now: float) -> Actions:
        if ev.injected_at is not None:
            st.chaos_applied = (st.chaos_applied + [ev.injected_at])[-100:]
        return [record("chaos_applied", ev.injected_at or now, machine=machine, kind=ev.kind, rank=ev.rank)]

    # -- checkpoints and restores -------------------------------------------------------------------
    def on_ckpt(self, st: JobState, ev: protocol.Ckpt) -> Actions:
        return self.on_ckpts(st, [ev])

    def on_ckpts(self, st: JobState, evs: list[protocol.Ckpt]) -> Actions:
        """Checkpoint reports in order (one, or every rank's report of one checkpoint, at once): a
        durable copy is recorded; a memory copy counts unless a stopped run's, reported late (its
        slots are gone)."""
        acts: Actions = []
        # the copies go into the restore availability one column per run of reports of the same
        # tier and step (every rank's report of one checkpoint: one write)
        key: tuple[str, int] | None = None
        ranks: list[int] = []
        holders: list[str] = []
        for ev in evs:
            if ev.tier == "durable":
                holder = ev.location or ""
                acts.append(AddCheckpoint(step=ev.step, rank=ev.rank, tier=ev.tier, location=holder,
                                          checksum=ev.checksum or "", t=ev.t))
            elif ev.run is None or ev.run == st.run_seq:
                holder = ev.holder or ""
            else:
                continue
            if key != (ev.tier, ev.step):
                if key is not None:
                    st.avail.add_column(key[0], ranks, key[1], holders)
                key, ranks, holders = (ev.tier, ev.step), [], []
            ranks.append(ev.rank)
            holders.append(holder)
        if key is not None:
            st.avail.add_column(key[0], ranks, key[1], holders)
        return acts

    def on_started(self, st: JobState, machine: str, ev: protocol.Started, now: float) -> Actions:
        if ev.run != st.run_seq:
            return []
        if st.run is not None and st.run.hang is not None and machine in st.slots:
            # the hang watch counts these workers' time from their start (not the run's: the
            # agent may have waited for its fork server's preload first); received: no other
            # host's clock
            st.run.hang.on_started(self.ctx.topo.ranks_of_machine(st.slots.index(machine)), now)
        return [record("workers_started", ev.t or now, run=ev.run, machine=machine, warm=bool(ev.warm),
                       preload_s=ev.preload_s)]

    def on_restore_source(self, st: JobState, ev: protocol.RestoreSourceUsed, now: float) -> Actions:
        run = st.run
        if run is None or ev.run != st.run_seq:
            return []
        run.restore_tiers[ev.rank] = ev.tier
        if ev.skipped:
            run.restore_skipped[ev.rank] = list(ev.skipped)
        acts: Actions = []
        if len(run.restore_tiers) == self.ctx.world:
            acts.append(UpdateRun(seq=run.seq, fields={"restore": {
                "step": ev.step, "tiers": {str(r): t for r, t in sorted(run.restore_tiers.items())},
                "skipped": {str(r): e for r, e in sorted(run.restore_skipped.items())}}}))
        return acts + [record("restore_source", ev.t or now, run=run.seq, rank=ev.rank, tier=ev.tier,
                              step=ev.step, skipped=list(ev.skipped))]

    def on_restore_failed(self, st: JobState, ev: protocol.RestoreFailed, now: float) -> Actions:
        if ev.run != st.run_seq:
            return []
        st.bad_steps.append(BadSteps(lo=ev.step, hi=ev.step + 1))
        acts: Actions = [record("restore_failed", ev.t or now, run=st.run_seq, rank=ev.rank, error=ev.error)]
        if st.phase == JobPhase.RUNNING:
            acts += self.failure.open(st, "restore_failed", now)
        return acts

    # -- live status ----------------------------------------------------------------------------
    @staticmethod
    def steps_per_s(st: JobState) -> float | None:
        times = st.signals.step_times
        if len(times) >= 2:
            (t0, s0), (t1, s1) = times[0], times[-1]
            if t1 > t0 and s1 > s0:
                return (s1 - s0) / (t1 - t0)
        return None


def _take_metrics(acc: PendingStep, loss: float | None, grad_norm: float | None, tokens: int | None) -> None:
    """A report's training metrics into the step it belongs to (those it carries)."""
    if loss is not None:
        acc.loss = loss
    if grad_norm is not None:
        acc.grad_norm = grad_norm
    if tokens is not None:
        acc.tokens = tokens
