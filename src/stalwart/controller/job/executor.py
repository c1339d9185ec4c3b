"""The executor: the only part of the job core with side effects.

It writes every store action of one decision, the machines' new roles and the job's state in one
transaction (the actions are the store's typed operations, `controller/store/ops.py`, passed on
as they are) (write-ahead: a controller killed after it finds the state that goes with what was
sent), and only then sends the agents their commands, built here from the actions with the
rendezvous ports and peer addresses the flows never see. It reaches the rest of the controller
through the interfaces of `job/ports.py` alone (store, agents, machine registry, rendezvous,
backend).

The records of routine progress (a committed step, a step's per-rank times) wait for the next
transaction (at the latest the state's save, within about a second: `runner.SAVE_EVERY_S`)
instead of one transaction each: at ten steps a second a commit per step was a third of the job
thread's time. They are then exactly as durable as the state they go with (a controller killed
meanwhile loses both, and its successor's state says which steps it has the records of).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

from stalwart import protocol as p
from stalwart.controller.job import actions as a
from stalwart.spec.commandline import python_target
from stalwart.controller.job.ports import JobPorts
from stalwart.controller.job.state import JobState
from stalwart.controller.cluster.roles import Role
from stalwart.controller.store.ops import OPS, StoreOp
from stalwart.spec import JobSpec

log = logging.getLogger("stalwart.controller")
ROUTINE_RECORDS = frozenset(("step", "rank_times"))    # event kinds that wait for the next transaction
MAX_DEFERRED = 2000      # ...but never more of them than this
WARM_WAIT_S = 30.0       # a machine with warm spares waits this long for them to be ready
COLD_WAIT_S = 2.0


def command_in(command: list[str], code_path: str | None, code_dir: str | None) -> list[str]:
    """The job's command as its workers run it: in the job's working directory, with its code from
    the code version's snapshot `code_path` (the job's `code_dir` as it was when the version was
    registered). A relative script path (`python train.py`) or executable path (`./train.sh`,
    `.venv/bin/python`) names a file of the job's code: the snapshot's where the snapshot has it
    (a hot update runs the new version's script), else the one in `code_dir` (a virtualenv is not
    part of a snapshot). Made absolute either way, so that the working directory does not matter."""
    out = list(command)
    if not out or not code_dir:
        return out

    def code_file(rel: str) -> str:
        if code_path and os.path.exists(os.path.join(code_path, rel)):
            return os.path.normpath(os.path.join(code_path, rel))
        return os.path.normpath(os.path.join(code_dir, rel))

    exe = out[0]
    if "/" in exe and not os.path.isabs(exe):
        out[0] = code_file(exe)
    target = python_target(out)
    if target is not None and target[1] == "script" and not os.path.isabs(out[target[0]]):
        out[target[0]] = code_file(out[target[0]])
    return out


def safe_path_env(command: list[str], cwd: str | None, code_path: str | None) -> dict[str, str]:
    """`python -m MOD` run outside the snapshot: the interpreter would put the working directory
    first on sys.path, ahead of the snapshot on PYTHONPATH, and import the live code rather than
    the version's; PYTHONSAFEPATH leaves it out (a script's own directory is the snapshot's)."""
    target = python_target(command)
    if target is not None and target[1] == "module" and code_path and cwd != code_path:
        return {"PYTHONSAFEPATH": "1"}
    return {}


