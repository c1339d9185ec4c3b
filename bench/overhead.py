"""Overhead benchmark: the same job under bare torchrun, torchrun with the worker SDK, and
`stalwart run`, in one invocation.

    python bench/overhead.py [--quick] [--steps 300] [--repeat N] [--json FILE]
                             [--ddp plain|dcp|dcp-overlap] [--batch B]

For each layout (4 workers: tp 2, dp 2 on 2 machines x 2; 8 workers: tp 2, pp 2, dp 2 on 4 x 2;
`--quick`: the 4-worker one alone) it runs the bundled GPT (rank 0 prints every step with its wall
time) three times, one after the other, and prints:

- steady-state steps/s: the median rate of 10-step blocks between 30% and 90% of the steps;
- command to first step (s);
- CPU-seconds per training step in that window of the workers, of stalwart's own processes
  (controller, agents, their peer-backup servers and checkers, spare/standby workers, the
  `stalwart run` process itself; in total and by role) and of torchrun's launcher;
- the SDK's blocking time per step (begin_step, gradients, report, the in-memory checkpoint).

and the ratios against bare torchrun. On a small shared host one run of each varies by several
percent from the next (bare torchrun alone: 10.4 to 12.0 steps/s in an hour); `--repeat N` runs
the three N times, each round in another order (a drift of the host is spread over all three),
and prints the median of every figure over the rounds, with each round's ratios. `--json FILE`
writes
{"layouts": [{"workers", "tp", "pp", "dp", "throughput_ratio", "own_cpu_share",
"sdk_blocking_share", "first_step_ratio"}, ...]}: stalwart's steps/s over bare torchrun's, its own
processes' CPU over its workers' CPU (a spare's one-time warm-up left out,
printed apart), the SDK's blocking time over the step time, and its
command-to-first-step over bare torchrun's. Not a timed test; run it alone on the host.

`--ddp plain|dcp|dcp-overlap` measures an ordinary DDP script instead (`bench/ddpjob.py`, 4 workers on 2
machines x 2, dp 4): bare torchrun against `stalwart run` of the same script unchanged (`plain`),
or of the script with stalwart's DCP adapter taking an every-step in-memory checkpoint (`dcp`: its
row `sdk_s_per_step` is the adapter's blocking time per step, and `sdk_blocking_share` in the JSON
that time over the step time). `dcp-overlap` is `dcp` with `STALWART_MEM_OVERLAP=1`: the copy runs
beside the next step's forward and backward, and the optimizer step waits for it.

`--batch B` (default 8192) is the samples per rank per step of the DDP job, a 4-layer MLP of width
256 trained with AdamW. Its checkpoint holds 12 bytes a parameter (fp32 weights and two moments)
and its step computes 6 FLOPs a parameter a sample, so its checkpoint bytes per FLOP are 2/B: the
same as a language model's with B tokens per model replica per step. Pre-training steps take 64 k
tokens a replica and more (0.5 M to 16 M tokens a step over a handful of replicas), so the default
checkpoints 8 times more bytes per unit of compute than such a job; B = 1024 (64 times) and B = 64
(1,000 times) are stress points. On this host the workers' compute and the checkpoint's copy,
checksums and backups share the same CPU cores, so the throughput ratio measures the checkpoint's
CPU against the compute's; on a GPU machine the copy is a device-to-host transfer beside the
compute and the rest runs on cores training leaves idle.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from stalwart.protocol import WARM_TITLE_MARK

GPT_ARGS = ["-m", "stalwart.examples.gpt", "--log-every", "1"]
DDP_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddpjob.py")
LAYOUTS = [(2, 1, 2), (2, 2, 2)]          # (tp, pp, dp); 2 GPUs per machine
MODES = ("bare", "sdk", "stalwart")
# stalwart's own processes, by role (the first marker found in the command line names the role)
OWN_ROLES = (("stalwart.cli controller", "controller"), ("stalwart.cli agent", "agent"),
             ("stalwart.agent.peerxfer", "peerxfer"), ("stalwart.diag.worker", "checker"),
             ("py-spy", "py-spy"), ("stalwart.cli", "cli"))
OWN = ("controller", "agent", "spare", "peerxfer", "checker", "py-spy", "cli")
# (a spare's one-time warm-up is reported apart: "spare_warmup", CPU-s per step of the window)


def role_of(proc: psutil.Process) -> str:
    """launcher, worker, other, or one of OWN: stalwart's controller, agents, warm spare/standby
    workers, peer-backup servers, checkers, py-spy, and the `stalwart run` process itself."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "gone"
    if "torch.distributed.run" in cmd:
        return "launcher"
    if "stalwart.examples.gpt" in cmd or "ddpjob.py" in cmd:
        try:
            standby = proc.environ().get("STALWART_STANDBY") == "1"
        except psutil.Error:
            standby = False
        # a warm spare or standby waiting at its barrier is stalwart's cost (a bench job has no fault,
        # so none is activated: /proc keeps the environment a process started with)
        # (a warm worker forked by the machine's fork server has the server's environment: its
        # command line says it waits, agent/forkclient.py's WARM_MARK)
        return "spare" if standby or WARM_TITLE_MARK.strip() in cmd else "worker"
    for marker, role in OWN_ROLES:
        if marker in cmd:
            return role
    return "other"


