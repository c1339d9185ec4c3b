"""`stalwart sim`: replay the same failure traces under several policies and compare their ETTR.

One trace per seed (`failures.trace`), each replayed unchanged under every policy (`peers.POLICIES`)
by the engine (the real job core on a simulated clock); the table, the JSON and the plot come from
`results`. User mistakes end in one `error:` line (`ValueError` here, turned into the CLI's
UserError by the caller).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from typing import TYPE_CHECKING, Any

from stalwart.sim import peers

if TYPE_CHECKING:
    from stalwart.sim.engine import Config
    from stalwart.sim.failures import Model

DEFAULT_PP = 8            # pipeline stages of the simulated job unless --pp names them
DEFAULT_POLICIES = ("requeue,nvrx-like,byterobust,stalwart,stalwart-no-standby,stalwart-no-inmem-ckpt,"
                    "stalwart-no-over-evict,stalwart-no-hot-update")


def add_commands(sub: Any) -> None:
    """`stalwart sim` (the heavy modules load when it runs)."""
    s = sub.add_parser("sim", help="simulate one long job on a large cluster under several policies (ETTR)",
                       description=__doc__.split("\n\n")[0])
    s.add_argument("--gpus", type=int, default=9600, help="GPUs of the whole job, all machines together "
                                                          "(default 9600)")
    s.add_argument("--gpus-per-machine", type=int, default=8)
    s.add_argument("--pp", type=int, default=None,
                   help=f"pipeline stages (machines per pipeline; default {DEFAULT_PP}, or the largest "
                        f"number below it that divides the machines)")
    s.add_argument("--days", type=float, default=90.0, help="simulated days (default 90)")
    s.add_argument("--scenario", help="failure scenario: bytedance-dense | bytedance-moe | llama3-16k | a scenario "
                                      "YAML/JSON file (default: the dense job's three streams alone)")
    s.add_argument("--profile", help="durations: paper | measured | a profile JSON file (default: the "
                                     "scenario's, else paper)")
    s.add_argument("--rates-of-gpus", type=int, metavar="GPUS",
                   help="a smaller simulated job that sees, per hour, the machine failures of a GPUS-GPU job "
                        "(per-machine rates scaled by GPUS / --gpus): the same incidents at a fraction of the cost")
    s.add_argument("--seeds", type=int, default=1, help="traces to run (seeds 1..N); mean and spread")
    s.add_argument("--seed", type=int, default=1, help="the first seed (default 1)")
    s.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma list (default: {DEFAULT_POLICIES}; known: {', '.join(peers.POLICIES)}; or all)")
    s.add_argument("--standby", default="auto", help="standbys: N or auto (P99 of Binomial, default)")
    s.add_argument("--step-s", type=float, default=10.0, help="seconds per training step (default 10)")
    s.add_argument("--durable-every-s", type=float, default=1800.0,
                   help="durable checkpoint interval (default 1800 s)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a failure-model value (daily_rate, multi_machine_share, ...)")
    s.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write the results as JSON to FILE, or on stdout with - or no FILE (the tables then "
                        "go to stderr)")
    s.add_argument("--plot", help="write the ETTR-over-time plot (SVG) to this file")
    s.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="simulations run side by side in processes (default: the CPU count)")
    s.add_argument("--whatif", action="store_true",
                   help="agents report per-rank compute times; print the what-if straggler analysis")
    s.add_argument("--quiet", action="store_true", help="no progress lines")
    s.set_defaults(fn=main)


def default_pp(machines: int) -> int:
    """The pipeline stages of a job of `machines` when none are named: DEFAULT_PP, or the largest
    number of stages below it that leaves whole pipelines, at least two of them (pure)."""
    for pp in range(DEFAULT_PP, 0, -1):
        if machines % pp == 0 and machines >= 2 * pp:
            return pp
    return DEFAULT_PP            # (too few machines for any: the check says so)


def config(a: argparse.Namespace) -> tuple["Config", "Model", list[peers.Platform]]:
    """The settings, the failure model (the scenario's, with --set on top) and the policies; sets
    `a.profile` to the scenario's profile when none was given."""
    from stalwart.sim.engine import Config
    from stalwart.sim.failures import Model
    from stalwart.sim.scenario import load as load_scenario
    if a.pp is None and a.gpus >= 1 and a.gpus_per_machine >= 1:
        a.pp = default_pp(a.gpus // a.gpus_per_machine)
        if a.pp != DEFAULT_PP:
            stages = f"{a.pp} stage{'' if a.pp == 1 else 's'}"
            print(f"note: {a.gpus // a.gpus_per_machine} machines: pipelines of {stages} ({DEFAULT_PP} "
                  f"does not divide them; --pp N to choose)", file=sys.stderr)
    for name in ("gpus", "gpus_per_machine", "pp", "seeds", "jobs"):
        if getattr(a, name) is None or getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    if a.standby != "auto" and not (a.standby.isdigit()):
        raise ValueError(f"--standby must be a number >= 0 or auto (got {a.standby!r})")
    if not (a.days > 0 and a.days <= 3650):
        raise ValueError(f"--days must be > 0 and at most 3650 (got {a.days})")
    cfg = Config(gpus=a.gpus, gpus_per_machine=a.gpus_per_machine, pp=a.pp, days=a.days, step_s=a.step_s,
                 durable_every_s=a.durable_every_s, standby=a.standby, compute_times=a.whatif)
    cfg.check()
    model = Model()
    if a.scenario:
        sc = load_scenario(a.scenario)
        model = sc.failures
        if a.profile is None:
            a.profile = sc.profile
    if a.profile is None:
        a.profile = "paper"
    for kv in a.set:
        key, eq, value = kv.partition("=")
        if not eq:
            raise ValueError(f"--set wants KEY=VALUE (got {kv!r})")
        model.set(key.strip(), value.strip())
    rates_of = getattr(a, "rates_of_gpus", None)
    if rates_of is not None:
        if rates_of < a.gpus:
            raise ValueError(f"--rates-of-gpus ({rates_of}) must be at least --gpus ({a.gpus})")
        model = scale(model, rates_of / a.gpus)
    for path in (a.json if a.json != "-" else None, a.plot):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"cannot write {path}: no such directory")
    return cfg, model, peers.parse(a.policies)


def scale(model: "Model", k: float) -> "Model":
    """The model with its per-machine rates k times higher: a job of 1/k the machines then sees the
    incidents per hour of the full-size one (job-wide streams, durations and shares unchanged)."""
    import msgspec
    return msgspec.structs.replace(model, daily_rate=model.daily_rate * k,
                                   sdc_per_machine_day=model.sdc_per_machine_day * k)


def one(cfg: "Config", model: "Model", profile_name: str, policy: str, seed: int) -> dict:
    """One policy on one seed's trace (the trace depends on the seed alone)."""
    from stalwart.sim import results
    from stalwart.sim.cluster import job_labels
    from stalwart.sim.engine import Config, Sim
    from stalwart.sim.failures import trace
    from stalwart.sim.profile import load
    dp = cfg.machines // cfg.pp
    faults = trace(model, cfg.machines, cfg.days, seed, lambda i: job_labels(i, cfg.pp, dp)["switch"])
    t0 = time.perf_counter()
    sim = Sim(Config(**{**cfg.__dict__}), peers.POLICIES[policy], load(profile_name), model, faults, seed).run()
    r = results.summarize(sim, time.perf_counter() - t0)
    r["faults_total"] = len(faults)
    if cfg.compute_times:             # the what-if mode: the run's recorded per-rank times
        from stalwart.analyzer import whatif
        recs = [e["data"] for seg in sim.segments for e in seg.log if e["kind"] == "rank_times"]
        try:
            r["whatif"] = whatif.analyze(recs, sim.spec.topology())
        except ValueError as e:
            r["whatif"] = {"error": str(e)}
    return r


def simulate(cfg: "Config", model: "Model", profile_name: str, policies: list[peers.Platform], seeds: list[int],
             progress: Any = None, jobs: int = 1) -> list[dict]:
    """Every policy on every seed's trace: one summary per (policy, seed), in that order. `jobs`
    processes run simulations side by side (each is independent and deterministic)."""
    tasks = [(plat.name, seed) for seed in seeds for plat in policies]

    def said(r: dict) -> dict:
        if progress is not None:
            progress(f"seed {r['seed']} {r['policy']:<24} ETTR {r['ettr']:.2%}  ({r['runtime_s']:.1f} s, "
                     f"{r['faults_total']} faults)")
        return r
    if jobs <= 1 or len(tasks) == 1:
        return [said(one(cfg, model, profile_name, name, seed)) for name, seed in tasks]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from stalwart.controller.cluster.standby import p99_standbys
    p99_standbys(1, 0.0)            # scipy imported once, before the processes fork (seconds each)
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)),
                             mp_context=multiprocessing.get_context("fork")) as pool:
        futs = {pool.submit(one, cfg, model, profile_name, name, seed): (name, seed) for name, seed in tasks}
        done = {futs[f]: said(f.result()) for f in as_completed(futs)}
    return [done[t] for t in tasks]


