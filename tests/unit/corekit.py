"""A job core on a fake clock with fake machines: feed it events, read the actions it returns.

No process, socket or database: `Harness` plays the controller's registry (which machines are
alive and free) and the agents (the events a test sends on their behalf).
"""
from __future__ import annotations

import math

from stalwart import protocol as p
from stalwart.controller.job import actions as a
from stalwart.controller.job import state as S
from stalwart.controller.job.core import JobCore
from stalwart.controller.job.events import AgentEvent, JobEvent, Tick
from stalwart.controller.rules.restore import Availability
from stalwart.spec import JobSpec

T0 = 1_000_000.0


class FakeCluster:
    """The machines: alive, when last heard, free (idle) ones in order."""

    def __init__(self, machines: list[str], clock: "Harness"):
        self.machines = list(machines)
        self.dead: set[str] = set()
        self.busy: set[str] = set()
        self.heard: dict[str, float] = {}      # when a machine was last heard, if not just now
        self.late = 0.0                        # the heartbeat lateness the host has shown
        self.tags: dict[str, dict[str, str]] = {}    # topology labels, if any
        self.clock = clock

    def alive(self, machine: str) -> bool:
        return machine in self.machines and machine not in self.dead

    def last_heard(self, machine: str) -> float | None:
        if machine in self.heard:
            return self.heard[machine]
        return None if machine in self.dead else self.clock.now

    def freshest(self, machines):
        return max((t for t in map(self.last_heard, machines) if t is not None), default=None)

    def unheard_since(self, machines, t):
        heard = {m: self.last_heard(m) for m in machines}
        return {m: h for m, h in heard.items() if h is None or h <= t}

    def beat_late_s(self) -> float:
        return self.late

    def free(self) -> list[str]:
        return [m for m in self.machines if m not in self.busy and m not in self.dead]

    def labels(self, machine: str) -> dict[str, str]:
        return dict(self.tags.get(machine, {}))


