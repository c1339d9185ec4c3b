"""How many agents one controller holds: heartbeat latency, false losses and CPU at N agents.

A real controller (`stalwart controller`, its own process, SQLite) and N simulated agents that
speak the real protocol over real sockets (bench/scale_agents.py): each opens its channel (one
WebSocket, the real agent's client code), registers, beats once a second, gets its commands pushed
and sends its events (its ranks' reports of a step, at one step a second, merged into one message
as the real agent merges them, and one metrics sample a second) for one running job of N
machines; against a controller without channels (the "before" column) they fall back to HTTP
requests as the real agent does. The agents are asyncio tasks (uvloop where installed) spread
over a few processes; they start no workers (a `start` command makes them report steps, a `stop`
makes them report stopped).

Printed: heartbeat round-trip p50/p99 over the measurement window (the round trip of each
message or request that carried a machine's beat, to its answer: as the real agent, a simulated
one whose batch of events went through skips its heartbeat, so while the job trains the beat
rides on the events), machines the controller called lost although their agents kept beating
(false losses), and the controller's CPU per agent; the same for
the thread-per-request controller of commit 9740bb6 (from git, `--before REF`), side
by side; and the load generator's own figures:
its lag (how late it sent, p99) and its CPU per agent. `--json FILE` writes the current controller's figures:
{"agents", "heartbeat_p50_ms", "heartbeat_p99_ms", "false_lost", "controller_cpu_per_agent"}
(`controller_cpu_per_agent`: CPU-seconds per second per agent, i.e. the share of a core).

    python bench/controller_scale.py --agents 256 --json /tmp/scale.json
    python bench/controller_scale.py --agents 2048 --duration 60 --before none

A benchmark, not a test: run it on an idle host (the load generator shares the cores).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

import psutil

from scale_agents import load_process
from stalwart.transport.client import ApiError, Client, ControllerUnreachable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the thread-per-request controller: the last commit before the auth, typed API, several jobs and agents' backoff
THREAD_PER_REQUEST = "9740bb6"


# -- the controller under test --------------------------------------------------------------------

def source_of(ref: str, into: str) -> str:
    """The package source at git `ref`, unpacked under `into`; returns the directory to put on
    PYTHONPATH."""
    archive = os.path.join(into, "src.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", "-o", archive, ref, "src"],
                   check=True, capture_output=True)
    with tarfile.open(archive) as tf:
        tf.extractall(into, filter="data")
    return os.path.join(into, "src")


def start_controller(state_dir: str, src: str | None) -> tuple[subprocess.Popen, str]:
    port_file = os.path.join(state_dir, "port")
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "stalwart.cli", "controller", "--db",
                             f"sqlite:///{state_dir}/stalwart.db", "--listen", "127.0.0.1:0",
                             "--state-dir", state_dir, "--port-file", port_file, "--heartbeat", "1",
                             "--missed-beats", "3", "--log-level", "WARNING"], env=env, cwd=state_dir,
                            stdout=open(os.path.join(state_dir, "controller.log"), "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the controller did not start; see {state_dir}/controller.log")
        time.sleep(0.1)
    with open(port_file) as f:
        return proc, f"http://127.0.0.1:{int(f.read().strip())}"


def api(base: str, token: str | None, path: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    client = Client(base, timeout=timeout, token=token)
    return client.get(path) if body is None else client.post(path, body)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(n: int, src: str | None, args, label: str = "this controller") -> dict:
    """One controller (current code, or `src`) under `n` simulated agents."""
    state_dir = tempfile.mkdtemp(prefix="stalwart-scale-")
    proc, base = start_controller(state_dir, src)
    token_file = os.path.join(state_dir, "token")
    token = open(token_file).read().strip() if os.path.exists(token_file) else None
    ctx = mp.get_context("spawn")
    measuring, stopping, out = ctx.Event(), ctx.Event(), ctx.Queue()
    ids = [f"m{i}" for i in range(n)]
    procs = [ctx.Process(target=load_process, args=(ids[i::args.procs], base, token, args.gpus,
                                                   args.ramp, measuring, stopping, out), daemon=True)
             for i in range(args.procs)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.ramp + 120
        alive: set[str] = set()
        while len(alive) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(alive)} of {n} agents registered")
            time.sleep(1.0)
            try:
                alive = {m["id"] for m in api(base, token, "/api/machines")["machines"] if m.get("alive")}
            except (ControllerUnreachable, ApiError):
                continue
            print(f"  [{label}] {len(alive)}/{n} agents registered", flush=True)
        code_dir = os.path.join(state_dir, "code")      # nothing runs it: the agents are simulated
        os.makedirs(code_dir, exist_ok=True)
        spec = {"name": "scale", "machines": n, "gpus_per_machine": args.gpus, "steps": 10 ** 7,
                "command": ["python", "-c", "pass"], "code_dir": code_dir,
                "policy": {"heartbeat_s": 1.0, "missed_beats": 3}}
        try:
            job = api(base, token, "/api/jobs", {"spec": spec})["job"]
        except ApiError as e:
            raise RuntimeError(f"the job was refused: {e}") from None
        deadline = time.monotonic() + 120
        while True:
            st = api(base, token, f"/api/jobs/{job}")
            if (st.get("steps_completed") or 0) >= 3 or st["state"] not in ("pending", "waiting", "running"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not train within 120s: {st['state']} {st.get('reason')}")
            time.sleep(1.0)
        if st["state"] == "running":
            print(f"  [{label}] job {job} trains; warming up {args.warmup:.0f}s, measuring "
                  f"{args.duration:.0f}s", flush=True)
            time.sleep(args.warmup)
        else:       # the controller could not hold the job: that is the figure (its losses are counted)
            print(f"  [{label}] job {job} {st['state']}: {str(st.get('reason'))[:200]}", flush=True)
        ctl = psutil.Process(proc.pid)
        gens = [psutil.Process(p.pid) for p in procs]
        gen0 = sum(sum(g.cpu_times()[:2]) for g in gens)
        cpu0, t0 = sum(ctl.cpu_times()[:2]), time.monotonic()
        first = api(base, token, f"/api/jobs/{job}")
        # the live step is the job's own; the report's `steps_completed` may be a reused report
        live_t0, steps0, live0 = time.monotonic(), first["steps_completed"], (first.get("live") or {}).get("step")
        spy = None
        if args.profile and not src:
            pyspy = os.path.join(os.path.dirname(sys.executable), "py-spy")
            spy = subprocess.Popen([pyspy, "record", "-p", str(proc.pid), "-d", str(int(args.duration) + 60),
                                    "-r", "200", "--nonblocking", "--gil", "--format", "raw", "-o", args.profile],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        measuring.set()
        lost: set[str] = set()
        polls = []
        while time.monotonic() - t0 < args.duration:
            time.sleep(2.0)
            q0 = time.perf_counter()
            ms = api(base, token, "/api/machines")["machines"]
            polls.append(time.perf_counter() - q0)
            lost |= {m["id"] for m in ms if not m.get("alive")}
        measuring.clear()
        cpu1, t1 = sum(ctl.cpu_times()[:2]), time.monotonic()
        gen1 = sum(sum(g.cpu_times()[:2]) for g in gens)
        if spy is not None:      # (with thousands of threads it samples slower than asked: stop it)
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(120)
            except subprocess.TimeoutExpired:
                spy.kill()
            print(f"  [{label}] py-spy profile of the controller (collapsed stacks): {args.profile}")
        st = api(base, token, f"/api/jobs/{job}")
        live_t1, live1 = time.monotonic(), (st.get("live") or {}).get("step")
        # every loss is false (the simulated agents never stop beating): machines seen not alive,
        # and machines the job evicted as lost
        for inc in st.get("incidents", []):
            lost |= set(inc.get("machines_evicted") or [])
        stopping.set()
        rtts: list[float] = []
        lags: list[float] = []
        errors: dict[str, int] = {}
        for _ in procs:
            r, lg, e = out.get(timeout=60)
            rtts += r
            lags += lg
            for k, v in e.items():
                errors[k] = errors.get(k, 0) + v
        return {"agents": n, "heartbeat_p50_ms": round(pct(rtts, 0.50), 2),
                "heartbeat_p99_ms": round(pct(rtts, 0.99), 2), "false_lost": len(lost),
                "controller_cpu_per_agent": round((cpu1 - cpu0) / (t1 - t0) / n, 6),
                # CPU per delivered beat: robust where an overloaded controller served fewer
                "_controller_cpu_per_beat_us": round((cpu1 - cpu0) / max(1, len(rtts)) * 1e6, 1),
                "_beats": len(rtts), "_errors": errors, "_state": st["state"],
                "_reason": str(st.get("reason") or "")[:60],
                "_generator_lag_p99_ms": round(pct(lags, 0.99), 1),
                "_generator_cpu_per_agent": round((gen1 - gen0) / (t1 - t0) / n, 6),
                "_steps_per_s": round((st["steps_completed"] - steps0) / (t1 - t0), 2),
                "_live_steps_per_s": (round((live1 - live0) / (live_t1 - live_t0), 2)
                                      if live0 is not None and live1 is not None else None),
                "_machines_api_s": round(pct(polls, 0.5), 3)}
    finally:
        stopping.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        if args.keep:
            print(f"  [{label}] kept {state_dir} (controller.log, stalwart.db)")
        else:
            shutil.rmtree(state_dir, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=256, help="simulated agents (machines); default 256")
    ap.add_argument("--gpus", type=int, default=1, help="ranks per simulated machine (default 1)")
    ap.add_argument("--duration", type=float, default=30.0, help="measurement window, seconds (default 30)")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of training before measuring")
    ap.add_argument("--ramp", type=float, default=10.0, help="seconds over which the agents start")
    ap.add_argument("--procs", type=int, default=2, help="load-generating processes (default 2)")
    ap.add_argument("--before", default=THREAD_PER_REQUEST,
                    help=f"git ref of the controller to compare with (default {THREAD_PER_REQUEST}, the last "
                         "thread-per-request controller); 'none' to skip")
    ap.add_argument("--json", help="write this controller's figures here")
    ap.add_argument("--keep", action="store_true", help="keep the controllers' state dirs (logs, database)")
    ap.add_argument("--profile", help="py-spy the controller during the window; collapsed stacks here")
    args = ap.parse_args(argv)
    if args.agents < 1 or args.procs < 1 or args.duration <= 0:
        ap.error("--agents, --procs and --duration must be positive")
    rows = [("this controller", measure(args.agents, None, args))]
    if args.before != "none":
        tmp = tempfile.mkdtemp(prefix="stalwart-before-")
        try:
            src = source_of(args.before, tmp)
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"no comparison: cannot unpack {args.before} from git ({e})", file=sys.stderr)
        else:
            try:
                label = (f"thread-per-request ({args.before})" if args.before == THREAD_PER_REQUEST
                         else f"at {args.before}")
                rows.append((label, measure(args.agents, src, args, label)))
            except (RuntimeError, ApiError, ControllerUnreachable) as e:
                print(f"the controller of {args.before} failed under {args.agents} agents: {e}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    keys = ["heartbeat_p50_ms", "heartbeat_p99_ms", "false_lost", "controller_cpu_per_agent",
            "_controller_cpu_per_beat_us", "_steps_per_s", "_live_steps_per_s",
            "_machines_api_s", "_beats", "_generator_lag_p99_ms", "_generator_cpu_per_agent", "_errors", "_state"]
    print(f"\n{args.agents} agents, {args.gpus} rank(s) each, 1 beat/s, 1 step/s, {args.duration:.0f}s window")
    print(f"{'':28s}" + "".join(f"{label:>30s}" for label, _ in rows))
    for k in keys:
        print(f"{k.lstrip('_'):28s}" + "".join(f"{str(r[k]):>30s}" for _, r in rows))
    for label, r in rows:
        if r["_reason"]:
            print(f"{label}: the job {r['_state']}: {r['_reason']}")
    if len(rows) == 2:
        now, before = rows[0][1], rows[1][1]
        if before["heartbeat_p99_ms"] and now["heartbeat_p99_ms"]:
            print(f"heartbeat p99: {now['heartbeat_p99_ms'] / before['heartbeat_p99_ms']:.3g}x of before")
        if before["controller_cpu_per_agent"] and now["controller_cpu_per_agent"]:
            print(f"controller CPU per agent: "
                  f"{now['controller_cpu_per_agent'] / before['controller_cpu_per_agent']:.3g}x of before")
        if before["_controller_cpu_per_beat_us"] and now["_controller_cpu_per_beat_us"]:
            print(f"controller CPU per delivered beat: "
                  f"{now['_controller_cpu_per_beat_us'] / before['_controller_cpu_per_beat_us']:.3g}x of before")
    if args.json:
        mine = rows[0][1]
        with open(args.json, "w") as f:
            json.dump({k: mine[k] for k in ("agents", "heartbeat_p50_ms", "heartbeat_p99_ms", "false_lost",
                                            "controller_cpu_per_agent")}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