def _cpu() -> float:
    """User CPU seconds of this process and its finished children (the simulations' processes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime


def main(a: argparse.Namespace) -> int:
    from stalwart.sim import results
    from stalwart.sim.profile import load
    cfg, model, policies = config(a)
    load(a.profile)                       # a bad profile fails before any work
    t0 = time.perf_counter()
    cpu0 = _cpu()
    say = None if a.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    runs = simulate(cfg, model, a.profile, policies, list(range(a.seed, a.seed + a.seeds)), say, a.jobs)
    runtime = time.perf_counter() - t0
    user = _cpu() - cpu0
    agg = results.aggregate(runs)
    out = sys.stderr if a.json == "-" else sys.stdout       # (stdout holds the JSON alone then)
    rates = f" (failure rates of {a.rates_of_gpus} GPUs)" if a.rates_of_gpus else ""
    print(f"stalwart sim: {cfg.gpus} GPUs ({cfg.machines} machines x {cfg.gpus_per_machine}), {a.days:g} days, "
          f"scenario {a.scenario or '(default)'}{rates}, profile {a.profile}, {a.seeds} seed(s), "
          f"step {cfg.step_s:g} s, durable checkpoint every {cfg.durable_every_s:g} s", file=out)
    print(results.table(agg), file=out)
    print(results.mechanisms_table(agg), file=out)
    for r in runs if a.whatif else []:
        w = r.get("whatif") or {}
        if "error" in w:
            print(f"what-if ({r['policy']}, seed {r['seed']}): {w['error']}", file=out)
        elif w:
            from stalwart.analyzer.whatif import render
            who = f"what-if ({r['policy']}, seed {r['seed']}, one rank per machine):"
            print(render(0, w).replace("job 0:", who, 1), file=out)
    slowest = max(runs, key=lambda r: r["runtime_s"])
    print(f"runtime {runtime:.1f} s (CPU {user:.1f} s) for {len(runs)} simulation(s) in {min(a.jobs, len(runs))} "
          f"process(es); the slowest simulation took {slowest['runtime_s']:.1f} s ({slowest['policy']}, "
          f"seed {slowest['seed']})", file=out)
    if a.json:
        with (open(a.json, "w") if a.json != "-" else contextlib.nullcontext(sys.stdout)) as f:
            doc = results.json_doc(cfg, a.profile, agg, runs, runtime, round(user, 2))
            doc.update(scenario=a.scenario, rates_of_gpus=a.rates_of_gpus)
            json.dump(doc, f, indent=1)
            f.write("\n")
    if a.plot:
        with open(a.plot, "w") as f:
            f.write(results.svg(runs, f"{cfg.gpus} GPUs, {a.days:g} days, profile {a.profile}"))
    return 0
