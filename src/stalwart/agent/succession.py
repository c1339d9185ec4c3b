"""An agent's side of a restart: what it notes for a successor, and what it takes over from a
predecessor (the decision itself is `agent/adopt.py`'s, pure).

`Succession.save` writes `<workdir>/workers.json` whenever what the agent runs changes.
`Succession.take_over`, before the first registration, reads it and either adopts the run's
workers (the agent's run, job and checkpoint plan become the predecessor's, its worker set
watches them) or stops the live leftovers and reports each recorded rank as ended, with the
reason, so that the controller recovers the run as from a crash.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import msgspec

from stalwart import protocol as p
from stalwart.agent import adopt
from stalwart.agent.adopt import AdoptedProcess
from stalwart.agent.ckpt import CkptManager
from stalwart.agent.forkclient import ForkedProcess, ForkServers
from stalwart.agent.workers import WorkerSet, kill_tree, tail

log = logging.getLogger("stalwart.agent")


class Taken(msgspec.Struct, frozen=True):
    """What an agent took over: the run it now runs (and the command that started it), or only
    the job whose memory it holds."""
    job: int | None
    run: int | None
    start: p.Start | None


class Succession:
    def __init__(self, workdir: str, machine_id: str, exits_dir: str, forks: ForkServers, workers: WorkerSet,
                 ckpt: CkptManager, emit: Callable[[p.Event], None]):
        self.workdir, self.machine_id, self.exits_dir = workdir, machine_id, exits_dir
        self.forks, self.workers, self.ckpt, self.emit = forks, workers, ckpt, emit
        self._old_servers: tuple[tuple[int, int], ...] = ()   # a predecessor's fork servers keeping adopted workers

    def save(self, job: int | None, run: int | None, start: p.Start | None) -> None:
        """Note what this agent runs in its work directory, for a successor to adopt."""
        records = []
        for w in list(self.workers.workers):
            if w.rank is None:
                continue
            records.append(adopt.WorkerRecord(
                pid=w.proc.pid, rank=w.rank, local_rank=w.local_rank,
                start_ticks=adopt.start_ticks(w.proc.pid) or 0, out_path=w.out_path, err_path=w.err_path,
                forked=isinstance(w.proc, (ForkedProcess, AdoptedProcess))))
        servers = tuple((pid, t) for pid in self.forks.server_pids() if (t := adopt.start_ticks(pid)))
        servers += tuple(s for s in self._old_servers if adopt.start_ticks(s[0]) == s[1])
        try:
            adopt.save(self.workdir, adopt.AgentState(
                machine=self.machine_id, agent_pid=os.getpid(), job=job, run=run if records else None,
                workers=tuple(records), start=p.encode(start) if start is not None and records else None,
                fork_servers=servers))
        except OSError as e:
            log.warning("could not note the workers in %s: %s (a restarted agent will not adopt them)",
                        self.workdir, e)

    def take_over(self) -> Taken | None:
        """Take over the workers a predecessor on this work directory left running, or stop them,
        saying why. None: no predecessor's record, or another machine's."""
        t0 = time.monotonic()
        state = adopt.load(self.workdir)
        decision = adopt.decide(state, self.machine_id, adopt.live_of(state))
        adopted = {w.pid for w in decision.adopt}
        strays = set(decision.strays)
        servers = tuple((pid, t) for pid, t in (state.fork_servers if state else ()) if adopt.start_ticks(pid) == t)
        for pid, _ in servers:         # (spares, checks: what no successor adopts)
            strays |= set(adopt.children(pid)) - adopted
        threads = [threading.Thread(target=kill_tree, args=(pid,), daemon=True) for pid in sorted(strays)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        recorded = {w.pid for w in state.workers} if state else set()
        if os.path.isdir(self.exits_dir):
            for name in os.listdir(self.exits_dir):
                if not name.isdigit() or int(name) not in recorded:
                    os.unlink(os.path.join(self.exits_dir, name))
        if state is None:
            return None
        if not decision.adopt:
            (log.warning if state.workers else log.info)(
                "adopting no workers: %s%s", decision.reason,
                f" (stopped {len(strays)} leftover process(es))" if strays else "")
            if state.machine != self.machine_id:
                return None
            if state.run is not None:
                self._take_plan(state)
                self._report_lost(state, decision.reason)
            # (its checkpoint memory is that job's: the run's restart restores from it)
            return Taken(job=state.job, run=None, start=None)
        assert state.run is not None
        self._old_servers = servers
        start = None
        try:
            start = msgspec.convert(state.start, p.Start) if state.start is not None else None
        except msgspec.ValidationError as e:     # (another version's record: no spares, no backups)
            log.warning("the adopted run's command is unreadable (%s): no checkpoint plan, no spares", e)
        self._configure(start)
        self.ckpt.adopt_run(state.run)
        self.workers.take(list(decision.adopt), state.run, self.exits_dir)
        log.info("%s (in %.3fs)", decision.reason, time.monotonic() - t0)
        return Taken(job=state.job, run=state.run, start=start)

    def _configure(self, start: p.Start | None) -> None:
        """Take up the run's checkpoint plan: where durable copies go, how often, the backup peer."""
        plan = start.ckpt if start is not None and not start.spec.replay else None
        if plan is not None:
            backup = {"machine": plan.backup.machine, "addr": list(plan.backup.addr)} \
                if plan.backup is not None else None
            self.ckpt.configure(plan.durable_dir, plan.every, backup, bytes.fromhex(plan.key) if plan.key else None,
                                backup_every=plan.backup_every, mem_slots=start.spec.mem_slots)

    def _take_plan(self, state: adopt.AgentState) -> None:
        """A run whose workers died with the agent away: its newest durable copies, which the
        predecessor may have made without its report leaving, are reported again (the restart
        restores from memory when memory holds a newer step)."""
        try:
            start = msgspec.convert(state.start, p.Start) if state.start is not None else None
        except msgspec.ValidationError:
            return
        self._configure(start)
        if start is not None and start.ckpt is not None and start.ckpt.durable_dir:
            self.ckpt.announce_durable(sorted({w.rank for w in state.workers}))

    def _report_lost(self, state: adopt.AgentState, reason: str) -> None:
        """The recorded ranks not adopted have ended: one `worker_exit` each (the code their fork or
        exec server noted, else killed), so the controller recovers the run as from a crash."""
        for w in state.workers:
            try:
                with open(os.path.join(self.exits_dir, str(w.pid))) as f:
                    code = int(f.read().strip())
            except (OSError, ValueError):
                code = adopt.UNKNOWN_EXIT
            self.emit(p.WorkerExit(run=state.run, rank=w.rank, local_rank=w.local_rank, code=code,
                                   signal=-code if code < 0 else None, expected=False, pid=w.pid,
                                   log_tail="" if code == 0 else
                                   f"{tail(w.err_path, 4096)}\n[the agent restarted and adopted no workers: {reason}]"))
