"""A soak of 100 faults in a row in one job.

A random mix (seeded) of crash, machine-down, gpu-xid, sigstop and nan goes into one running job,
one fault at a time: each on a random active machine, once the previous incident is resolved and
the job made progress again. The cluster plays its provisioning team: a machine the job evicted
is handed back (its agent stopped, `LocalCluster.retire_machine`) and a fresh one joins
(`add_machine`), so the standby pool refills as it would from a cluster's spares. The job must
complete with every incident resolved (evicted or reattempted, and resumed).

Faults are independent, so the ladder's window is short (a crash 10 s after another is not the
same failure coming back) and the hang floor is low (steps take ~0.05 s). The one-layer toy model's
gradient norm jumps 5x now and then on its own: the jump rule is tested elsewhere, here it only
counts what was injected (factor 50; a NaN is caught whatever the factor).
STALWART_SOAK_FAULTS overrides the number of faults (100).
"""
from __future__ import annotations

import collections
import os
import random
import threading
import time

import pytest

from jobrun import GPT, wait_for
from stalwart.backends.local import LocalCluster
from stalwart.transport.client import ControllerUnreachable
from stalwart.spec import JobSpec

FAULTS = int(os.environ.get("STALWART_SOAK_FAULTS", "100"))
KINDS = ["crash", "machine-down", "gpu-xid", "sigstop", "nan"]
# a crash right after another unexplained one climbs the ladder (papers.md §1.5.2: "if the restart
# fails again"): a dual-phase replay that reproduces nothing, then the same restart as a reattempt
RESOLVED = ("evict_restart", "reattempt", "replay")
# the first fault at step FIRST; the job has GAP steps a fault (a fault's cycle takes it ~30 steps
# beyond its best in CI: 2 past where the fault hit, a few at 1 s while a standby warms up, and
# those it trains at full speed while the test looks), so it cannot end before the last one. The
# steps just before a fault are not paced: the hang timeout is calibrated on recent step times,
# and 1 s steps would make a SIGSTOP take ~40 s to find.
FIRST, GAP = 20, 50


class Provisioner(threading.Thread):
    """Hands evicted machines back to the cluster and adds fresh ones, keeping `free` machines
    beyond the job's active ones and standbys."""

    def __init__(self, cluster: LocalCluster, active: int, want: int):
        super().__init__(name="provisioner", daemon=True)
        self.cluster, self.active, self.want = cluster, active, want
        self.stopping = threading.Event()
        self.added: list[str] = []
        self.retired: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.wait(0.2):
                machines = self.cluster.client().get("/api/machines")["machines"]
                for m in machines:
                    if m["state"] == "evicted" and m["id"] not in self.retired:
                        self.cluster.retire_machine(m["id"])
                        self.retired.append(m["id"])
                usable = [m for m in machines if m["state"] != "evicted" and m["alive"]]
                if len(usable) < self.want:
                    self.added.append(self.cluster.add_machine())
        except ControllerUnreachable:
            pass
        except BaseException as e:        # reported by the test
            self.error = e


def _live(client, job: int) -> dict:
    return client.get(f"/api/jobs/{job}")


