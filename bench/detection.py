"""Detection benchmark: seconds from a fault to its detection, stalwart vs plain torchrun.

    python bench/detection.py [--bound 60] [--step 8] [--kinds gpu-lost,nic-down,machine-down]

For each kind the same small job (the bundled GPT, 2 machines x 1 worker, dp=2) runs twice:

- under stalwart (a real local cluster, one warm standby, `--chaos KIND@step=S,machine=1`):
  the report's incident `detection_s` = detected_at - injected_at;
- under plain torchrun: two agents (`--nnodes 2 --nproc-per-node 1`, c10d rendezvous on a
  TCPStore this script hosts at the gateway address, the way stalwart's controller hosts it),
  one per network namespace machine as root (both on loopback otherwise), workers with gloo's
  default 30 min collective timeout; "noticed" is the first error line printed by, or the exit
  of, a torchrun agent or worker that was not frozen by the fault — bounded by `--bound`.

How the same fault is made for torchrun (stated in the output too):

- machine-down: every process of machine 1 (agent and worker) is SIGSTOPped and its NIC taken
  down: the machine vanished without closing a socket or answering a packet, which is what a
  power loss looks like to gloo; survivors only learn at the collective timeout.
- gpu-lost: torchrun has no GPU probe. A GPU that fell off the bus leaves its process stuck in
  a CUDA call that never returns: the worker of machine 1 is SIGSTOPped, its agent keeps running
  and sees a live process. (Where the driver fails the call at once instead, the worker exits
  and torchrun sees a crash within its monitor interval; that is the `crash` case, not this.)
- nic-down: `ip link set down` on machine 1's NIC (needs root), every process keeps running.

The torchrun runs of all kinds share one bound window (they are idle after the fault); the
stalwart runs go one by one afterwards so their timings are not disturbed. Every process,
namespace and temp dir made here is removed at the end, also on Ctrl-C or failure.
"""
from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
from jobrun import gpt_spec, run_job  # noqa: E402

from stalwart.agent.workers import kill_tree  # noqa: E402

KINDS = ("gpu-lost", "nic-down", "machine-down", "sigstop", "cpu-throttle")
# seconds from the fault; for sigstop, from the moment the calibrated hang timeout starts counting
# (the last step before the hang) to the culprit being localized; cpu-throttle: fault to eviction
TARGETS = {"gpu-lost": 5.0, "nic-down": 10.0, "machine-down": 5.0, "sigstop": 20.0, "cpu-throttle": 60.0}
HOW = {
    "gpu-lost": "worker of m1 SIGSTOPped (stuck in a CUDA call), its agent alive",
    "nic-down": "m1's NIC set down, every process running",
    "machine-down": "m1's agent+worker SIGSTOPped and NIC down (power loss: no FIN, no RST)",
    "sigstop": "worker of m1 SIGSTOPped (a silent hang), its agent alive",
    "cpu-throttle": "m1's worker limited to 10% of a CPU (cgroup); torchrun has no slow-machine detector",
}
IMPLICIT = {"sigstop", "cpu-throttle"}      # 4 machines (the analyzer needs peers), cgroups for one
GLOO_DEFAULT_TIMEOUT_S = 1800
# a line that says something went wrong, from a torchrun agent or a gloo/torch worker
ERROR_RE = re.compile(r"Traceback|Error|ERROR|error|[Ff]ailed|FAILED|[Tt]imed out|[Tt]imeout|"
                      r"Connection (reset|closed|refused)|SIGTERM|exitcode|Signals\.")
STEP_RE = re.compile(r'^\{"step": (\d+)')


