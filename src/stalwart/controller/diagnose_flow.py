"""Stop-time diagnostics in the job runner: run the checks the ladder asks for on every machine,
read their verdict, and pick the next rung (evict, reattempt, roll back, replay).

A mixin of `JobRunner` (jobs.py). The pure parts are `ladder` (which checks, what the results mean,
which rung) and `stalwart.diag.pairs`; the agents run `stalwart.diag.worker` (agent/diagnose.py).
"""
from __future__ import annotations

import time

from stalwart.controller import ladder, versions
from stalwart.diag.pairs import pair_rounds

DIAG_GRACE_S = 15.0      # start-up of the check processes (torch import) on top of their bounds
# (the agent kills its check processes at START_GRACE_S + bound x (2 + rounds); we wait 5 s more)


class DiagnoseFlow:
    def _maybe_diagnose(self, inc: dict, res, now: float) -> bool:
        """Start stop-time checks when `res` found no machine to blame; True when they started
        (the incident then continues in `_diagnosed`)."""
        if res.mechanism != "reattempt" or res.evict:
            return False
        p = self.spec.policy
        checks = ladder.checks_for(res.symptom, res.category, len(self.slots), p.stop_time_checks,
                                   p.alignment_test)
        if not checks and not self._replay_possible()[0]:
            return False
        self.diag_seq = getattr(self, "diag_seq", 0) + 1
        name = f"diag{self.diag_seq}"
        port = self.ctl.rendezvous.open_scratch(self.job_id, name) if checks else None
        pairs: dict[tuple, tuple] = {}
        inter: dict[str, list] = {m: [] for m in self.slots}
        if "inter" in checks:
            for r, round_pairs in enumerate(pair_rounds(len(self.slots))):
                for i, j in round_pairs:
                    a, b = self.slots[i], self.slots[j]
                    key = (r, a, b)
                    pairs[key] = (i, j)
                    prefix = f"{name}/r{r}/{a}-{b}/"
                    inter[a].append({"round": r, "peer": b, "rank": 0, "port": port, "prefix": prefix})
                    inter[b].append({"round": r, "peer": a, "rank": 1, "port": port, "prefix": prefix})
        bound = p.diag_timeout_s
        rounds = len({k[0] for k in pairs}) or 1
        self.diag = {"name": name, "inc": inc, "res": res, "checks": checks, "pairs": pairs,
                     "wait": set(self.slots) if checks else set(), "results": [], "started": now,
                     "deadline": now + DIAG_GRACE_S + bound * (2 + rounds) + 5.0}
        self.state = "diagnosing"
        self.event("checks_started", {"incident": inc["id"], "checks": checks}, t=now)
        for m in self.diag["wait"]:
            self.ctl.send(m, {"type": "diagnose", "id": name, "checks": checks,
                              "store_host": self.ctl.store_host, "local_world": self.G,
                              "intra": {"port": port, "prefix": f"{name}/{m}/"},
                              "inter": inter[m], "timeout_s": bound,
                              "env": self._common_env(run=None, port=None)})
        if not checks:
            self._diagnosed(now)
        return True

    def _agent_diag_result(self, machine: str, ev: dict) -> None:
        d = getattr(self, "diag", None)
        if d is None or ev.get("id") != d["name"] or machine not in d["wait"]:
            return
        for r in ev.get("results", []):
            r = dict(r, machine=machine)
            if r.get("check") == "inter":
                a, b = (machine, r.get("peer"))
                if (r.get("round"), b, a) in d["pairs"]:
                    a, b = b, a
                r["pair"] = [r.get("round"), a, b]
            d["results"].append(r)
        d["wait"].discard(machine)
        if not d["wait"]:
            self._diagnosed(time.time())

    def _diagnose_tick(self, now: float) -> None:
        d = self.diag
        if d is not None and d["wait"] and now > d["deadline"]:
            self._diagnosed(now)

    def _diagnosed(self, now: float) -> None:
        d, self.diag = self.diag, None
        self.ctl.rendezvous.close_scratch(self.job_id, d["name"])
        inc, res = d["inc"], d["res"]
        pair_index = {tuple(k): v for k, v in d["pairs"].items()}
        v = ladder.verdict(d["results"], list(self.slots), pair_index, missing=sorted(d["wait"]))
        evict, why = ladder.evictions(v, len(self._snapshot().standby_ready))
        took = round(now - d["started"], 3)
        summary = {"checks": d["checks"], "seconds": took, "bad": v["bad"], "links": v["links"],
                   "pairs": v["pairs"], "results": d["results"]}
        self.store.update_incident(inc["id"], data={**self._incident_data(inc["id"]), "stop_time_checks": summary})
        self.event("checks_done", {"incident": inc["id"], "seconds": took, "evict": evict}, t=now)
        if evict:
            res.evict, res.suspects = evict, list(evict)
            res.mechanism, res.cause = "evict_restart", f"{res.cause}; stop-time checks: {why}"
            if len(evict) > len(self._snapshot().standby_ready):
                res.mechanism = "fail"
                res.fail_reason = (f"stop-time checks failed {', '.join(evict)} but only "
                                   f"{len(self._snapshot().standby_ready)} standby machine(s) ready")
            return self._recover(inc, res, now)
        if d["checks"]:
            res.cause = f"{res.cause}; stop-time checks ({', '.join(d['checks'])}) passed in {took:.1f}s"
        previous = ladder.streak(self._past_incidents(inc["id"]), self.spec.policy.ladder_window_s)
        possible, why_not = self._replay_possible()
        rung = ladder.next_rung(previous, possible)
        rollback = versions.rollback_reason(self.versions.current(self.job_id) if self.version else None,
                                            self.store.incidents(self.job_id), now + 1e-6) \
            if self.version is not None else None
        if rung == "replay" and rollback is None:
            return self._start_replay(inc, res, now)
        if previous and not possible:
            res.cause = f"{res.cause}; no dual-phase replay: {why_not}"
        return self._recover(inc, res, now)

    def _past_incidents(self, current: int) -> list[dict]:
        return [i for i in self.store.incidents(self.job_id) if i["id"] != current]

    def _incident_data(self, inc_id: int) -> dict:
        for i in self.store.incidents(self.job_id):
            if i["id"] == inc_id:
                return dict(i.get("data") or {})
        return {}
