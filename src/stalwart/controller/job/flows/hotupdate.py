"""Hot update: code versions registered by `stalwart update`, applied in place from the in-memory
checkpoint (urgent: now; lazy: at the next failure's restart or when the window expires), rolled
back when they fail, promoted to stable after healthy steps. Before a planned restart every
machine starts spare workers on the new code while training goes on, so the stop itself is short.
The decisions over version rows are the pure functions of `controller.versions`."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from stalwart.controller.code import versions
from stalwart.controller.rules.policy import Mechanism
from stalwart.controller.job.actions import PrepareSpares, SaveVersion, UpdateIncident
from stalwart.controller.job.flows.base import Actions, Ctx, Incidents, Restarts, Standbys, record
from stalwart.controller.job.state import HotUpdatePrep, Incident, IncidentPhase, JobState

log = logging.getLogger("stalwart.controller")


class HotUpdateFlow:
    run: Restarts

    def __init__(self, ctx: Ctx, *, pool: Standbys, failure: Incidents):
        self.ctx = ctx
        self.pool = pool
        self.failure = failure

    def connect(self, *, run: Restarts) -> None:
        """The flows that also call this one, once they are built."""
        self.run = run

    # -- the rows in the state -------------------------------------------------------------------
    def _store(self, st: JobState, rows: list[dict[str, Any]]) -> Actions:
        by_id = {r["id"]: r for r in rows}
        st.versions = [by_id.get(v["id"], v) for v in st.versions]
        return [SaveVersion(row=r) for r in rows]

    def use(self, st: JobState, row: dict[str, Any]) -> Actions:
        """The workers run `row` from the next start on; standbys re-warm on it."""
        moved = st.run_seq > 0 and row["path"] != st.code_path
        st.version_id, st.code_path = row["id"], row["path"]
        acts: Actions = []
        if moved:      # the standbys' warm workers hold the old code: warm them up on this one
            for m in st.pool.standby:
                acts += self.pool.prewarm(st, m)
        return acts

    def on_registered(self, st: JobState, row: dict[str, Any], now: float) -> Actions:
        """`stalwart update` snapshotted a new version (or re-registered a waiting one)."""
        if any(v["id"] == row["id"] for v in st.versions):
            st.versions = [row if v["id"] == row["id"] else v for v in st.versions]
        else:
            st.versions.append(row)
        return [record("version_registered", now, version=row["id"], mode=row["mode"], hash=row["hash"])]

    def apply(self, st: JobState, due: Mapping[str, Any], now: float, reason: str) -> Actions:
        rows = versions.applied_rows(st.versions, due["id"], now, st.steps_done, reason)
        return self._store(st, rows) + self.use(st, rows[0])

    def rollback(self, st: JobState, why: str, now: float) -> Actions:
        old, target = versions.rolled_back_rows(st.versions, why, now)
        return self._store(st, [old]) + self.use(st, target)

    def promote_if_healthy(self, st: JobState, now: float) -> Actions:
        cur = st.version()
        if cur is None or cur["status"] != "applied" or not versions.is_healthy(cur, st.steps_done):
            return []
        row = versions.promoted_row(st.versions, st.steps_done, now)
        if row is None:
            return []
        return self._store(st, [row]) + self.use(st, row)

    # -- spares on the coming version -------------------------------------------------------------
    def update_ready(self, st: JobState, now: float) -> bool:
        """Is a due code version to be applied now? Before it is, every machine of the run starts
        spare workers on it while training goes on, so the restart that applies it is warm; a due
        version waits for them at most `hot_update_prewarm_s`."""
        lead = self.ctx.policy.hot_update_prewarm_s
        due = versions.due_update(st.versions, now, at_failure=False)
        if due is None:
            return False
        p = st.spares
        if p is None or p.version != due["id"] or set(st.slots) <= p.ready:
            return True
        if now - p.sent >= lead:
            log.warning("job %s: spares for version %s not ready on %s after %.0fs; restarting cold",
                        st.job_id, due["id"], sorted(set(st.slots) - p.ready), lead)
            return True
        return False

    def prepare_spares(self, st: JobState, now: float) -> Actions:
        """Start spares for the version that will be applied next, once per version and run."""
        lead = self.ctx.policy.hot_update_prewarm_s
        want = versions.to_prewarm(st.versions, now, lead) if lead > 0 else None
        p = st.spares
        if want is None or (p is not None and p.version == want["id"] and p.run == st.run_seq):
            return []
        st.spares = HotUpdatePrep(version=want["id"], path=want["path"], sent=now, run=st.run_seq)
        return [PrepareSpares(machines=list(st.slots), code_path=want["path"], version=want["id"]),
                record("version_prewarm", now, version=want["id"], machines=list(st.slots))]

    def on_spares_ready(self, st: JobState, machine: str, key: str, now: float) -> Actions:
        p = st.spares
        if p is None or key != p.path or machine in p.ready:
            return []
        p.ready.add(machine)
        # (every slot ready: looked at from the last slot, which the agents, answering in the
        # slots' order, report last; a whole set per answer made a job's warm-up quadratic)
        if all(m in p.ready for m in reversed(st.slots)):
            return [record("version_prewarmed", now, version=p.version, seconds=round(now - p.sent, 3))]
        return []

    def tick(self, st: JobState, now: float) -> Actions:
        """While running: warm spares for a coming version; stop for a due one."""
        if st.version_id is None:
            return []
        acts = self.prepare_spares(st, now)
        if self.update_ready(st, now):
            acts += self.failure.open(st, "hot_update", now)
        return acts

    # -- applying ---------------------------------------------------------------------------------
    def apply_planned(self, st: JobState, inc: Incident, now: float) -> Actions:
        """A planned restart: the same machines, the new code, the in-memory checkpoint."""
        due = versions.due_update(st.versions, now, at_failure=False)
        st.incident = None
        st.awaiting_resume.append(inc.seq)
        acts: Actions = []
        if due is not None:
            acts += self.apply(st, due, now, f"{due['mode']} hot update")
        cur = st.version()
        assert cur is not None
        inc.move(IncidentPhase.RESTARTING)
        acts += [UpdateIncident(seq=inc.seq, fields=dict(
                     mechanism=Mechanism.HOT_UPDATE, localized_at=now, suspects=[],
                     cause=f"hot update to version {cur['id']} ({cur['hash'][:12]}, {cur['mode']})")),
                 record("incident_localized", now, incident=inc.seq, mechanism=Mechanism.HOT_UPDATE),
                 record("version_applied", now, version=cur["id"], incident=inc.seq)]
        return acts + self.run.restart(st, now)

    def apply_due_at_failure(self, st: JobState, inc: Incident, now: float) -> Actions:
        """Lazy updates ride on the restart after a failure."""
        due = versions.due_update(st.versions, now, at_failure=True)
        if due is None:
            return []
        acts = self.apply(st, due, now, f"lazy update at the restart after incident {inc.seq}")
        return acts + [record("version_applied", now, version=due["id"], incident=inc.seq)]

