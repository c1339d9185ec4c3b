"""Recovery benchmark: stalwart vs torchrun on the same job, fault and step.

    python bench/recovery.py [--steps 250] [--crash-step 195] [--ckpt-every 50]
                             [--only crash,machine,lost,update]

Four comparisons, each printing fault-to-next-step seconds, the seconds until training is back
at the step it had reached (lost steps redone), steps lost, and the ratio:

- crash: one worker SIGKILLed. torchrun `--max-restarts 3` (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
  pytorch#135712) restarts every worker from the durable checkpoint; stalwart runs its stop-time
  checks (no culprit), then reattempts from the every-step in-memory checkpoint.
- machine: a machine fault its agent sees (`gpu-lost`: the GPU falls off the bus and the worker
  on it fails). torchrun sees a dead worker and restarts the same way; stalwart (one warm standby)
  evicts the machine at once and the standby takes its ranks from the in-memory checkpoint.
- lost: the whole machine goes away (`machine-down`: its agent and workers are killed). torchrun
  again sees a dead worker; stalwart notices the machine only by its missing heartbeats
  (`missed_beats` x `heartbeat_s`, 4 x 0.5 s here), then the standby takes over as above.
- update: new training code. A full requeue stops everything (once `--crash-step` steps are done)
  and starts new torchrun agents that reload the durable checkpoint; stalwart registers an urgent
  hot update at that step, warms spare workers on the new code while training goes on, then stops
  the run and restarts in place from the in-memory checkpoint. Its time counts from that stop
  (training stood still only then); `request_to_next_step_s` and `spares_warm_up_s` are printed too.

Both run the bundled example with the same layout (tp=2, dp=2, 4 workers) and the same durable
checkpoint interval (default 50 steps, the issue's setting). Not a timed test: a script that
prints what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
from jobrun import gpt_spec, run_job  # noqa: E402

from stalwart.agent.workers import kill_tree  # noqa: E402


UPDATE_MAX_STEPS = 3000    # the update case's job length; it is cancelled 300 steps after the update
ERROR_RE = re.compile(r"Traceback|Error|ERROR|[Ff]ailed|FAILED|exitcode|Signals\.")


def _torchrun(steps: int, ckpt_every: int, workdir: str, max_restarts: int = 3) -> subprocess.Popen:
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1",
               STALWART_CKPT_DIR=os.path.join(workdir, "ckpt"), STALWART_CKPT_EVERY=str(ckpt_every),
               STALWART_STEPS=str(steps))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", str(max_restarts), "-m", "stalwart.examples.gpt", "--tp", "2",
            "--layers", "2", "--steps", str(steps)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=workdir)


def _steps(line: str) -> int | None:
    m = re.match(r'\{"step": (\d+)', line)
    return int(m.group(1)) if m else None


def torchrun_recovery(steps: int, crash_step: int, ckpt_every: int, workdir: str) -> dict:
    """SIGKILL one worker once `crash_step` steps are done (rank 0 printed step crash_step-1); time
    until the restarted workers' first step and until they are back past the step reached, the
    first error line torchrun printed (its detection), and the steps redone."""
    p = _torchrun(steps, ckpt_every, workdir)
    killed_at = detected_at = resumed = caught_up = None
    max_step = -1            # the furthest step rank 0 printed before the restart
    first_after = None
    try:
        for line in p.stdout:
            now = time.time()
            step = _steps(line)
            if step is None:
                if killed_at is not None and detected_at is None and ERROR_RE.search(line):
                    detected_at = now
                continue
            if killed_at is None:
                max_step = max(max_step, step)
                if step + 1 >= crash_step:   # `crash_step` steps done, as stalwart's chaos counts
                    workers = [c for c in psutil.Process(p.pid).children(recursive=True)
                               if "stalwart.examples.gpt" in " ".join(c.cmdline())]
                    victim = sorted(workers, key=lambda c: c.pid)[-1]
                    victim.kill()
                    killed_at = time.time()
            elif resumed is None:
                if step <= max_step:
                    resumed, first_after = now, step   # the restarted workers' first step
                else:
                    max_step = step                    # printed by survivors before they noticed
            if resumed is not None and caught_up is None and step > max_step:
                caught_up = now
        p.wait(timeout=600)
    finally:
        kill_tree(p.pid)
    return {"fault_to_next_step_s": (resumed - killed_at) if resumed and killed_at else None,
            "fault_to_caught_up_s": (caught_up - killed_at) if caught_up and killed_at else None,
            "detection_s": (detected_at - killed_at) if detected_at and killed_at else None,
            "killed_after_step": max_step if killed_at else None,
            "steps_lost": (max_step - first_after + 1) if first_after is not None else None,
            "exit_code": p.returncode}


def torchrun_requeue(steps: int, at_step: int, ckpt_every: int, workdir: str) -> dict:
    """A full requeue for new code: stop the whole torchrun job once `at_step` steps are done, start
    new agents that reload the newest durable checkpoint; time from the stop to their first step."""
    first = _torchrun(steps, ckpt_every, workdir, max_restarts=0)
    max_step = -1
    try:
        for line in first.stdout:
            step = _steps(line)
            if step is not None:
                max_step = max(max_step, step)
                if step + 1 >= at_step:
                    break
    finally:
        stopped_at = time.time()
        kill_tree(first.pid)
        first.wait()
    second = _torchrun(steps, ckpt_every, workdir, max_restarts=0)
    resumed = caught_up = first_after = None
    try:
        for line in second.stdout:
            step = _steps(line)
            if step is None:
                continue
            if resumed is None:
                resumed, first_after = time.time(), step
            if step > max_step:
                caught_up = time.time()
                break
    finally:
        kill_tree(second.pid)
        second.wait()
    return {"fault_to_next_step_s": resumed - stopped_at if resumed else None,
            "fault_to_caught_up_s": caught_up - stopped_at if caught_up else None,
            "detection_s": None, "killed_after_step": max_step,
            "steps_lost": (max_step - first_after + 1) if first_after is not None else None}


def _events(state_dir: str) -> dict[str, list[dict]]:
    """The job's events by kind, from the store."""
    from stalwart.controller.store.db import Store
    store = Store(f"sqlite:///{state_dir}/stalwart.db")
    try:
        out: dict[str, list[dict]] = {}
        for e in store.events(1):
            out.setdefault(e["kind"], []).append(e)
        return out
    finally:
        store.close()


