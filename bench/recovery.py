"""Recovery benchmark: the same crash at the same step under torchrun and under stalwart.

    python bench/recovery.py [--steps 60] [--crash-step 35] [--ckpt-every 10]

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


ERROR_RE = re.compile(r"Traceback|Error|ERROR|[Ff]ailed|FAILED|exitcode|Signals\.")


def torchrun_recovery(steps: int, crash_step: int, ckpt_every: int, workdir: str) -> dict:
    """SIGKILL one worker once `crash_step` steps are done (rank 0 printed step crash_step-1); time until the restarted workers'
    first step, the first error line torchrun printed (its detection), and the steps redone."""
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1",
               STALWART_CKPT_DIR=os.path.join(workdir, "ckpt"), STALWART_CKPT_EVERY=str(ckpt_every),
               STALWART_STEPS=str(steps))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "3", "-m", "stalwart.examples.gpt", "--tp", "2", "--layers", "2",
            "--steps", str(steps)]
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, cwd=workdir)
    killed_at = detected_at = resumed = None
    max_step = -1            # the furthest step rank 0 printed before the restart
    first_after = None
    try:
        for line in p.stdout:
            now = time.time()
            m = re.match(r'\{"step": (\d+)', line)
            if not m:
                if killed_at is not None and detected_at is None and ERROR_RE.search(line):
                    detected_at = now
                continue
            step = int(m.group(1))
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
        p.wait(timeout=600)
    finally:
        kill_tree(p.pid)
    return {"fault_to_next_step_s": (resumed - killed_at) if resumed and killed_at else None,
            "detection_s": (detected_at - killed_at) if detected_at and killed_at else None,
            "killed_after_step": max_step if killed_at else None,
            "steps_lost": (max_step - first_after + 1) if first_after is not None else None,
            "exit_code": p.returncode}


def stalwart_recovery(steps: int, crash_step: int, ckpt_every: int, workdir: str) -> dict:
    """The same job under stalwart with `crash@step=S,machine=1`; times from the incident record."""
    rep = run_job(os.path.join(workdir, "stalwart"),
                  gpt_spec(machines=2, gpus=2, tp=2, dp=2, steps=steps, ckpt_every=ckpt_every,
                           chaos=[f"crash@step={crash_step},machine=1"]))
    incs = [i for i in rep["incidents"] if i.get("injected_at") is not None]
    if rep["state"] != "succeeded" or not incs or incs[0]["resumed_at"] is None:
        raise RuntimeError(f"stalwart job {rep['state']} ({rep.get('reason')}); incidents {rep['incidents']}")
    inc = incs[0]
    return {"fault_to_next_step_s": inc["resumed_at"] - inc["injected_at"],
            "detection_s": inc["detection_s"],
            "localization_s": inc["localized_at"] - inc["detected_at"] if inc["localized_at"] else None,
            "killed_after_step": crash_step - 1, "steps_lost": rep["steps_lost"],
            "mechanism": inc["mechanism"], "state": rep["state"], "ettr": rep["ettr"]}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


def main() -> int:
    """Run torchrun then stalwart on the same job and crash; print both and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--crash-step", type=int, default=35,
                    help="crash once this many steps are done (default 35: mid-way between "
                         "durable checkpoints, the expected case)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="durable checkpoint interval")
    a = ap.parse_args()
    if not 1 <= a.crash_step < a.steps or a.ckpt_every < 1:
        print("error: need 1 <= --crash-step < --steps and --ckpt-every >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-") as d:
        tr = torchrun_recovery(a.steps, a.crash_step, a.ckpt_every, d)
        sw = stalwart_recovery(a.steps, a.crash_step, a.ckpt_every, d)
    print(json.dumps({"torchrun": tr, "stalwart": sw}, indent=1))
    print(f"\ncrash of one worker after {a.crash_step} of {a.steps} steps, durable checkpoint every "
          f"{a.ckpt_every} (stalwart also keeps one in memory every step)")
    print(f"{'':<10} {'detect (s)':>11} {'fault->next step (s)':>21} {'steps lost':>11}")
    for name, r in (("torchrun", tr), ("stalwart", sw)):
        print(f"{name:<10} {_fmt(r['detection_s']):>11} {_fmt(r['fault_to_next_step_s']):>21} "
              f"{_fmt(r['steps_lost']):>11}")
    if tr["fault_to_next_step_s"] and sw["fault_to_next_step_s"]:
        print(f"\nratio torchrun/stalwart (fault->next step): "
              f"{tr['fault_to_next_step_s'] / sw['fault_to_next_step_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