# ----- pure helpers -----------------------------------------------------------------------
def parse_kinds(text: str) -> list[str]:
    """The comma-separated fault kinds to measure; ValueError for an unknown one."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a comma list of {', '.join(KINDS)} (got {text!r})")
    return kinds


def is_error_line(line: str) -> bool:
    """Whether a line of torchrun/worker output reports a problem (step lines never do)."""
    return not STEP_RE.match(line) and bool(ERROR_RE.search(line))


def fmt_torchrun(noticed_s: float | None, bound_s: float, note: str = "") -> str:
    """The torchrun cell: seconds, or `> B s (bound)` when nothing noticed within the bound."""
    if note:
        return note
    return f"> {bound_s:.0f} (bound)" if noticed_s is None else f"{noticed_s:.2f}"


def fmt_ratio(stalwart_s: float | None, noticed_s: float | None, bound_s: float) -> str:
    """torchrun / stalwart; a lower bound `>= R x` when torchrun hit the bound."""
    if stalwart_s is None:
        return "-"
    s = max(stalwart_s, 1e-3)
    if noticed_s is None:
        return f">= {bound_s / s:.0f}x"
    return f"{noticed_s / s:.1f}x"


def target_verdict(kind: str, stalwart_s: float | None) -> str:
    """`pass` when stalwart detected within the kind's target, else `FAIL`."""
    return "pass" if stalwart_s is not None and stalwart_s <= TARGETS[kind] else "FAIL"


def render_table(rows: list[dict], bound_s: float) -> str:
    """The result table: kind | stalwart detect | torchrun notices | ratio | target | verdict."""
    head = f"{'kind':<13} | {'stalwart detect (s)':>19} | {'torchrun notices (s)':>20} | " \
           f"{'ratio':>8} | {'target':>7} | result"
    lines = [head, "-" * len(head)]
    for r in rows:
        sw = r.get("stalwart_s")
        lines.append(
            f"{r['kind']:<13} | {'-' if sw is None else f'{sw:.2f}':>19} | "
            f"{fmt_torchrun(r.get('torchrun_s'), bound_s, r.get('torchrun_note', '')):>20} | "
            f"{fmt_ratio(sw, r.get('torchrun_s'), bound_s) if not r.get('torchrun_note') else '-':>8} | "
            f"{'<= %.0f s' % TARGETS[r['kind']]:>7} | {target_verdict(r['kind'], sw)}")
    return "\n".join(lines)


# ----- stalwart -----------------------------------------------------------------------------
def stalwart_detection(kind: str, step: int, workdir: str) -> dict:
    """Run the small job with `KIND@step=S,machine=1` and return the fault's incident times."""
    if kind == "cpu-throttle":
        # fail-slow compares against the job's own baseline (20 steps before the 5 recent ones):
        # inject after it exists, and leave steps for up to 2 x 5 rounds at the throttled pace
        step = max(step, 30)
        spec = gpt_spec(machines=4, gpus=1, steps=step + 200, standby=1,
                        chaos=[f"{kind}@step={step},machine=1,fraction=0.1"])
        spec["policy"].update(hang_timeout_floor_s=30.0, failslow_period_s=2.0)
    elif kind in IMPLICIT:
        spec = gpt_spec(machines=4, gpus=1, steps=step + 60, standby=1,
                        chaos=[f"{kind}@step={step},machine=1"])
        spec["policy"].update(hang_timeout_floor_s=2.0, failslow_period_s=3.0)
    else:
        spec = gpt_spec(machines=2, gpus=1, steps=step + 20, standby=1,
                        chaos=[f"{kind}@step={step},machine=1"])
    rep = run_job(os.path.join(workdir, f"stalwart-{kind}"), spec, timeout=240)
    incs = [i for i in rep["incidents"] if i.get("injected_at") is not None]
    if not incs:
        return {"stalwart_s": None, "state": rep["state"], "symptom": None,
                "why": f"no incident with an injection time ({len(rep['incidents'])} incidents)"}
    inc = incs[0]
    out = {"stalwart_s": inc["detection_s"], "symptom": inc["symptom"], "state": rep["state"],
           "evicted": inc["machines_evicted"], "mechanism": inc["mechanism"]}
    if kind in IMPLICIT and inc.get("localized_at") is not None and inc.get("injected_at") is not None:
        # localized (culprit named) after the fault; the hang timeout starts counting at the last
        # progress, which is at most one step before the fault, so this bounds "after the timeout
        # starts counting" from above
        out["stalwart_s"] = round(inc["localized_at"] - inc["injected_at"], 2)
        out["detected_s"] = inc["detection_s"]
    return out


