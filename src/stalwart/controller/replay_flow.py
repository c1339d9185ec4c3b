"""Dual-phase replay in the job runner (papers.md §1.5.3): when checks found nothing and the failure
came back after a reattempt, replay the job on groups of machines, twice over two partitions, and
evict the one machine that a failing group of each phase shares.

A mixin of `JobRunner` (jobs.py). The planner is `analyzer.replay` (pure). Each group runs the
job's own command from a fresh start with the job's TP and PP, DP = k, for `policy.replay_steps`
steps, as a throw-away run (STALWART_REPLAY=1: no checkpoint is written or read). The job may
shrink its model for the replay: STALWART_REPLAY_LAYERS (= PP, one layer per stage) is the fewest
layers that keep its layout; the SDK exposes it as `ctx.replay_layers` and the bundled GPT uses it. A group fails
when a worker exits non-zero, reports a non-finite loss or gradient norm, or does not finish in time.
"""
from __future__ import annotations

import math
import time

from stalwart.analyzer import replay


class ReplayFlow:
    def _replay_possible(self) -> tuple[bool, str]:
        """Whether this job's layout admits a dual-phase replay, and why not."""
        t, p = self.topo, self.spec.policy
        if not p.replay:
            return False, "disabled by policy.replay"
        if t.tp * t.cp * t.ep != self.G:
            return False, (f"one machine must hold exactly one tensor-parallel group "
                           f"(tp*cp*ep={t.tp * t.cp * t.ep}, {self.G} GPUs per machine)")
        try:
            self._replay_plan()
        except ValueError as e:
            return False, str(e)
        return True, ""

    def _replay_plan(self) -> replay.ReplayPlan:
        t, p = self.topo, self.spec.policy
        k = p.replay_k or replay.choose_k(t.pp, t.dp, len(self.slots))
        return replay.plan(list(self.slots), t.pp, t.dp, k)

    def _start_replay(self, inc: dict, res, now: float) -> None:
        plan = self._replay_plan()
        port = self.ctl.rendezvous.open_scratch(self.job_id, f"replay{inc['id']}")
        self.replay = {"inc": inc, "res": res, "plan": plan, "port": port, "phase": 0,
                       "failed": ([], []), "started": now, "groups": {}}
        self.state = "replaying"
        self.event("replay_started", {"incident": inc["id"], "k": plan.k, "m": plan.m, "n": plan.n,
                                      "horizontal": [list(g) for g in plan.horizontal],
                                      "vertical": [list(g) for g in plan.vertical]}, t=now)
        self._replay_phase(now)

    def _replay_phase(self, now: float) -> None:
        rp = self.replay
        plan, p = rp["plan"], self.spec.policy
        rp["groups"], rp["deadline"] = {}, now + p.replay_timeout_s
        for g, machines in enumerate(plan.phases[rp["phase"]]):
            self.run_seq += 1
            run = self.run_seq
            world = len(machines) * self.G
            env = self._common_env(run, rp["port"])
            env.update({"WORLD_SIZE": world, "STALWART_DP": plan.k, "STALWART_MACHINES": len(machines),
                        "STALWART_STEPS": p.replay_steps, "STALWART_RESTORE_STEP": -1,
                        "STALWART_REPLAY": 1, "STALWART_REPLAY_LAYERS": self.topo.pp})
            rp["groups"][run] = {"group": g, "machines": list(machines), "done": set(),
                                 "world": world, "failed": None}
            for i, m in enumerate(machines):
                workers = self._workers_of(i)
                self.ctl.send(m, {"type": "start", "run": run, "command": self.spec.command,
                                  "cwd": self.code_path, "env": env, "workers": workers, "ckpt": None})

    def _replay_event(self, machine: str, ev: dict) -> None:
        """Step, done and exit events of the replay groups' workers."""
        grp = self.replay["groups"].get(ev.get("run"))
        if grp is None or grp["failed"] is not None or len(grp["done"]) == grp["world"]:
            return
        kind = ev.get("type")
        if kind == "step":
            bad = [k for k in ("loss", "grad_norm") if ev.get(k) is not None and not math.isfinite(ev[k])]
            if bad:
                grp["failed"] = f"rank {ev['rank']} step {ev['step']}: non-finite {' and '.join(bad)}"
        elif kind == "done" or (kind == "worker_exit" and ev.get("code") == 0):
            grp["done"].add(ev.get("rank"))
        elif kind == "worker_exit" and not ev.get("expected"):
            how = f"signal {ev['signal']}" if ev.get("signal") else \
                "an exception" if ev.get("code") is None else f"exit code {ev.get('code')}"
            grp["failed"] = f"rank {ev.get('rank')} on {machine} failed ({how})"
        self._replay_check(time.time())

    def _replay_check(self, now: float) -> None:
        rp = self.replay
        groups = rp["groups"].values()
        if now > rp["deadline"]:
            for grp in groups:
                if grp["failed"] is None and len(grp["done"]) < grp["world"]:
                    grp["failed"] = f"did not finish {self.spec.policy.replay_steps} steps in time"
        if any(grp["failed"] is None and len(grp["done"]) < grp["world"] for grp in groups):
            return
        for run, grp in rp["groups"].items():
            for m in grp["machines"]:
                self.ctl.send(m, {"type": "stop", "run": run})
            if grp["failed"] is not None:
                rp["failed"][rp["phase"]].append(grp["group"])
        phase = ("horizontal", "vertical")[rp["phase"]]
        self.event("replay_phase_done", {"incident": rp["inc"]["id"], "phase": phase,
                                         "failed": {str(g["group"]): g["failed"] for g in groups if g["failed"]}},
                   t=now)
        rp["phase"] += 1
        if rp["phase"] == 1 and rp["plan"].m == 1:
            # one machine per horizontal group: the vertical groups are the same single machines
            rp["failed"] = (rp["failed"][0], list(rp["failed"][0]))
            rp["phase"] = 2
        if rp["phase"] < 2:
            return self._replay_phase(now)
        self._replayed(now)

    def _replayed(self, now: float) -> None:
        rp, self.replay = self.replay, None
        self.ctl.rendezvous.close_scratch(self.job_id, f"replay{rp['inc']['id']}")
        inc, res, plan = rp["inc"], rp["res"], rp["plan"]
        h, v = set(rp["failed"][0]), set(rp["failed"][1])
        found = replay.locate(plan, h, v) if h and v else []
        took = round(now - rp["started"], 3)
        data = {**self._incident_data(inc["id"]),
                "replay": {"k": plan.k, "failed_horizontal": sorted(h), "failed_vertical": sorted(v),
                           "machines": found, "seconds": took}}
        self.store.update_incident(inc["id"], data=data)
        self.event("replay_done", {"incident": inc["id"], "machines": found, "seconds": took}, t=now)
        res.mechanism = "replay"
        if found:
            res.evict, res.suspects = list(found), list(found)
            res.cause = f"{res.cause}; dual-phase replay isolated {', '.join(found)} in {took:.1f}s"
            if len(found) > len(self._snapshot().standby_ready):
                res.mechanism = "fail"
                res.fail_reason = f"dual-phase replay isolated {', '.join(found)} but no standby is ready"
        else:
            res.cause = f"{res.cause}; dual-phase replay reproduced nothing in {took:.1f}s"
        self._recover(inc, res, now)