class CpuSampler(threading.Thread):
    """CPU seconds of every process under `root`, by role, every `every` seconds."""

    def __init__(self, root: int, every: float = 0.25):
        super().__init__(daemon=True)
        self.root, self.every = root, every
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                top = psutil.Process(self.root)
                procs = [top] + top.children(recursive=True)
            except psutil.Error:
                return
            snap: dict[int, tuple[str, float]] = {}
            for p in procs:
                try:
                    t = p.cpu_times()
                    snap[p.pid] = (role_of(p), t.user + t.system)
                except psutil.Error:
                    pass
            self.samples.append((time.time(), snap))

    def window(self, ta: float, tb: float) -> dict[str, float]:
        """CPU seconds by role between the samples nearest `ta` and `tb`. A spare's warm-up (its
        imports, before it waits at its barrier) is a one-time start-up cost like the workers'
        own imports, which the window leaves out too: it is counted as "spare_warmup", apart
        from the spares' CPU once idle ("spare")."""
        before = next((s for t, s in reversed(self.samples) if t <= ta), self.samples[0][1] if self.samples else {})
        after = next((s for t, s in self.samples if t >= tb), self.samples[-1][1] if self.samples else {})
        out: dict[str, float] = {}
        for pid, (role, cpu) in after.items():
            start = before.get(pid, (role, 0.0))[1]
            if role == "spare":
                warm = min(max(start, self._warmed_at(pid)), cpu)
                out["spare_warmup"] = out.get("spare_warmup", 0.0) + max(0.0, warm - start)
                start = max(start, warm)
            out[role] = out.get(role, 0.0) + max(0.0, cpu - start)
        return out

    def _warmed_at(self, pid: int, idle_share: float = 0.01, span_s: float = 2.0) -> float:
        """The process's CPU seconds when it first used under `idle_share` of a core for
        `span_s` (it finished warming up and waits); its last reading if it never did."""
        series = [(t, s[pid][1]) for t, s in self.samples if pid in s]
        for i, (t0, c0) in enumerate(series):
            later = [(t, c) for t, c in series[i:] if t >= t0 + span_s]
            if later and later[0][1] - c0 <= idle_share * (later[0][0] - t0):
                return c0
        return series[-1][1] if series else 0.0