def _step_times(state_dir: str) -> list[tuple[float, int, int]]:
    """(t, run, step) of every committed step, t since the job was submitted (as in the report)."""
    evs = _events(state_dir)
    t0 = evs["job_submitted"][0]["t"]
    return [(e["t"] - t0, e["data"]["run"], e["data"]["step"]) for e in evs.get("step", [])]


def _code_dir(workdir: str, tag: str) -> str:
    code = os.path.join(workdir, f"code-{tag}")
    os.makedirs(code, exist_ok=True)
    with open(os.path.join(code, "train.py"), "w") as f:
        f.write(f"# version {tag}\nimport sys\nfrom stalwart.examples import gpt\nsys.exit(gpt.main())\n")
    return code


def stalwart_recovery(steps: int, crash_step: int, ckpt_every: int, workdir: str, kind: str,
                      update: bool = False) -> dict:
    """The same job under stalwart with `KIND@step=S,machine=1` (or an urgent hot update once S
    steps are done); times from the incident record and the step events."""
    d = os.path.join(workdir, f"stalwart-{'update' if update else kind}")
    if update:    # long enough for the spares to warm up beside training; cancelled when resumed
        steps = max(steps, UPDATE_MAX_STEPS)
    spec = gpt_spec(machines=2, gpus=2, tp=2, dp=2, steps=steps, ckpt_every=ckpt_every,
                    standby=0 if kind == "crash" else 1,
                    chaos=[] if update else [f"{kind}@step={crash_step},machine=1"])
    during = None
    if update:
        # hot update versions a code directory: the job runs train.py from one, v2 is a copy
        spec["command"] = [sys.executable, "train.py"] + spec["command"][3:]
        spec["code_dir"] = _code_dir(workdir, "v1")
        code = _code_dir(workdir, "v2")
        posted = []

        def during(client, job, st):
            live = st.get("live") or {}
            if not posted and live.get("state") == "running" and live.get("step", 0) >= crash_step:
                posted.append((client.post(f"/api/jobs/{job}/versions", {"code": code, "mode": "urgent"}),
                               live["step"]))
            elif posted and live.get("run", 1) > 1 and live.get("step", 0) >= posted[0][1] + UPDATE_MAX_STEPS // 10:
                client.post(f"/api/jobs/{job}/cancel", {"reason": "bench: the update was measured"})
    rep = run_job(d, spec, during=during, timeout=600)
    incs = [i for i in rep["incidents"] if update or i.get("injected_at") is not None]
    if rep["state"] not in ("succeeded", "cancelled") or not incs or incs[0]["resumed_at"] is None:
        raise RuntimeError(f"stalwart job {rep['state']} ({rep.get('reason')}); incidents {rep['incidents']}")
    inc = incs[0]
    start = inc["detected_at"] if update else inc["injected_at"]
    times = _step_times(d)
    before = [(s, run) for t, run, s in times if t <= start]
    reached = max(s for s, _ in before) if before else -1
    run_at_fault = max((run for _, run in before), default=0)
    # steps the old run still committed after the fault are not recovery
    after = [t for t, run, s in times if t > start and s > reached and run > run_at_fault]
    extra = {}
    if update:   # the request came earlier: training went on while spares warmed up on the new code
        evs = _events(d)
        asked = evs["version_registered"][0]["t"] - evs["job_submitted"][0]["t"]
        extra = {"request_to_next_step_s": inc["resumed_at"] - asked,
                 "spares_warm_up_s": (evs.get("version_prewarmed") or [{"data": {}}])[0]["data"].get("seconds")}
    return {**extra, "fault_to_next_step_s": inc["resumed_at"] - start,
            "fault_to_caught_up_s": (min(after) - start) if after else None,
            "detection_s": inc["detection_s"],
            "localization_s": inc["localized_at"] - inc["detected_at"] if inc["localized_at"] else None,
            "killed_after_step": reached, "steps_lost": rep["steps_lost"],
            "mechanism": inc["mechanism"], "state": rep["state"], "ettr": rep["ettr"]}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


