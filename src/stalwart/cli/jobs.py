"""Commands that start or change a job: `run`, `submit`, `inject`, `update`, `cleanup`."""
from __future__ import annotations

import argparse
import os
import shutil
import uuid

from stalwart.chaos import catalogue
from stalwart.cli.common import (
    DEFAULT_STATE,
    UserError,
    api_client,
    chaos_help,
    job_options,
    need_controller,
    print_json,
    spec_from_args,
    state_options,
    torchrun_options,
)
from stalwart.cli.logs import LogTail, parse_ranks
from stalwart.controller.cluster.standby import standby_count


def cmd_run(a) -> int:
    from stalwart.backends.local import LocalCluster
    from stalwart.backends.statedir import StateDirBusy, StateDirLock
    need_controller("stalwart run")
    spec = spec_from_args(a)
    if a.spare < 0:
        raise UserError(f"--spare must be >= 0 (got {a.spare})")
    for c in spec.chaos:
        catalogue.check_isolated(catalogue.parse(c).kind, a.isolate_network)
    if a.isolate_network:
        from stalwart.backends.local import NetworkUnavailable, require_isolation
        try:
            require_isolation()
        except NetworkUnavailable as e:
            raise UserError(str(e)) from None
    shown = parse_ranks(a.log_ranks)
    lock = StateDirLock(a.state_dir)
    try:
        lock.acquire()      # one `stalwart run` per state dir, until this one ends
    except StateDirBusy as e:
        raise UserError(str(e)) from None
    try:
        if a.fresh:
            lock.clear()
        total = spec.machines + standby_count(spec) + a.spare
        cluster = LocalCluster(a.state_dir, total, spec.gpus_per_machine, heartbeat_s=spec.policy.heartbeat_s,
                               missed_beats=spec.policy.missed_beats, log_level=a.log_level,
                               network="isolated" if a.isolate_network else "host")
        print(f"stalwart: starting a controller and {total} machines ({spec.machines} active, "
              f"{standby_count(spec)} standby, {a.spare} spare) in {os.path.abspath(a.state_dir)}", flush=True)
        shows = "every rank" if shown is None else (
            "rank " + ",".join(map(str, sorted(shown))) if shown else "no rank")
        print(f"stalwart: the workers' output: {shows} and every rank's stderr here (--log-ranks); all of it: "
              f"stalwart logs --rank R" + ("" if a.state_dir == DEFAULT_STATE else f" --state-dir {a.state_dir}"),
              flush=True)
        from stalwart.backends.launch import run_job
        return run_job(cluster, spec, cluster.start, logs=LogTail(a.state_dir, ranks=shown),
                       target_given=a.steps is not None or config_sets(a.config, "steps"))
    finally:
        lock.release()


def config_sets(path: str | None, key: str) -> bool:
    """Does the job's config file name `key` (rather than leave it to its default)?"""
    if not path:
        return False
    import yaml
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    return isinstance(data, dict) and key in data


def cmd_submit(a) -> int:
    """Queue a job on a running controller; it starts when enough machines are free (FIFO)."""
    spec = spec_from_args(a)
    client = api_client(a, 30)
    job = client.post("/api/jobs", {"spec": spec.to_dict(), "idempotency_key": uuid.uuid4().hex})["job"]
    st = client.get(f"/api/jobs/{job}")
    state = (st.get("live") or {}).get("state") or st.get("state")
    if a.json:
        print_json({"job": job, "state": state})
        return 0
    where = f" --state-dir {a.state_dir}" if not a.controller else f" --controller {a.controller}"
    print(f"stalwart: job {job} submitted ({state}): {' '.join(spec.command)}\n"
          f"stalwart: follow it with: stalwart status --job {job} --watch{where}", flush=True)
    return 0


def cmd_inject(a) -> int:
    catalogue.check_kind(a.kind)
    text = f"{a.kind}@machine={a.machine}" + (f",rank={a.rank}" if a.rank is not None else "")
    for kv in a.param or []:
        if "=" not in kv:
            raise UserError(f"--param takes KEY=VALUE (got {kv!r})")
        text += "," + kv
    out = api_client(a, 5).post(f"/api/jobs/{a.job}/inject", {"chaos": text})
    print(f"injected {out['chaos']['kind']} on m{out['chaos']['machine']}")
    return 0