def read_steps(path: str) -> list[dict]:
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{") and '"step"' in line and '"t"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def measure(steps: list[dict], launched: float, sampler: CpuSampler) -> dict:
    if len(steps) < 20:
        raise RuntimeError(f"only {len(steps)} steps were logged")
    by = {s["step"]: s for s in steps}
    last = max(by)
    lo, hi = int(0.3 * last), int(0.9 * last)
    rates = []
    for a in range(lo, hi - 9, 10):
        if a in by and a + 10 in by and by[a + 10]["t"] > by[a]["t"]:
            rates.append(10 / (by[a + 10]["t"] - by[a]["t"]))
    ta, tb = by[lo]["t"], by[hi]["t"]
    n = hi - lo
    cpu = sampler.window(ta, tb)
    out = {"steps_per_s": statistics.median(rates), "first_step_s": by[min(by)]["t"] - launched,
           "worker_cpu_per_step": cpu.get("worker", 0.0) / n,
           "own_cpu_per_step": sum(cpu.get(r, 0.0) for r in OWN) / n,
           "launcher_cpu_per_step": cpu.get("launcher", 0.0) / n, "step_s": (tb - ta) / n,
           "own_by_role": {r: cpu[r] / n for r in OWN if cpu.get(r)},
           "spare_warmup_cpu_per_step": cpu.get("spare_warmup", 0.0) / n}
    if "sdk_s" in by[lo] and "sdk_s" in by[hi]:
        out["sdk_s_per_step"] = (by[hi]["sdk_s"] - by[lo]["sdk_s"]) / n
    if "sdk_parts" in by[lo] and "sdk_parts" in by[hi]:
        out["sdk_parts_per_step"] = {k: (by[hi]["sdk_parts"][k] - v) / n for k, v in by[lo]["sdk_parts"].items()}
    return out


def _run(argv: list[str], env: dict, cwd: str, log_path: str | None, timeout: float) -> tuple[float, CpuSampler]:
    launched = time.time()
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = CpuSampler(proc.pid)
        sampler.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise RuntimeError(f"{argv[:6]}... did not finish within {timeout:.0f}s")
        sampler.stop.set()
        sampler.join(5)
        if code != 0:
            raise RuntimeError(f"{' '.join(argv[:8])}... exited with {code}"
                               + (f"; see {log_path}" if log_path else ""))
        return launched, sampler
    finally:
        if log_path:
            out.close()


def torchrun(tp: int, pp: int, dp: int, steps: int, sdk: bool, work: str) -> dict:
    d = tempfile.mkdtemp(dir=work)
    env = dict(os.environ, PYTHONUNBUFFERED="1", STALWART_CKPT_DIR=os.path.join(d, "ckpt"),
               STALWART_STEPS=str(steps))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp * pp * dp),
            *GPT_ARGS, "--tp", str(tp), "--pp", str(pp), "--steps", str(steps)] + ([] if sdk else ["--plain"])
    log = os.path.join(d, "out.log")
    launched, sampler = _run(argv, env, d, log, 600)
    return measure(read_steps(log), launched, sampler)


def stalwart(tp: int, pp: int, dp: int, steps: int, work: str) -> dict:
    d = tempfile.mkdtemp(dir=work)
    machines = tp * pp * dp // 2
    argv = [sys.executable, "-m", "stalwart.cli", "run", "--state-dir", os.path.join(d, "sd"), "--fresh",
            "--machines", str(machines), "--gpus-per-machine", "2", "--tp", str(tp), "--pp", str(pp),
            "--dp", str(dp), "--steps", str(steps), "--standby", "1", "--ckpt-every", "10",
            "--", sys.executable, *GPT_ARGS]
    launched, sampler = _run(argv, dict(os.environ, PYTHONUNBUFFERED="1"), d, os.path.join(d, "run.log"), 900)
    log = os.path.join(d, "sd", "machines", "m0", "logs", "run1_rank0.out")
    return measure(read_steps(log), launched, sampler)


def torchrun_ddp(steps: int, batch: int, work: str) -> dict:
    """Bare torchrun of the DDP script (4 workers, no checkpoint)."""
    d = tempfile.mkdtemp(dir=work)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            DDP_JOB, "--steps", str(steps), "--batch", str(batch)]
    log = os.path.join(d, "out.log")
    launched, sampler = _run(argv, dict(os.environ, PYTHONUNBUFFERED="1"), d, log, 600)
    return measure(read_steps(log), launched, sampler)


def stalwart_ddp(steps: int, batch: int, dcp: bool, work: str, overlap: bool = False) -> dict:
    """`stalwart run` of the same DDP script (2 machines x 2, one standby), with the DCP adapter's
    every-step in-memory checkpoint when `dcp` (its copy beside the next step when `overlap`)."""
    d = tempfile.mkdtemp(dir=work)
    argv = [sys.executable, "-m", "stalwart.cli", "run", "--state-dir", os.path.join(d, "sd"), "--fresh",
            "--machines", "2", "--gpus-per-machine", "2", "--dp", "4", "--steps", str(steps), "--standby", "1",
            "--ckpt-every", "10"] + (["--env", "STALWART_MEM_OVERLAP=1"] if overlap else []) + [
            "--", sys.executable, DDP_JOB, "--steps", str(steps), "--batch", str(batch)] + (["--dcp"] if dcp else [])
    launched, sampler = _run(argv, dict(os.environ, PYTHONUNBUFFERED="1"), d, os.path.join(d, "run.log"), 900)
    log = os.path.join(d, "sd", "machines", "m0", "logs", "run1_rank0.out")
    return measure(read_steps(log), launched, sampler)