@pytest.mark.timeout(1500)
def test_a_hundred_faults_in_a_row(tmp_path):
    rnd = random.Random(12)
    standby = 2
    pace = tmp_path / "pace"          # while it exists a step lasts 1 s (the example's --slow-while)
    spec = JobSpec.from_dict({
        "name": "soak", "machines": 2, "gpus_per_machine": 1, "steps": FIRST + GAP * FAULTS,
        "standby": standby,
        "ckpt_every": 20, "command": GPT + ["--layers", "1", "--log-every", "0", "--slow-while", str(pace)],
        "policy": {"heartbeat_s": 0.5, "missed_beats": 6, "hang_timeout_floor_s": 3.0,
                   "ladder_window_s": 1.0, "diag_timeout_s": 5.0, "stop_grace_s": 0.5,
                   "loss_jump_factor": 50.0}})
    cluster = LocalCluster(str(tmp_path / "soak"), spec.machines + standby + 1, 1,
                           heartbeat_s=spec.policy.heartbeat_s, missed_beats=spec.policy.missed_beats)
    prov = Provisioner(cluster, spec.machines, spec.machines + standby + 1)
    injected: list[dict] = []
    t0 = time.monotonic()
    try:
        cluster.start()
        client = cluster.client()
        job = client.post("/api/jobs", {"spec": spec.to_dict()})["job"]
        prov.start()
        for i in range(FAULTS):
            # The next fault goes in once the previous one's incident resumed, the job trained
            # beyond where that fault hit, and a warm standby waits (faults every few seconds would
            # otherwise outrun the provisioning; real ones are hours apart; while it waits the job
            # trains at 1 s a step). The survivors' spares may still be warming: a restart there
            # is then cold, which costs seconds, not correctness.

            def ready() -> bool:
                st = _live(client, job)
                assert st["state"] == "running", (i, st.get("reason"))
                if len(st["incidents"]) < i or any(inc["resumed_at"] is None for inc in st["incidents"]):
                    return False
                # past where the last fault hit (a job that makes no progress across three restarts
                # is failed as a crash loop, and a restore may go back to a durable step): a fault
                # lands a step or two after the step counted at its injection (the workers run ahead
                # of the commits), and the job's best step must be passed, so 6 steps of margin
                if st["live"]["step"] < max(FIRST, injected[-1]["step"] + 6 if injected else 0):
                    return False
                alive = {m["id"] for m in client.get("/api/machines")["machines"] if m["alive"]}
                if alive & set(st["live"]["standby_warm"]):
                    return True
                pace.touch()            # 1 s a step while a standby warms up
                return False
            t_wait = time.monotonic()
            assert wait_for(ready, 120, every=0.1), f"fault {i}: not resolved/progressing: {_live(client, job)}"
            pace.unlink(missing_ok=True)
            if i and os.environ.get("STALWART_SOAK_TRACE"):
                inc = _live(client, job)["incidents"][-1]
                print(f"fault {i - 1} {injected[-1]['kind']}: ready after {time.monotonic() - t_wait:.1f}s;"
                      f" incident {inc['symptom']} {inc['mechanism']} {inc.get('ledger')}", flush=True)
            assert prov.error is None, prov.error
            st = _live(client, job)
            assert st["steps_target"] - st["live"]["step"] > 0, f"the job ended before fault {i}: raise GAP"
            kind = rnd.choice(KINDS)
            slot = rnd.randrange(spec.machines)
            machine = st["live"]["slots"][slot]
            text = f"{kind}@machine={machine[1:]}" + (f",rank={slot}" if kind in ("crash", "sigstop") else "")
            client.post(f"/api/jobs/{job}/inject", {"chaos": text})
            injected.append({"kind": kind, "machine": machine, "step": st["live"]["step"]})
        assert wait_for(lambda: _live(client, job)["state"] != "running", 300, every=0.2)
        rep = _live(client, job)
    finally:
        prov.stopping.set()
        prov.join(10)
        cluster.stop()
    took = time.monotonic() - t0
    incs = rep["incidents"]
    by_kind = collections.Counter(f["kind"] for f in injected)
    by_mech = collections.Counter(inc["mechanism"] for inc in incs)
    by_sym = collections.Counter(inc["symptom"] for inc in incs)
    print(f"\nsoak: {FAULTS} faults in {took:.0f}s ({by_kind}); {len(incs)} incidents, mechanisms {dict(by_mech)},"
          f" symptoms {dict(by_sym)}; machines added {len(prov.added)}, retired {len(prov.retired)};"
          f" steps {rep['steps_completed']} ({rep.get('steps_lost')} lost), ETTR {rep['ettr']:.3f},"
          f" unproductive {rep['unproductive_s']}")
    assert rep["state"] == "succeeded", rep.get("reason")
    # every restart resumed close to where the stopped run ended: from memory (a step or two back),
    # at worst from a durable step (every 20) two intervals back. After a NaN the state from the
    # NaN's step on is corrupt (the run may have trained many steps past it before the stop came on
    # a loaded host): the restart goes to the newest durable step before the NaN, which landed at
    # or after the step counted at its injection (a durable copy written a step or two before may
    # still be in flight, hence `- 3`)
    runs = rep["runs"]
    fault_of_run = {inc["run"]: fault for fault, inc in zip(injected, incs)}
    went_back = []
    for a, b in zip(runs, runs[1:]):
        if a["end_step"] is None:
            continue
        fault = fault_of_run.get(a["id"])
        if fault is not None and fault["kind"] == "nan":
            # (one interval further back when the newest durable step's copies were still being
            # written when the run stopped: its persist runs in the background and a loaded host
            # finished it after the restore was planned, a CI run: NaN counted at 1864, restart
            # from 1840 with 1859's durable copy not yet reported)
            lowest = ((fault["step"] - 3) // spec.ckpt_every - 1) * spec.ckpt_every
        else:
            lowest = a["end_step"] - 2 * spec.ckpt_every
        if b["start_step"] < lowest:
            went_back.append((a["id"], a["end_step"], b["start_step"], fault))
    assert not went_back, went_back
    assert len(incs) == FAULTS, [(inc["id"], inc["symptom"], inc["mechanism"]) for inc in incs]
    unresolved = [(inc["id"], inc["symptom"], inc["mechanism"], inc["cause"]) for inc in incs
                  if inc["mechanism"] not in RESOLVED or inc["resumed_at"] is None]
    assert not unresolved, unresolved
    # every fault that takes a machine out took out the machine it was injected into
    for fault, inc in zip(injected, incs):
        if fault["kind"] in ("machine-down", "gpu-xid", "sigstop", "nan"):
            assert inc["machines_evicted"] == [fault["machine"]], (fault, inc["machines_evicted"], inc["cause"])
        else:
            assert inc["mechanism"] in ("reattempt", "replay") and inc["machines_evicted"] == [], \
                (fault, inc["mechanism"], inc["machines_evicted"], inc["cause"])
