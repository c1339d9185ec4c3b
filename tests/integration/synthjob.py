"""A large synthetic job written straight into a controller's store (no processes): 1,024 machines,
thousands of steps, several incidents with evictions, stop-time checks and stacks. For the
dashboard's scale test: what a 1,000-machine job's store holds after a while."""
from __future__ import annotations

import json
import random
import time

from stalwart.controller.store import db as st
def write_synthetic_job(store: st.Store, machines: int = 1024, standby: int = 16, incidents: int = 8,
                        steps: int = 3000, step_s: float = 0.5, gpus: int = 8, seed: int = 7) -> int:
    """Insert one running job and return its id. The active machines are ``machines - standby -
    incidents``; each incident evicts one machine (a standby takes its slot)."""
    rnd = random.Random(seed)
    active_n = machines - standby - incidents
    ids = [f"m{i}" for i in range(machines)]
    active, spares = ids[:active_n], ids[active_n:]
    now = time.time()
    t0 = now - steps * step_s - incidents * 20.0 - 30.0
    spec = {"name": "synthetic", "machines": active_n, "gpus_per_machine": gpus, "steps": steps * 2,
            "tp": 8, "pp": 4, "dp": active_n * gpus // 32, "command": ["python", "train.py"]}
    job = store.create_job("synthetic", spec, t0)
    store.update_job(job, state="running")
    evs = [(t0, "job_submitted", {"spec": spec})]
    run, t, step = 1, t0 + 30.0, 0
    run_rows = [(run, 0, t, dict(enumerate(active)))]
    evs.append((t, "run_started", {"run": run, "start_step": 0, "machines": active}))
    fault_steps = sorted(rnd.sample(range(100, steps - 100), incidents))
    evicted: list[tuple[str, str]] = []
    inc_rows = []
    slots = list(active)
    loss = 8.0
    for s in range(steps):
        t += step_s * rnd.uniform(0.9, 1.1)
        loss = loss * 0.999 + rnd.uniform(-0.01, 0.01)
        evs.append((t, "step", {"run": run, "step": step, "dur": step_s, "loss": round(loss, 5),
                                "grad_norm": 1.0, "tokens": 4096}))
        step += 1
        if s in fault_steps:
            k = len(inc_rows)
            victim = slots[rnd.randrange(len(slots))]
            inj, det = t + 0.2, t + 1.0
            loc, start = det + 2.0, det + 8.0
            inc_id = k + 1
            cause = f"GPU Xid 79 (GPU fallen off the bus) on {victim}"
            evs += [(inj, "chaos_applied", {"machine": victim, "kind": "gpu-xid", "rank": None}),
                    (det - 0.1, "health", {"machine": victim, "kind": "gpu_xid", "severity": "fatal"}),
                    (det, "incident_opened", {"incident": inc_id, "symptom": "gpu_xid", "injected_at": inj,
                                              "planned": False}),
                    (loc - 0.5, "run_stopped", {"run": run}),
                    (loc, "incident_localized", {"incident": inc_id, "injected_at": inj,
                                                 "mechanism": "evict_restart"})]
            new = spares[standby + k] if standby + k < len(spares) else spares[k]
            slots[slots.index(victim)] = new
            evicted.append((victim, cause))
            run += 1
            step -= 2
            t = start
            run_rows.append((run, step, t, dict(enumerate(slots))))
            evs.append((t, "run_started", {"run": run, "start_step": step, "machines": list(slots)}))
            evs.append((t + step_s, "incident_resumed", {"incident": inc_id}))
            inc_rows.append({"id": inc_id, "run_seq": run - 1, "symptom": "gpu_xid", "category": "explicit",
                             "cause": cause,
                             "suspects": [victim], "evicted": [victim], "mechanism": "evict_restart",
                             "injected_at": inj, "detected_at": det, "localized_at": loc,
                             "resumed_at": t + step_s,
                             "data": {"stacks": {victim: [{"rank": 0, "role": "worker", "status": "S",
                                                           "error": "process gone"}]}}})
    with store.engine.begin() as c:
        c.execute(st.events.insert(), [{"job_id": job, "t": tt, "kind": kind, "data": json.dumps(d)}
                                       for tt, kind, d in sorted(evs, key=lambda e: e[0])])
        c.execute(st.machines.insert(), [
            {"id": m, "state": "active" if m in slots else "evicted" if m in dict(evicted) else "standby",
             "job_id": job, "address": f"10.0.{i // 256}.{i % 256}", "info": "{}", "registered_at": t0,
             "last_beat": now, "reason": dict(evicted).get(m)} for i, m in enumerate(ids)])
        c.execute(st.incidents.insert(), [dict(r, job_id=job, suspects=json.dumps(r["suspects"]),
                                               evicted=json.dumps(r["evicted"]), data=json.dumps(r["data"]))
                                          for r in inc_rows])
        c.execute(st.runs.insert(), [{"job_id": job, "seq": seq, "start_step": s0, "started_at": ts,
                                      "machines": json.dumps({str(i): m for i, m in mp.items()}),
                                      "restore": json.dumps({"step": s0 - 1, "tiers": {"0": "own"}})}
                                     for seq, s0, ts, mp in run_rows])
    return job