def ddp_main(kind: str, steps: int, batch: int, repeat: int) -> dict:
    """Bare torchrun against `stalwart run` of the DDP script (`kind`: plain or dcp); the ratios."""
    work = tempfile.mkdtemp(prefix="stalwart-overhead-ddp-")
    modes = ("bare", "stalwart")
    rounds: list[dict] = []
    try:
        for k in range(repeat):
            r = {}
            for mode in modes[k % 2:] + modes[:k % 2]:
                print(f"[DDP, 4 workers, {kind}] " + (f"round {k + 1}/{repeat}: " if repeat > 1 else "")
                      + f"{mode} ...", flush=True)
                r[mode] = torchrun_ddp(steps, batch, work) if mode == "bare" else \
                    stalwart_ddp(steps, batch, kind.startswith("dcp"), work, overlap=kind == "dcp-overlap")
            rounds.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = {m: median_of([x[m] for x in rounds]) for m in modes}
    label = "stalwart + DCP" if kind.startswith("dcp") else "stalwart run"
    print(f"\nDDP script, 4 workers (dp 4 on 2 machines x 2), batch {batch}, {steps} steps; window 30%..90%"
          + (f"; medians of {repeat} rounds" if repeat > 1 else ""))
    print(f"{'':34s}{'bare torchrun':>16s}{label:>16s}")
    for key, fmt in (("steps_per_s", "{:.2f}"), ("first_step_s", "{:.1f}"), ("step_s", "{:.4f}"),
                     ("worker_cpu_per_step", "{:.3f}"), ("own_cpu_per_step", "{:.4f}"),
                     ("launcher_cpu_per_step", "{:.4f}"), ("sdk_s_per_step", "{:.5f}")):
        vals = [fmt.format(r[m][key]) if key in r[m] else "-" for m in modes]
        print(f"{key:34s}" + "".join(f"{v:>16s}" for v in vals))
    bare, st = r["bare"], r["stalwart"]
    print("stalwart's own CPU-s per step by role: "
          + (", ".join(f"{k} {v:.4f}" for k, v in st["own_by_role"].items()) or "none")
          + f"; spares' one-time warm-up in the window {st['spare_warmup_cpu_per_step']:.4f} (not counted)")
    row = {"workers": 4, "tp": 1, "pp": 1, "dp": 4, "ddp": kind, "batch": batch,
           "throughput_ratio": round(st["steps_per_s"] / bare["steps_per_s"], 4),
           "own_cpu_share": round(st["own_cpu_per_step"] / st["worker_cpu_per_step"], 4),
           "sdk_blocking_share": round(st.get("sdk_s_per_step", 0.0) / st["step_s"], 4),
           "first_step_ratio": round(st["first_step_s"] / bare["first_step_s"], 4)}
    if repeat > 1:
        for k, x in enumerate(rounds):
            b, s = x["bare"], x["stalwart"]
            print(f"round {k + 1}: throughput {s['steps_per_s'] / b['steps_per_s']:.3f}x"
                  + (f", adapter blocking {100 * s.get('sdk_s_per_step', 0.0) / s['step_s']:.2f}%"
                     if kind.startswith("dcp") else ""))
    print(f"ratios vs bare torchrun: throughput {row['throughput_ratio']:.3f}x, stalwart's own CPU "
          f"{100 * row['own_cpu_share']:.1f}% of its workers'"
          + (f", DCP adapter blocking {100 * row['sdk_blocking_share']:.2f}% of a step "
             f"({1e3 * st.get('sdk_s_per_step', 0.0):.2f} ms)" if kind.startswith("dcp") else "")
          + f", first step {row['first_step_ratio']:.2f}x\n", flush=True)
    return row