class Harness:
    def __init__(self, machines: int = 2, gpus: int = 2, standby: int | str = 1, steps: int = 50, spare: int = 0,
                 versions: list[dict] | None = None, **spec):
        policy = spec.pop("policy", {})
        self.spec = JobSpec.from_dict({"name": "t", "machines": machines, "gpus_per_machine": gpus,
                                       "steps": steps, "standby": standby, "command": ["python", "train.py"],
                                       "code_dir": "/code", "policy": policy, **spec})
        self.now = T0
        pool = standby if isinstance(standby, int) else 0        # "auto": the spares make the pool
        self.cluster = FakeCluster([f"m{i}" for i in range(machines + pool + spare)], self)
        self.core = JobCore(self.spec, self.cluster)
        self.st = S.JobState(job_id=1, created_at=T0, avail=Availability(memory={"own": 3, "backup": 2}),
                             versions=list(versions or []))
        if versions:
            self.st.version_id, self.st.code_path = versions[0]["id"], versions[0]["path"]
        else:
            self.st.code_path = "/code"
        self.log: list[a.Action] = []

    # -- driving ---------------------------------------------------------------------------------
    def _apply(self, acts: list[a.Action]) -> list[a.Action]:
        for act in acts:
            if isinstance(act, a.AssignMachine):
                if act.state == "idle":
                    self.cluster.busy.discard(act.machine)
                else:
                    self.cluster.busy.add(act.machine)
        # every state is saved and reloaded as the controller would after a restart: exact
        saved = S.dumps(self.st)
        assert S.dumps(S.loads(saved)) == saved
        self.log += acts
        return acts

    def event(self, ev: JobEvent) -> list[a.Action]:
        return self._apply(self.core.handle(self.st, ev, self.now))

    def agent(self, machine: str, ev: p.Event) -> list[a.Action]:
        return self.event(AgentEvent(machine=machine, event=ev))

    def tick(self, dt: float = 0.2) -> list[a.Action]:
        self.now += dt
        return self.event(Tick())

    def advance(self, seconds: float, every: float = 0.2) -> list[a.Action]:
        out: list[a.Action] = []
        end = self.now + seconds
        while self.now < end:
            out += self.tick(every)
        return out

    # -- what agents would say ------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.spec.machines * self.spec.gpus_per_machine

    def machine_of(self, rank: int) -> str:
        return self.st.slots[rank // self.spec.gpus_per_machine]

    def step(self, dur: float = 0.1, loss: float | None = None, compute: dict[int, float] | None = None,
             local: dict[int, float] | None = None, skip: set[int] = frozenset()) -> list[a.Action]:
        """Every rank (but `skip`) reports the next step."""
        s = self.st.steps_done
        self.now += dur
        out: list[a.Action] = []
        loss = 2.0 - 0.01 * s if loss is None else loss
        for r in range(self.world):
            if r in skip:
                continue
            comp = (compute or {}).get(r, dur / 2)
            out += self.agent(self.machine_of(r), p.Step(
                run=self.st.run_seq, rank=r, step=s, t=self.now, dur=dur, loss=loss, grad_norm=1.0,
                local_grad_norm=(local or {}).get(r, 1.0), compute_s=comp))
        out += self.tick(0.0)
        return out

    def steps(self, n: int, **kw) -> list[a.Action]:
        out: list[a.Action] = []
        for _ in range(n):
            out += self.step(**kw)
        return out

    def ckpt(self, step: int) -> None:
        """Every rank's own and backup copies of `step` (as the agents report them)."""
        for r in range(self.world):
            m = self.machine_of(r)
            other = next(x for x in self.st.slots if x != m) if len(self.st.slots) > 1 else m
            self.agent(m, p.Ckpt(run=self.st.run_seq, rank=r, step=step, tier="own", holder=m))
            self.agent(m, p.Ckpt(run=self.st.run_seq, rank=r, step=step, tier="backup", holder=other))

    def stopped(self, machines: list[str] | None = None) -> list[a.Action]:
        out: list[a.Action] = []
        for m in machines if machines is not None else list(self.st.slots):
            out += self.agent(m, p.Stopped(run=self.st.run_seq))
        return out

    def nan_twice(self) -> list[a.Action]:
        """Three steps, then a NaN nobody is blamed for, the reattempt, and the NaN again: the
        actions of the second (a dual-phase replay's first phase, where the policy allows one)."""
        self.steps(3)
        for attempt in range(2):
            self.step(loss=math.nan)
            self.stopped()
            acts = self.advance(2.0)
            if attempt == 0:
                self.steps(2)
        return acts

    def diag(self, checks: a.RunChecks, bad: dict[str, str] | None = None) -> list[a.Action]:
        """Every machine answers the checks: all pass but the self-test of the `bad` ones."""
        out: list[a.Action] = []
        for m in checks.machines:
            ok = m not in (bad or {})
            results = [{"check": "selftest", "ok": ok, "detail": (bad or {}).get(m, "ok"),
                        "measure": {"gflops": 10.0}},
                       {"check": "intra", "ok": True, "detail": "ok", "measure": {}}]
            results += [{"check": "inter", "ok": True, "detail": "ok", "round": x.round, "peer": x.peer,
                         "measure": {"mbps": 100.0}} for x in checks.inter_of(m)]
            out += self.agent(m, p.DiagResult(id=checks.name, results=results))
        return out


def of(acts: list[a.Action], kind: type) -> list:
    return [x for x in acts if isinstance(x, kind)]


def records(acts: list[a.Action], kind: str) -> list[dict]:
    return [x.data for x in acts if isinstance(x, a.Record) and x.kind == kind]


def kinds(acts: list[a.Action]) -> list[str]:
    """A readable sequence: action type names, records by their kind."""
    return [f"Record:{x.kind}" if isinstance(x, a.Record) else type(x).__name__ for x in acts]


NAN = math.nan