# ----- torchrun -----------------------------------------------------------------------------
@dataclass
class TorchrunPair:
    """Two torchrun agents (machines m0, m1) training the example; m1 receives the fault."""

    kind: str
    step: int
    workdir: str
    net: object | None = None                       # devices.netns.Network as root
    machines: list = field(default_factory=list)    # its Machines (empty on loopback)
    agents: list[subprocess.Popen] = field(default_factory=list)
    store: object | None = None
    lines: "queue.Queue[tuple[float, int, str]]" = field(default_factory=queue.Queue)
    injected_at: float | None = None
    noticed_at: float | None = None
    noticed_by: str = ""
    max_step: int = -1
    frozen: list[int] = field(default_factory=list)

    def start(self, prefix: str | None) -> None:
        """Build the machines (as root), host the rendezvous store, start both agents."""
        import torch.distributed as dist
        host = "127.0.0.1"
        if prefix is not None:
            from stalwart.devices.netns import Network
            self.net = Network(prefix)
            self.net.create()
            self.machines = [self.net.add_machine(i) for i in range(2)]
            host = self.net.gateway
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=GLOO_DEFAULT_TIMEOUT_S))
        for i in range(2):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{host}:{self.store.port}", "--rdzv-id", f"bench-{self.kind}",
                    "--rdzv-conf", "is_host=false", "--max-restarts", "0"]
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
            if self.machines:
                argv += ["--local-addr", self.machines[i].address]
                env = self.machines[i].env(env)
            argv += ["-m", "stalwart.examples.gpt", "--plain", "--layers", "2", "--steps", "1000000",
                     "--ckpt-every", "0", "--log-every", "1", "--timeout", str(GLOO_DEFAULT_TIMEOUT_S)]
            kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                      text=True, env=env, start_new_session=True, cwd=self.workdir)
            p = self.machines[i].popen(argv, **kw) if self.machines else subprocess.Popen(argv, **kw)
            self.agents.append(p)
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()

    def _read(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            self.lines.put((time.time(), i, line.rstrip()))

    def _tree(self, pid: int) -> list[psutil.Process]:
        try:
            root = psutil.Process(pid)
            return [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def inject(self) -> None:
        """Make the fault on machine 1 (see the module docstring for why each is faithful)."""
        agent = self.agents[1]
        if self.kind in ("gpu-lost", "sigstop"):
            workers = [c for c in self._tree(agent.pid)[1:] if "stalwart.examples.gpt" in " ".join(c.cmdline())
                       and "torch.distributed.run" not in " ".join(c.cmdline())]
            if not workers:
                raise RuntimeError("gpu-lost: the worker of m1 is not running")
            for w in workers:
                w.send_signal(signal.SIGSTOP)
                self.frozen.append(w.pid)
        elif self.kind == "machine-down":
            for proc in self._tree(agent.pid):
                proc.send_signal(signal.SIGSTOP)
                self.frozen.append(proc.pid)
        elif self.kind == "cpu-throttle":
            from stalwart.chaos.cgroup import CgroupChaos
            self.cgroup = CgroupChaos(f"bench-{os.getpid()}")
            self.cgroup.throttle_cpu([p.pid for p in self._tree(agent.pid)[1:]], fraction=0.1)
        self.injected_at = time.time()
        if self.kind in ("nic-down", "machine-down") and self.machines:
            from stalwart.chaos import net
            net.nic_down(self.machines[1])

    def poll(self, bound_s: float) -> bool:
        """Consume output; inject at `step`; True once noticed, past the bound, or ended."""
        while True:
            try:
                t, i, line = self.lines.get_nowait()
            except queue.Empty:
                break
            m = STEP_RE.match(line)
            if m:
                self.max_step = max(self.max_step, int(m.group(1)))
            if self.injected_at is None:
                if is_error_line(line) and "OMP_NUM_THREADS" not in line:
                    raise RuntimeError(f"torchrun {self.kind} m{i} failed before the fault: {line}")
                if self.max_step >= self.step:
                    self.inject()
            elif t >= self.injected_at and self.noticed_at is None and is_error_line(line):
                self.noticed_at, self.noticed_by = t, f"m{i}: {line[:160]}"
        if self.injected_at is not None and self.noticed_at is None:
            for i, a in enumerate(self.agents):
                if a.pid not in self.frozen and a.poll() is not None:
                    self.noticed_at, self.noticed_by = time.time(), f"m{i} agent exited ({a.returncode})"
        if self.injected_at is None:
            for i, a in enumerate(self.agents):
                if a.poll() is not None:
                    raise RuntimeError(f"torchrun {self.kind} agent m{i} exited ({a.returncode}) "
                                       f"before the fault at step {self.step}")
            return False
        return self.noticed_at is not None or time.time() - self.injected_at >= bound_s

    def result(self) -> dict:
        """Seconds from the fault to the first sign torchrun noticed it (None: not within bound)."""
        noticed = None if self.noticed_at is None else self.noticed_at - self.injected_at
        return {"torchrun_s": noticed, "noticed_by": self.noticed_by, "injected_at_step": self.max_step}

    def close(self) -> None:
        """Kill both agents' trees (also stopped ones), drop the store, remove the namespaces."""
        for a in self.agents:
            kill_tree(a.pid)
            try:
                a.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if a.stdout:
                a.stdout.close()
        self.store = None
        if getattr(self, "cgroup", None) is not None:
            self.cgroup.restore()
        if self.net is not None:
            self.net.destroy()


def torchrun_detection(kinds: list[str], step: int, bound_s: float, workdir: str,
                       startup_s: float = 180.0) -> dict[str, dict]:
    """Run one torchrun pair per kind at once, inject at `step`, wait for each notice (bounded)."""
    from stalwart.devices import netns
    root, why = netns.available()
    out: dict[str, dict] = {}
    pairs: list[TorchrunPair] = []
    try:
        for n, kind in enumerate(kinds):
            if kind == "nic-down" and not root:
                out[kind] = {"torchrun_s": None, "torchrun_note": f"n/a ({why})"}
                continue
            d = os.path.join(workdir, f"torchrun-{kind}")
            os.makedirs(d)
            pair = TorchrunPair(kind, step, d)
            pairs.append(pair)
            pair.start(f"bd{os.getpid() % 100000}x{n}" if root else None)
        deadline = time.time() + startup_s
        pending = list(pairs)
        while pending:
            pending = [p for p in pending if not p.poll(bound_s)]
            for p in pending:
                if p.injected_at is None and time.time() > deadline:
                    raise RuntimeError(f"torchrun {p.kind} did not reach step {step} in {startup_s:.0f} s")
            time.sleep(0.05)
        for p in pairs:
            out[p.kind] = p.result()
    finally:
        for p in pairs:
            p.close()
    return out


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Measure every kind under torchrun and stalwart, print the table and the targets."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bound", type=float, default=60.0,
                    help="seconds to wait for torchrun to notice (default 60; gloo's own is 1800)")
    ap.add_argument("--step", type=int, default=8, help="inject after this many steps (default 8)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list (default: all of {', '.join(KINDS)})")
    a = ap.parse_args(argv)
    try:
        kinds = parse_kinds(a.kinds)
        if a.bound <= 0 or a.step < 1:
            raise ValueError("--bound must be > 0 and --step >= 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # a kill runs the same cleanup as Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-detect-") as d:
        print(f"torchrun: {len(kinds)} jobs at once, fault after step {a.step}, bound {a.bound:.0f} s ...",
              flush=True)
        tr = torchrun_detection(kinds, a.step, a.bound, d)
        rows = []
        for kind in kinds:
            print(f"stalwart: {kind} ...", flush=True)
            rows.append({"kind": kind, **tr[kind], **stalwart_detection(kind, a.step, d)})
    print()
    for r in rows:
        print(f"{r['kind']}: torchrun fault = {HOW[r['kind']]}")
        print(f"  torchrun noticed by: {r.get('noticed_by') or r.get('torchrun_note') or 'nothing within the bound'}")
        print(f"  stalwart: symptom {r.get('symptom')}, evicted {r.get('evicted')}, "
              f"mechanism {r.get('mechanism')}, job {r.get('state')}{' - ' + r['why'] if r.get('why') else ''}")
    print()
    print(render_table(rows, a.bound))
    print(f"\n(torchrun workers use gloo's default {GLOO_DEFAULT_TIMEOUT_S} s collective timeout; "
          f"bound {a.bound:.0f} s; whole run {time.time() - t0:.0f} s)")
    return 0 if all(target_verdict(r["kind"], r.get("stalwart_s")) == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