def median_of(runs: list[dict]) -> dict:
    """The median of each figure over several runs of one mode (the keys of `measure`; those by
    role or by call key by key). A ratio of medians is what the rounds say: one slow round (the
    host busy with something else) moves it little."""
    out: dict = {}
    for key, v in runs[0].items():
        if isinstance(v, dict):
            out[key] = {k: statistics.median(r.get(key, {}).get(k, 0.0) for r in runs) for k in v}
        elif all(key in r for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def layout_row(tp: int, pp: int, dp: int, r: dict) -> dict:
    bare, st = r["bare"], r["stalwart"]
    return {"workers": tp * pp * dp, "tp": tp, "pp": pp, "dp": dp,
            "throughput_ratio": round(st["steps_per_s"] / bare["steps_per_s"], 4),
            "own_cpu_share": round(st["own_cpu_per_step"] / st["worker_cpu_per_step"], 4),
            "sdk_blocking_share": round(st.get("sdk_s_per_step", 0.0) / st["step_s"], 4),
            "first_step_ratio": round(st["first_step_s"] / bare["first_step_s"], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 4-worker layout alone, fewer steps")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 300, --quick 200)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="rounds of the three runs per layout, each in another order; medians are printed")
    ap.add_argument("--json", help="write the ratios per layout here")
    ap.add_argument("--ddp", choices=("plain", "dcp", "dcp-overlap"),
                    help="an ordinary DDP script instead of the GPT: unchanged (plain), with the DCP adapter "
                         "(dcp), or with the adapter's copy beside the next step (dcp-overlap: "
                         "STALWART_MEM_OVERLAP=1)")
    ap.add_argument("--batch", type=int, default=8192,
                    help="--ddp: samples per rank per step (default 8192; see the module's docstring)")
    a = ap.parse_args(argv)
    steps = a.steps or (200 if a.quick else 300)
    if a.batch < 1:
        ap.error("--batch must be >= 1")
    if steps < 50:
        ap.error("--steps must be >= 50 (the window is 30%%..90%% of the steps)")
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    if a.ddp:
        row = ddp_main(a.ddp, steps, a.batch, a.repeat)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"layouts": [row]}, f, indent=1)
        return 0
    layouts = LAYOUTS[:1] if a.quick else LAYOUTS
    work = tempfile.mkdtemp(prefix="stalwart-overhead-")
    rows = []
    try:
        for tp, pp, dp in layouts:
            rounds: list[dict] = []
            for k in range(a.repeat):
                r = {}
                for mode in MODES[k % 3:] + MODES[:k % 3]:
                    print(f"[{tp * pp * dp} workers, tp {tp} pp {pp} dp {dp}] "
                          + (f"round {k + 1}/{a.repeat}: " if a.repeat > 1 else "") + f"{mode} ...", flush=True)
                    r[mode] = (torchrun(tp, pp, dp, steps, mode == "sdk", work) if mode != "stalwart"
                               else stalwart(tp, pp, dp, steps, work))
                rounds.append(r)
            r = {m: median_of([x[m] for x in rounds]) for m in MODES}
            print(f"\n{tp * pp * dp} workers (tp {tp}, pp {pp}, dp {dp}), {steps} steps; window 30%..90%"
                  + (f"; medians of {a.repeat} rounds" if a.repeat > 1 else ""))
            print(f"{'':34s}{'bare torchrun':>16s}{'torchrun + SDK':>16s}{'stalwart run':>16s}")
            for key, fmt in (("steps_per_s", "{:.2f}"), ("first_step_s", "{:.1f}"),
                             ("worker_cpu_per_step", "{:.3f}"), ("own_cpu_per_step", "{:.4f}"),
                             ("launcher_cpu_per_step", "{:.4f}"), ("sdk_s_per_step", "{:.5f}")):
                vals = [fmt.format(r[m][key]) if key in r[m] else "-" for m in ("bare", "sdk", "stalwart")]
                print(f"{key:34s}" + "".join(f"{v:>16s}" for v in vals))
            st = r["stalwart"]
            print("stalwart's own CPU-s per step by role: "
                  + (", ".join(f"{k} {v:.4f}" for k, v in st["own_by_role"].items()) or "none")
                  + f"; spares' one-time warm-up in the window {st['spare_warmup_cpu_per_step']:.4f} (not counted)")
            if "sdk_parts_per_step" in st:
                print("SDK blocking s per step by call: "
                      + ", ".join(f"{k} {v:.5f}" for k, v in st["sdk_parts_per_step"].items()))
            if a.repeat > 1:
                for k, x in enumerate(rounds):
                    one = layout_row(tp, pp, dp, x)
                    print(f"round {k + 1}: throughput {one['throughput_ratio']:.3f}x, own CPU "
                          f"{100 * one['own_cpu_share']:.1f}%, SDK blocking {100 * one['sdk_blocking_share']:.2f}%, "
                          f"first step {one['first_step_ratio']:.2f}x")
            row = layout_row(tp, pp, dp, r)
            rows.append(row)
            print(f"ratios vs bare torchrun: throughput {row['throughput_ratio']:.3f}x, stalwart's own CPU "
                  f"{100 * row['own_cpu_share']:.1f}% of its workers', SDK blocking "
                  f"{100 * row['sdk_blocking_share']:.2f}% of a step, first step {row['first_step_ratio']:.2f}x\n",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"layouts": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
