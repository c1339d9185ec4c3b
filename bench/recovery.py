"""Recovery benchmark: the same crash at the same step under torchrun and under stalwart.

    python bench/recovery.py [--steps 60] [--crash-step 30] [--ckpt-every 10]

torchrun runs `--max-restarts 3` with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch#135712); both
run the bundled example with the same layout (tp=2, dp=2, 4 workers) and the same durable
checkpoint interval. Prints fault-to-next-step seconds for both, steps lost, and the ratio.
Not a timed test: a script that prints what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
from jobrun import gpt_spec, run_job  # noqa: E402

from stalwart.agent.workers import kill_tree  # noqa: E402


def torchrun_recovery(steps: int, crash_step: int, ckpt_every: int, workdir: str) -> dict:
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1",
               STALWART_CKPT_DIR=os.path.join(workdir, "ckpt"), STALWART_CKPT_EVERY=str(ckpt_every),
               STALWART_STEPS=str(steps))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "3", "-m", "stalwart.examples.gpt", "--tp", "2", "--layers", "2",
            "--steps", str(steps)]
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    killed_at = None
    step_at_kill = None
    resumed = None
    first_after = None
    try:
        for line in p.stdout:
            m = re.search(r'"step": (\d+)', line)
            if not m:
                continue
            step = int(m.group(1))
            now = time.time()
            if killed_at is None and step >= crash_step:
                workers = [c for c in psutil.Process(p.pid).children(recursive=True)
                           if "stalwart.examples.gpt" in " ".join(c.cmdline())]
                victim = sorted(workers, key=lambda c: c.pid)[-1]
                victim.kill()
                killed_at, step_at_kill = time.time(), step
            elif killed_at is not None and resumed is None and step <= step_at_kill:
                resumed, first_after = now, step   # the restarted workers' first step
        p.wait(timeout=600)
    finally:
        kill_tree(p.pid)
    return {"fault_to_next_step_s": (resumed - killed_at) if resumed and killed_at else None,
            "steps_lost": (step_at_kill - first_after + 1) if first_after is not None else None,
            "exit_code": p.returncode}


def stalwart_recovery(steps: int, crash_step: int, ckpt_every: int, workdir: str) -> dict:
    rep = run_job(os.path.join(workdir, "stalwart"),
                  gpt_spec(machines=2, gpus=2, tp=2, dp=2, steps=steps, ckpt_every=ckpt_every,
                           chaos=[f"crash@step={crash_step},machine=1"]))
    inc = rep["incidents"][0]
    return {"fault_to_next_step_s": inc["resumed_at"] - inc["injected_at"],
            "detection_s": inc["detection_s"], "steps_lost": rep["steps_lost"],
            "state": rep["state"], "ettr": rep["ettr"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--crash-step", type=int, default=30)
    ap.add_argument("--ckpt-every", type=int, default=10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-") as d:
        tr = torchrun_recovery(a.steps, a.crash_step, a.ckpt_every, d)
        sw = stalwart_recovery(a.steps, a.crash_step, a.ckpt_every, d)
    print(json.dumps({"torchrun": tr, "stalwart": sw}, indent=1))
    print(f"\n{'':<10} {'fault->next step (s)':>22} {'steps lost':>11}")
    for name, r in (("torchrun", tr), ("stalwart", sw)):
        f = r["fault_to_next_step_s"]
        print(f"{name:<10} {f if f is None else round(f, 2):>22} {r['steps_lost']!s:>11}")
    if tr["fault_to_next_step_s"] and sw["fault_to_next_step_s"]:
        print(f"\nratio torchrun/stalwart: {tr['fault_to_next_step_s'] / sw['fault_to_next_step_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