CASES = {
    "crash": ("crash of one worker", "torchrun restart", "stalwart checks + reattempt"),
    "machine": ("machine fault (GPU lost)", "torchrun restart", "stalwart standby takeover"),
    "lost": ("machine lost (no heartbeat)", "torchrun restart", "stalwart standby takeover"),
    "update": ("new code", "full requeue", "stalwart hot update"),
}
CHAOS = {"crash": "crash", "machine": "gpu-lost", "lost": "machine-down"}


def main(argv: list[str] | None = None) -> int:
    """Run each comparison (torchrun first, then stalwart); print the table and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--crash-step", type=int, default=195,
                    help="fault once this many steps are done (default 195: just before the next "
                         "durable checkpoint at 200, the costly case for a durable-only restart, "
                         "and late enough that a job is past its start-up, as faults in long jobs are)")
    ap.add_argument("--ckpt-every", type=int, default=50, help="durable checkpoint interval (default 50)")
    ap.add_argument("--only", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    a = ap.parse_args(argv)
    cases = [c.strip() for c in a.only.split(",") if c.strip()]
    if not 1 <= a.crash_step < a.steps or a.ckpt_every < 1 or not cases or set(cases) - set(CASES):
        print(f"error: need 1 <= --crash-step < --steps, --ckpt-every >= 1 and --only from "
              f"{', '.join(CASES)}", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-") as d:
        for c in cases:
            sub = os.path.join(d, c)
            os.makedirs(sub)
            print(f"{c}: torchrun ...", flush=True)
            tr = torchrun_requeue(a.steps, a.crash_step, a.ckpt_every, sub) if c == "update" else \
                torchrun_recovery(a.steps, a.crash_step, a.ckpt_every, sub)
            print(f"{c}: stalwart ...", flush=True)
            sw = stalwart_recovery(a.steps, a.crash_step, a.ckpt_every, sub, CHAOS.get(c, "crash"),
                                   update=c == "update")
            results[c] = {"torchrun": tr, "stalwart": sw}
            print(json.dumps({c: results[c]}), flush=True)
    print(f"\nfault after {a.crash_step} of {a.steps} steps, durable checkpoint every {a.ckpt_every} "
          f"(stalwart also keeps one in memory every step)")
    head = f"{'case':<44} {'fault->next step (s)':>21} {'fault->caught up (s)':>21} {'steps lost':>11}"
    print(head + "\n" + "-" * len(head))
    for c, r in results.items():
        what, peer, ours = CASES[c]
        for name, x in ((f"{what}: {peer}", r["torchrun"]), (f"{what}: {ours}", r["stalwart"])):
            print(f"{name[:44]:<44} {_fmt(x['fault_to_next_step_s']):>21} "
                  f"{_fmt(x['fault_to_caught_up_s']):>21} {_fmt(x['steps_lost']):>11}")
        t, s = r["torchrun"], r["stalwart"]
        for key in ("fault_to_next_step_s", "fault_to_caught_up_s"):
            if t.get(key) and s.get(key):
                print(f"{'':<44} ratio {key}: {t[key] / s[key]:.2f}x (target >= 5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
