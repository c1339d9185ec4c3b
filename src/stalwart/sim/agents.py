"""The simulated agents: they answer the job core's commands with the protocol's events after the
profile's durations, and make each fault show the way it shows on a real machine (a worker's exit
with its log tail, a probe's alert, a machine that stops answering, stuck or slow workers, a NaN).

They decide nothing about the job: which machine to evict, whether to check, replay or roll back
is the job core's. What they know is the truth of the simulation (which machine is faulty), and
they tell it only through what a real agent would report: check results (caught with the
profile's recall), stacks, exits, alerts.

They see the simulation that owns them through `World` (the engine's `Sim` is one): its clock and
queue, the truth of the faults, the running training, and the few happenings they cause there.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Protocol

from stalwart import protocol as p
from stalwart.controller.job import actions as a
from stalwart.controller.job import state as S
from stalwart.controller.job.events import StopReport
from stalwart.sim.cluster import SimCluster
from stalwart.sim.config import Segment
from stalwart.sim.failures import Fault, Model
from stalwart.sim.injection import Injection
from stalwart.sim.peers import Platform
from stalwart.sim.training import Training

# what a worker prints when it dies of each kind of fault (the controller's classifier reads it)
TAILS = {
    "gpu": "RuntimeError: CUDA error: unspecified launch failure",
    "gpu_ambiguous": "RuntimeError: CUDA error: an illegal memory access was encountered",
    "ecc": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "disk": "OSError: [Errno 28] No space left on device",
    "oom": "Out of memory: Killed process 4242 (python)",
    "network": "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
    "io": ('Traceback (most recent call last):\n  File "/usr/lib/python3/dist-packages/fsspec/core.py", '
           'line 135, in open\nOSError: [Errno 5] Input/output error'),
}
INTER_ROWS_KEPT = 1 << 18          # passed pair rows kept for reuse (see `Agents.inter_passed`)
PROBE = {  # kind -> (probe, alert kind, profile field of its latency)
    "gpu": ("gpu", "gpu_xid", "detect_gpu_s"), "ecc": ("gpu", "gpu_ecc", "detect_gpu_s"),
    "gpu_lost": ("gpu", "gpu_lost", "detect_gpu_s"), "disk": ("disk", "disk_fault", "detect_disk_s"),
    "kernel": ("kmsg", "kernel_panic", "detect_kernel_s"),
}


def stack(rank: int, fn: str, status: str = "sleeping") -> dict:
    """One worker's tracer record, in py-spy's shape, stuck in `fn`."""
    return {"rank": rank, "role": "worker", "status": status, "pid": 1000 + rank,
            "threads": [{"thread_name": "MainThread", "frames": [
                {"name": fn, "module": "torch.distributed" if fn != "optimizer_step" else "train"},
                {"name": "train_step", "module": "train"}]}]}


class World(Protocol):
    """What the agents read of the simulation and the happenings they cause in it."""
    seed: int
    now: float
    profile: Any                  # the profile's durations, drawn once per name and instant
    platform: Platform
    model: Model
    cluster: SimCluster
    st: S.JobState | None         # the job core's state (what memory holds, the code path)
    seg: Segment | None           # the current submission: answers to an older one are dropped
    training: Training | None
    backed_up_by: list[list[int]]
    injection: Injection          # the truth: the faulty machines, the code versions' bugs
    stuck: bool

    def later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None: ...
    def agent_event(self, machine: str, ev: p.Event, seg: int) -> None: ...
    def agent_events(self, items: list[tuple[str, p.Event]], seg: int) -> None: ...
    def stop_report(self, rep: StopReport, seg: int) -> None: ...
    def report_durable(self, tr: Training) -> None: ...
    def pipeline_slots(self, slot: int) -> list[int]: ...
    def freeze(self, t: float) -> None: ...
    def machine_dies(self, machine: str) -> None: ...
    def slowed(self, machine: str) -> None: ...


class Agents:
    def __init__(self, sim: World):
        self.sim = sim
        self.rng = random.Random(sim.seed ^ 0xA6E)
        self._inter_rows: dict[tuple[int, str], dict[str, Any]] = {}
        # a healthy machine's answer to the checks, per checks and machine, with its place in the
        # ring when it answered (see `checks`)
        self._healthy: dict[tuple[tuple[str, ...], str], tuple[tuple | None, list[dict[str, Any]]]] = {}

    # -- helpers ----------------------------------------------------------------------------------
    def send(self, delay: float, machine: str, ev: p.Event) -> None:
        seg = self.sim.seg.index if self.sim.seg is not None else 0
        self.sim.later(delay, self.sim.agent_event, machine, ev, seg)

    def send_all(self, delay: float, items: list[tuple[str, p.Event]]) -> None:
        """Every machine's answer to one command, arriving together: one happening of the loop
        (not one per machine), delivered to the core one event at a time in the machines' order."""
        if items:
            seg = self.sim.seg.index if self.sim.seg is not None else 0
            self.sim.later(delay, self.sim.agent_events, items, seg)

    def tail(self, key: str) -> str:
        return TAILS.get(key, "") if self.sim.platform.log_tails else ""

    def slot_of(self, machine: str) -> int | None:
        tr = self.sim.training
        return None if tr is None else tr.index.get(machine)

    # -- answers to the core's commands ------------------------------------------------------------
    def stop(self, act: a.StopWorkers) -> None:
        sim, tr = self.sim, self.sim.training
        if act.run is None:
            return
        if tr is not None and act.run == tr.run:
            tr.freeze(sim.now)
            sim.later(0.0, sim.report_durable, tr)
        inv_at = tr.last_done(sim.now) if tr is not None and act.run == tr.run else None
        dt = sim.profile.stop_s
        held = self.held_steps(inv_at)
        machines = tuple(m for m in act.machines if sim.cluster.alive(m))
        if not machines:
            return
        # every machine's inventory as columns: its own rank's steps and those of the ranks whose
        # backup peer it is, the same steps for all (nothing from a machine outside the run)
        slots = [self.slot_of(m) if held is not None else None for m in machines]
        rep = StopReport(run=act.run, t=sim.now + dt, machines=machines,
                         own_ranks=tuple(None if i is None else (i,) for i in slots),
                         backup_ranks=tuple(() if i is None else tuple(sim.backed_up_by[i]) for i in slots),
                         own=tuple(held[0]) if held is not None else (),
                         backup=tuple(held[1]) if held is not None else ())
        seg = sim.seg.index if sim.seg is not None else 0
        sim.later(dt, sim.stop_report, rep, seg)

    def held_steps(self, last: int | None) -> tuple[list[int], list[int]] | None:
        """The steps every machine holds in memory after the run's last step `last`: (own, backup);
        None when memory holds nothing."""
        sim, tr = self.sim, self.sim.training
        if not sim.platform.memory_ckpt or tr is None or last is None or last < tr.start_step:
            return None
        assert sim.st is not None
        own_keep, backup_keep = sim.st.avail.memory.get("own", 3), sim.st.avail.memory.get("backup", 2)
        own = [s for s in range(last - own_keep + 1, last + 1) if s >= tr.start_step]
        back = [s for s in range(last - backup_keep + 1, last + 1) if s >= tr.start_step]
        return own, back

    def trace(self, act: a.TraceStacks) -> None:
        sim = self.sim
        dt = sim.profile.trace_s
        self.send_all(dt, [(m, p.Stacks(run=act.run, records=self.stacks(m), t=sim.now + dt))
                           for m in act.machines if sim.cluster.alive(m)])

    def stacks(self, machine: str) -> list[dict]:
        """The machine's worker stack: a stuck machine sits in its collective, its pipeline peers in
        recv, a slow one still computes; the others wait in the data-parallel all-reduce."""
        sim = self.sim
        i = self.slot_of(machine)
        if not sim.platform.tracer or i is None:
            return []
        fn = "all_reduce"
        tr = sim.training
        for f, where in sim.injection.active_faults():
            if f.kind == "hang" and f.persistent:
                if machine in where:
                    fn = "all_gather"
                elif tr is not None and any(i in sim.pipeline_slots(tr.index[w]) for w in where if w in tr.index):
                    fn = "recv"
            elif f.kind == "slow" and machine in where:
                fn = "forward"
            elif f.kind == "gpu_lost" and machine in where:
                fn = "cudaStreamSynchronize"
        return [stack(i, fn)]

    def checks(self, act: a.RunChecks) -> None:
        sim = self.sim
        dt = sim.profile.checks_s
        out: list[tuple[str, p.Event]] = []
        passed = {c: self.passed(c) for c in act.checks}     # a healthy machine's rows (shared)
        healthy, key = self._healthy, tuple(act.checks)
        ring, n = act.ring, len(act.ring)
        position = {m: i for i, m in enumerate(ring)} if "inter" in act.checks else {}
        for m in act.machines:
            if not sim.cluster.alive(m):
                continue
            bad = self.caught(m, act.checks)
            # a healthy machine answers what it answered the last time it had the same place in
            # the ring (the same neighbours): an eviction changes two machines' pairs, not all
            i = position.get(m)
            place = None if i is None else (n, i, ring[i - 1], ring[(i + 1) % n])
            if bad is None and (got := healthy.get((key, m))) is not None and got[0] == place:
                # (the same rows as the last time: the core copies the rows it keeps, never changes them)
                out.append((m, p.DiagResult(id=act.name, results=got[1], t=sim.now + dt)))
                continue
            results: list[dict[str, Any]] = []
            for c in act.checks:
                if bad is None and c != "inter":
                    results.append(passed[c])
                elif c == "inter" and bad != "inter":
                    results += [self.inter_passed(r, peer) for r, peer, _ in act.pairs_of(m)]
                elif c == "inter":
                    results += [{"check": "inter", "ok": False, "detail": "all-gather timed out", "round": r,
                                 "peer": peer, "measure": {"mbps": 100.0}} for r, peer, _ in act.pairs_of(m)]
                elif c == "align":
                    results.append({"check": "align", "ok": True, "local_rank": 0, "detail": "ok",
                                    "measure": {"digest": "differs" if bad == "align" else "reference"}})
                else:
                    fail = bad == c
                    results.append({"check": c, "ok": not fail, "detail": "failed" if fail else "ok",
                                    "measure": {"gflops": 100.0} if c == "selftest" else {}})
            if bad is None:
                if len(healthy) > INTER_ROWS_KEPT:
                    healthy.clear()
                healthy[(key, m)] = (place, results)
            out.append((m, p.DiagResult(id=act.name, results=results, t=sim.now + dt)))
        self.send_all(dt, out)

    def inter_passed(self, round_: int, peer: str) -> dict[str, Any]:
        """A passed pair test's row with `peer` in round `round_`: one object for every answer that
        names them (the core copies the rows it keeps, it never changes them), as `passed` is for
        the other checks; the pairs stay the same from one incident to the next while the slots do."""
        key = (round_, peer)
        row = self._inter_rows.get(key)
        if row is None:
            if len(self._inter_rows) > INTER_ROWS_KEPT:
                self._inter_rows.clear()
            row = self._inter_rows[key] = {"check": "inter", "ok": True, "detail": "ok", "round": round_,
                                           "peer": peer, "measure": {"mbps": 100.0}}
        return row

    @staticmethod
    def passed(check: str) -> dict[str, Any]:
        """A passed check's row (the `inter` rows name their pair: see `checks`)."""
        if check == "align":
            return {"check": "align", "ok": True, "local_rank": 0, "detail": "ok", "measure": {"digest": "reference"}}
        return {"check": check, "ok": True, "detail": "ok", "measure": {"gflops": 100.0} if check == "selftest" else {}}

    def caught(self, machine: str, checks: list[str]) -> str | None:
        """Which check a faulty machine fails, if it is caught (each fault draws its own luck)."""
        sim = self.sim
        f = sim.injection.bad.get(machine)
        if sim.platform.checks == "none":
            return None
        if f is None:         # a healthy machine fails a check now and then (a flaky test, a busy link)
            fp = sim.model.false_positive
            return "selftest" if fp and "selftest" in checks and self.rng.random() < fp else None
        if sim.platform.checks == "health" and not (f.hard or f.kind == "network"):
            return None
        recall = sim.model.recall.get(f.kind)
        if f.kind == "nan":
            r = sim.profile.align_recall if recall is None else recall
            return "align" if "align" in checks and sim.injection.draw(f) < r else None
        r = sim.profile.checks_recall if recall is None else recall
        if (f.hard and recall is None) or sim.injection.draw(f) < r:
            return "inter" if f.kind == "network" and "inter" in checks else "selftest"
        return None

    def replay(self, act: a.StartReplayGroup) -> None:
        """A replay group reproduces the failure when it holds the faulty machine (a NaN, a crash,
        or a hang that never finishes); else every rank finishes its steps."""
        sim = self.sim
        dt = sim.profile.replay_phase_s
        tr = sim.training
        bug = sim.injection.bugs.get(tr.version) if tr is not None and tr.version is not None else None
        if bug:                 # the code itself fails: in every group
            if bug == "nan":
                self.send(dt, act.machines[0], p.Step(run=act.run, rank=0, step=0, t=sim.now + dt, loss=float("nan")))
            elif bug == "exception":
                self.send(dt, act.machines[0], p.WorkerExit(run=act.run, rank=0, code=1, t=sim.now + dt))
            return
        faulty = [m for m in act.machines if m in sim.injection.bad]
        if not faulty:
            for r, m in enumerate(act.machines):
                self.send(dt, m, p.Done(run=act.run, rank=r, t=sim.now + dt))
            return
        f = sim.injection.bad[faulty[0]]
        r = act.machines.index(faulty[0])
        if f.kind == "nan":
            self.send(dt, faulty[0], p.Step(run=act.run, rank=r, step=0, t=sim.now + dt, loss=float("nan")))
        elif f.kind not in ("hang", "gpu_lost", "network"):
            self.send(dt, faulty[0], p.WorkerExit(run=act.run, rank=r, code=1, log_tail=self.tail("gpu_ambiguous"),
                                                  t=sim.now + dt))

    def spares(self, act: a.PrepareSpares) -> None:
        self.send_all(self.sim.profile.spares_s, [(m, p.SparesReady(key=act.code_path)) for m in act.machines])

    # -- faults showing ---------------------------------------------------------------------------
    def manifest(self, f: Fault, machines: list[str]) -> None:
        """Fault `f` hits `machines` (slots of the running job) now."""
        sim, pr, plat = self.sim, self.sim.profile, self.sim.platform
        tr = sim.training
        now = sim.now
        m = machines[0]
        rank = tr.slots.index(m) if tr is not None and m in tr.slots else 0
        run = tr.run if tr is not None else None
        kind = "io" if f.kind == "storage" else f.kind
        if kind in ("gpu", "ecc", "disk", "crash", "oom", "io") or (kind == "network" and not f.persistent):
            sim.freeze(now)
            key = {"gpu": "gpu_ambiguous" if f.ambiguous else "gpu"}.get(kind, kind)
            code, sig = (-9, 9) if kind == "crash" else (1, None)
            dt = pr.detect_exit_s
            lost = sim.model.tail_missing_share and self.rng.random() < sim.model.tail_missing_share
            self.send(dt, m, p.WorkerExit(run=run, rank=rank, code=code, signal=sig,
                                          log_tail="" if lost else self.tail(key), t=now + dt))
            self.cascade(m, run, now + dt)
        elif kind in ("hang", "gpu_lost", "network"):
            sim.freeze(now)
            sim.stuck = True
        elif kind in ("lost", "kernel"):
            sim.freeze(now)
            lost_at = now + (pr.detect_kernel_s if kind == "kernel" and plat.inspection else 0.0)
            sim.later(lost_at - now, sim.machine_dies, m)
        elif kind == "slow":
            sim.slowed(m)
        elif kind == "nan":
            if tr is not None:
                tr.nan_from = now
        if plat.inspection and kind in PROBE and not f.ambiguous:
            probe, alert, field = PROBE[kind]
            dt = getattr(pr, field)
            self.send(dt, m, p.Health(probe=probe, kind=alert, severity=p.Severity.FATAL, machine_certain=True,
                                      t=now + dt))
        if plat.inspection and kind == "network":
            for x in machines:
                self.alerts(f, x, run, 1)

    def cascade(self, primary: str, run: int | None, after: float) -> None:
        """After a rank's crash the others fail in their next collective: `cascade_ranks` machines
        (the primary's pipeline first, then any) exit with a secondary NCCL error a moment later,
        and the classifier has to find the primary among them."""
        sim, tr = self.sim, self.sim.training
        n = sim.model.cascade_ranks
        if not n or tr is None or primary not in tr.index:
            return
        peers = [tr.slots[j] for j in sim.pipeline_slots(tr.index[primary]) if tr.slots[j] != primary]
        others = peers[:n]
        while len(others) < min(n, len(tr.slots) - 1):
            x = tr.slots[self.rng.randrange(len(tr.slots))]
            if x != primary and x not in others:
                others.append(x)
        for k, x in enumerate(others):
            dt = after - sim.now + 0.5 + 0.01 * k
            self.send(dt, x, p.WorkerExit(run=run, rank=tr.index[x], code=1, log_tail=self.tail("network"),
                                          t=sim.now + dt))

    def alerts(self, f: Fault, machine: str, run: int | None, n: int) -> None:
        """A broken link's NIC alert every probe interval while the machine is in the job (a flap
        alerts once)."""
        sim = self.sim
        dt = sim.profile.detect_network_s
        self.send(dt, machine, p.Health(probe="nic", kind="nic_down", severity=p.Severity.WARN, network=True,
                                        t=sim.now + dt))
        if f.persistent and n < 10:
            sim.later(dt, self._again, f, machine, run, n + 1)

    def _again(self, f: Fault, machine: str, run: int | None, n: int) -> None:
        tr = self.sim.training
        if self.sim.injection.bad.get(machine) is f and tr is not None and tr.run == run and machine in tr.slots \
                and tr.stepping is False:
            self.alerts(f, machine, run, n)

    def bug(self, kind: str, version: int) -> None:
        """The running code version's bug shows."""
        sim, tr = self.sim, self.sim.training
        if tr is None or not tr.stepping:
            return
        if kind == "exception":
            sim.freeze(sim.now)
            tail = ""
            if sim.platform.log_tails and sim.st is not None:     # a traceback in the job's own code
                tail = (f'Traceback (most recent call last):\n  File "{sim.st.code_path}/train.py", line 88, '
                        f'in <module>\nValueError: shapes do not match (version {version})')
            self.send(sim.profile.detect_exit_s, tr.slots[0], p.WorkerExit(
                run=tr.run, rank=0, code=1, log_tail=tail, t=sim.now + sim.profile.detect_exit_s))
        elif kind == "hang":
            sim.freeze(sim.now)
            sim.stuck = True
        else:
            tr.nan_from = sim.now