class Executor:
    def __init__(self, ports: JobPorts, job_id: int, spec: JobSpec):
        self.ports, self.job_id, self.spec = ports, job_id, spec
        self.topo = spec.topology()
        self.G = spec.gpus_per_machine
        self._deferred: list[StoreOp] = []     # routine records (a.Record) not written yet

    def perform(self, st: JobState, actions: list[a.Action], state_json: bytes | None,
                on_committed: Callable[[], None] | None = None) -> None:
        """Store actions, machine roles and the state in one transaction; then the commands
        (`on_committed` is called between). Routine records (ROUTINE_RECORDS) wait for the next
        transaction, in order. The commit waits as long as the store is away (`Store.patient`)."""
        ops: list[StoreOp] = []
        sends: list[a.Action] = []
        deferred = self._deferred
        for act in actions:
            if isinstance(act, OPS):
                if isinstance(act, a.Record) and act.kind in ROUTINE_RECORDS and not ops:
                    deferred.append(act)
                    continue
                ops.append(act)
            if not isinstance(act, a.STORE_ACTIONS):
                sends.append(act)
        if ops or state_json is not None or len(deferred) >= MAX_DEFERRED:
            self.ports.store.commit(self.job_id, deferred + ops, state_json)
            deferred.clear()
        if on_committed is not None:
            on_committed()
        for act in sends:
            self._act(st, act)

    # -- everything else ---------------------------------------------------------------------------
    def _act(self, st: JobState, act: a.Action) -> None:
        ports, agents = self.ports, self.ports.agents
        if isinstance(act, a.AssignMachine):
            ports.machines.assign(act.machine, act.state, self.job_id, act.reason)
            if act.state == Role.EVICTED:
                ports.backend.evict(act.machine, act.reason, act.incident)
        elif isinstance(act, a.FinishJob):
            # its machines go back to the free pool, its rendezvous stores close
            for m in ports.machines.release(self.job_id, act.machines):
                ports.store.upsert_machine(m, state=Role.IDLE.value, job_id=None)
            ports.rendezvous.close_job(self.job_id)
        elif isinstance(act, a.StartRun):
            self._start_run(act)
        elif isinstance(act, a.StopWorkers):
            for m in act.machines:
                agents.send(m, p.Stop(run=act.run, grace_s=act.grace_s))
        elif isinstance(act, a.Prewarm):
            agents.send(act.machine, p.Prewarm(spec=self.run_spec(None, act.code_path, act.version), count=self.G))
        elif isinstance(act, a.PrepareSpares):
            spec = self.run_spec(None, act.code_path, act.version)
            for m in act.machines:
                agents.send(m, p.Spares(spec=spec, count=self.G))
        elif isinstance(act, a.TraceStacks):
            for m in act.machines:
                agents.send(m, p.Trace(run=act.run))
        elif isinstance(act, a.RunChecks):
            self._run_checks(act)
        elif isinstance(act, a.StartReplayGroup):
            self._start_replay_group(act)
        elif isinstance(act, a.CloseScratch):
            ports.rendezvous.close_scratch(self.job_id, act.name)
        elif isinstance(act, a.RequestMachines):
            ports.backend.request(self.job_id, act.count)
        elif isinstance(act, a.SendChaos):
            agents.send(act.machine, p.Chaos(kind=act.kind, rank=act.rank, step=act.step, params=act.params,
                                             at_step=act.at_step))
        else:
            raise TypeError(f"the executor cannot perform {act!r}")

    def run_spec(self, run: int | None, code_path: str | None, version: int | None, **over: Any) -> p.RunSpec:
        s, t = self.spec, self.topo
        layout = p.Layout(machines=s.machines, gpus_per_machine=self.G, tp=t.tp, pp=t.pp, dp=t.dp, cp=t.cp, ep=t.ep)
        cwd = s.workdir or s.code_dir
        values: dict[str, Any] = dict(
            job=self.job_id, run=run, command=command_in(s.command, code_path, s.code_dir), cwd=cwd,
            user_env={**safe_path_env(s.command, cwd, code_path), **s.env}, layout=layout, steps=s.steps,
            ckpt_every=s.ckpt_every,
            ckpt_dir=self.ports.ckpt_dir, mem_slots=s.policy.mem_slots, version=version,
            code_path=code_path, spares=s.policy.warm_spares)
        values.update(over)
        return p.RunSpec(**values)

    def _slot(self, run_index: int, rank: int, restore: list[p.RestoreSource] | None = None) -> p.WorkerSlot:
        return p.WorkerSlot(rank=rank, local_rank=rank - run_index * self.G, group_rank=run_index,
                            restore=restore or [])

    def _start_run(self, act: a.StartRun) -> None:
        ports = self.ports
        port = ports.rendezvous.open(self.job_id, act.run)
        spec = self.run_spec(act.run, act.code_path, act.version, restore_step=act.restore_step,
                             master=(ports.store_host, port), spares=act.spares and self.spec.policy.warm_spares)
        for i, m in enumerate(act.slots):
            workers = []
            for r in range(i * self.G, (i + 1) * self.G):
                copies = [p.RestoreSource(tier=c.tier, step=c.step, holder=c.holder, location=c.location,
                                          addr=self._addr(c.holder) if c.tier == "backup" else None)
                          for c in act.restore.get(r, [])]
                workers.append(self._slot(i, r, copies))
            backup = None
            if self.spec.machines > 1:
                peer = act.slots[self.topo.backup_machine(i)]
                addr = self._addr(peer)
                backup = p.Backup(machine=peer, addr=addr) if addr else None
            pace = self.spec.backup_every
            ckpt = p.CkptPlan(durable_dir=ports.ckpt_dir, every=self.spec.ckpt_every, backup=backup,
                              key=ports.ckpt_key, backup_every=0 if pace == "auto" else pace)
            ports.agents.send(m, p.Start(spec=spec, workers=workers, ckpt=ckpt,
                                wait_warm_s=WARM_WAIT_S if m in act.warm else COLD_WAIT_S))

    def _addr(self, machine: str | None) -> tuple[str, int] | None:
        return self.ports.machines.peer_addr(machine) if machine else None

    def _run_checks(self, act: a.RunChecks) -> None:
        ports = self.ports
        port = ports.rendezvous.open_scratch(self.job_id, act.name)
        for m in act.machines:
            inter = [{"round": x.round, "peer": x.peer, "rank": x.rank, "port": port, "prefix": x.prefix}
                     for x in act.inter_of(m)]
            ports.agents.send(m, p.Diagnose(id=act.name, checks=list(act.checks), store_host=ports.store_host,
                                   local_world=self.G, intra={"port": port, "prefix": f"{act.name}/{m}/"},
                                   inter=inter, timeout_s=act.timeout_s, env=dict(self.spec.env)))

    def _start_replay_group(self, act: a.StartReplayGroup) -> None:
        ports = self.ports
        port = ports.rendezvous.open_scratch(self.job_id, act.name)
        t = self.topo
        layout = p.Layout(machines=len(act.machines), gpus_per_machine=self.G, tp=t.tp, pp=t.pp, dp=act.dp,
                          cp=t.cp, ep=t.ep)
        spec = self.run_spec(act.run, act.code_path, act.version, layout=layout, steps=act.steps,
                             replay=True, replay_layers=t.pp, restore_step=-1, master=(ports.store_host, port))
        for i, m in enumerate(act.machines):
            workers = [self._slot(i, r) for r in range(i * self.G, (i + 1) * self.G)]
            ports.agents.send(m, p.Start(spec=spec, workers=workers, ckpt=None, wait_warm_s=COLD_WAIT_S))