def cmd_update(a) -> int:
    from stalwart.spec import parse_duration
    if not os.path.isdir(a.code):
        raise UserError(f"--code {a.code} is not a directory")
    mode = "urgent" if a.urgent else ("window" if a.window and a.only_window else "lazy")
    window = parse_duration(a.window) if a.window else None
    row = api_client(a, 60).post(
        f"/api/jobs/{a.job}/versions", {"code": os.path.abspath(a.code), "mode": mode, "window_s": window})
    when = {"urgent": "now", "lazy": "at the next failure" + (f" or within {a.window}" if a.window else ""),
            "window": f"when its window ({a.window}) expires"}[mode]
    print(f"code version {row['id']} ({row['hash'][:12]}) registered as {row['status']}; applied {when}")
    return 0


def cmd_cleanup(a) -> int:
    from stalwart.backends.local import cleanup_stale
    from stalwart.backends.statedir import StateDirLock
    holder = StateDirLock(a.state_dir).held_elsewhere()
    if holder is not None:
        raise UserError(f"a `stalwart run` still runs in {os.path.abspath(a.state_dir)} ({holder}): nothing "
                        "is left over; stop it with Ctrl-C in its terminal, or kill that pid")
    killed = cleanup_stale(a.state_dir)
    print(f"stopped {len(killed)} leftover process(es)")
    if a.orphans:
        from stalwart.agent.paths import orphans
        gone = orphans()
        for root in gone:
            shutil.rmtree(root, ignore_errors=True)
        print(f"freed the checkpoint memory of {len(gone)} machine(s) whose directory is gone")
    return 0


def add_parsers(sub) -> None:
    r = sub.add_parser("run", help="run a job on a local cluster", epilog=chaos_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    job_options(r)
    torchrun_options(r)
    r.add_argument("--log-ranks", "--local-ranks-filter", dest="log_ranks", default="0",
                   help="whose output the console shows besides every rank's stderr: ranks like 0,2-3, "
                        "'all' or 'none' (default 0; the rest: stalwart logs)")
    r.add_argument("--spare", type=int, default=0,
                   help="extra idle machines the standby pool refills from after a failover (default 0)")
    r.add_argument("--state-dir", default=DEFAULT_STATE)
    r.add_argument("--fresh", action="store_true", help="delete the state dir first")
    r.add_argument("--isolate-network", action="store_true",
                   help="each machine's workers in their own network namespace on a bridge (root only): "
                        "network faults become real, but the workers have no DNS and no route out "
                        "(default: the host's network, as without stalwart)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    r.set_defaults(fn=cmd_run)

    sb = sub.add_parser("submit", help="queue a job on a running controller (FIFO until enough machines "
                                       "are free)", epilog=chaos_help(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    job_options(sb)
    torchrun_options(sb)
    state_options(sb, job=False)
    sb.add_argument("--json", action="store_true", help="print {\"job\": ID, \"state\": ...} on stdout")
    sb.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    sb.set_defaults(fn=cmd_submit)

    i = sub.add_parser("inject", help="inject a fault into the running job", epilog=chaos_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("kind", help="the fault to inject, one of the kinds listed below")
    i.add_argument("--machine", type=int, required=True, help="machine index M (machine mM)")
    i.add_argument("--rank", type=int)
    i.add_argument("--param", action="append", help="KEY=VALUE for the kind (code=79, peer=2, rate=1mbit, "
                                                    "fraction=0.1, times=3), repeatable")
    state_options(i)
    i.set_defaults(fn=cmd_inject)

    u = sub.add_parser("update", help="register a new code version for hot update")
    u.add_argument("--code", required=True, help="directory with the new code (snapshotted, immutable)")
    u.add_argument("--urgent", action="store_true", help="apply now (stop, restart in place)")
    u.add_argument("--window", help="apply at the latest after this long (e.g. 24h); default: the "
                                    "job's policy.hot_update_window_s")
    u.add_argument("--only-window", action="store_true", help="do not apply at a failure, only when "
                                                              "the window expires")
    state_options(u)
    u.set_defaults(fn=cmd_update)

    k = sub.add_parser("cleanup", help="stop processes a crashed `stalwart run` left behind")
    k.add_argument("--state-dir", default=DEFAULT_STATE)
    k.add_argument("--orphans", action="store_true",
                   help="also free /dev/shm checkpoint memory of machines whose directory was removed")
    k.set_defaults(fn=cmd_cleanup)
