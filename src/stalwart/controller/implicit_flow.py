"""Implicit failures in the job runner: hangs (stacks from every machine) and training anomalies.

A mixin of `JobRunner` (jobs.py): the pure parts are `hangwatch` (calibrated timeouts, anomaly
rules) and `implicit` (stack aggregation to an eviction); this is the part that talks to agents.
"""
from __future__ import annotations

import time

from stalwart.controller import implicit
from stalwart.controller.hangwatch import anomaly, culprit_machines

ABNORMAL_STATES = ("stopped", "disk-sleep", "tracing-stop")  # a worker stuck by the machine itself


class ImplicitFlow:
    def _training_anomaly(self, s: int, acc: dict) -> bool:
        """NaN/inf or a jump >= loss_jump_factor in loss or grad norm: suspend and open an incident.
        The ranks whose LOCAL gradient norm (before the data-parallel reduction) is not finite
        name the machine that corrupted the update."""
        loss, gn = acc.get("loss"), acc.get("grad_norm")
        if loss is None:
            return False
        reason = anomaly(self.loss_hist + [loss], self.grad_hist + ([gn] if gn is not None else []) or None,
                         self.spec.policy.loss_jump_factor)
        if reason is None:
            self.loss_hist = (self.loss_hist + [loss])[-50:]
            if gn is not None:
                self.grad_hist = (self.grad_hist + [gn])[-50:]
            return False
        local = {r: v for r, v in acc.get("local", {}).items() if v is not None}
        culprits = [self.slots[i] for i in culprit_machines(local, self.topo)] if local else []
        self.bad_steps.update(range(s, s + 10_000))        # never restore the corrupted state
        self._open_incident("nan" if "nan" in reason.lower() or "inf" in reason.lower()
                            else "loss_spike", acc["t"])
        self.incident.update(implicit_evict=culprits, reason=reason + (
            f"; non-finite local gradients on {', '.join(culprits)}" if culprits else ""))
        return True

    def _agent_stacks(self, machine: str, ev: dict) -> None:
        if self.state != "tracing" or ev.get("run") != self.run_seq:
            return
        self.incident["stacks"][machine] = ev.get("records", [])
        self.incident["trace_wait"].discard(machine)
        if not self.incident["trace_wait"]:
            self._finish_trace(time.time())

    def _finish_trace(self, now: float) -> None:
        """Stacks are in: single out the stuck machines (a stopped/frozen worker names its machine
        outright; otherwise group the stacks and over-evict the outliers' parallel group)."""
        inc = self.incident
        stacks = inc["stacks"]
        odd = sorted({rec["rank"] for recs in stacks.values() for rec in recs
                      if rec.get("role") == "worker" and rec.get("status") in ABNORMAL_STATES})
        if odd:
            machines = [self.slots[i] for i in self.topo.machines_of(odd)]
            reason = f"rank(s) {odd} stopped or frozen on {', '.join(machines)}"
        elif stacks:
            d = implicit.decide_hang(stacks, self.topo, list(self.slots))
            machines, reason = list(d.machines), d.reason
        else:
            machines, reason = [], "no machine answered the stack capture"
        inc.update(implicit_evict=machines, reason=f"{inc.get('reason', 'hang')}; {reason}")
        self.store.update_incident(inc["id"], data={"stacks": stacks, "analysis": inc["reason"]})
        self.event("incident_traced", {"incident": inc["id"], "machines": machines}, t=now)
        self._stop_run(now)

