"""Commands that read a job: `status`, `report`, `machines`, `versions`, `stacks`, `logs`."""
from __future__ import annotations

import json
import os

from stalwart.backends import statedir
from stalwart.cli.common import (DEFAULT_STATE, UserError, api_client, offline_report, report, state_options)
from stalwart.client import ControllerUnreachable


def cmd_status(a) -> int:
    if a.watch:
        from stalwart.watch import watch
        if a.interval <= 0:
            raise UserError(f"--interval must be > 0 (got {a.interval})")
        client = api_client(a, 10)
        return watch(lambda: client.get(f"/api/jobs/{a.job}"), a.interval)
    rep = report(a)
    live = rep.get("live") or {}
    print(f"job {rep['job']}: {live.get('state', rep['state'])}" + (f" ({rep['reason']})" if rep.get("reason") else ""))
    target = f"/{rep['steps_target']}" if rep.get("steps_target") else ""       # none for a plain script
    print(f"  step {live.get('step', rep['steps_completed'])}{target}"
          f"  loss {live.get('loss', rep['final_loss'])}"
          f"  run {live.get('run', len(rep['runs']))}  ETTR {rep['ettr']:.3f}")
    warm = set(live.get("standby_warm") or ())
    for m in rep["machines"]:
        note = " (warm)" if m["id"] in warm else ""
        print(f"  machine {m['id']:<6} {m['state'] + note:<9} {m.get('address') or ''} {m.get('reason') or ''}")
    for inc in rep["incidents"]:
        print(f"  incident {inc['id']}: {inc['symptom']} -> {inc['mechanism']} evicted {inc['machines_evicted']}")
    return 0


def cmd_report(a) -> int:
    from stalwart.progress import summary
    from stalwart.report_html import load_series, render
    rep = report(a)
    rep.pop("live", None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    if a.html:
        live = a.controller or os.path.exists(os.path.join(a.state_dir, "controller.json"))
        with open(a.html, "w") as f:
            f.write(render(rep, load_series(api_client(a, 10) if live else None, a.state_dir, rep["job_id"])))
    print(summary(rep))
    return 0


def cmd_versions(a) -> int:
    vs = api_client(a, 10).get(f"/api/jobs/{a.job}/versions")["versions"]
    for v in vs:
        print(f"{v['id']:>3} {v['hash'][:12]} {v['status']:<11} {v['mode']:<6} {v['source']}"
              + (f"  ({v['reason']})" if v.get("reason") else ""))
    return 0


def cmd_machines(a) -> int:
    try:
        ms = api_client(a, 5).get("/api/machines")["machines"]
    except (UserError, ControllerUnreachable):
        ms = offline_report(a)["machines"]
    for m in ms:
        print(f"{m['id']:<8} {m['state']:<9} {m.get('address') or '':<16} {m.get('reason') or ''}")
    return 0


def cmd_stacks(a) -> int:
    """The stacks captured for an incident, grouped the way the analyzer grouped them."""
    from stalwart.analyzer.stacks import group_records
    from stalwart.controller.store import Store
    url = a.db or statedir.db_url(a.state_dir)
    if not a.db and not os.path.exists(statedir.db_path(a.state_dir)):
        raise UserError(f"no stalwart state in {os.path.abspath(a.state_dir)} (pass --state-dir or --db)")
    store = Store(url)
    try:
        job = store.latest_job() if a.job == "latest" else store.job(int(a.job))
        incs = {i["id"]: i for i in store.incidents(job["id"])} if job else {}
    finally:
        store.close()
    if a.incident not in incs:
        raise UserError(f"no incident {a.incident} in job {job['id'] if job else '-'} "
                        f"(incidents: {sorted(incs) or 'none'})")
    inc = incs[a.incident]
    stacks = inc["data"].get("stacks")
    if not stacks:
        raise UserError(f"incident {a.incident} ({inc['symptom']}) has no captured stacks")
    print(f"incident {a.incident}: {inc['symptom']} — {inc['data'].get('analysis', '')}")
    for key, who in group_records(stacks):
        print(f"\n== {len(who)} process(es): {', '.join(who)}")
        print("   " + key.replace("\n", "\n   ")[-3000:])
    return 0


def _tail(path: str, lines: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 256 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def log_files(state_dir: str, rank: int | None, machine: str | None, slurm_job: str | None) -> list[str]:
    """The logs `stalwart logs` shows: a rank's newest training output, a machine's agent, or the
    controller's (and the Slurm job's output)."""
    import glob
    import re
    if rank is not None:
        found = []
        for path in glob.glob(os.path.join(state_dir, "machines", "*", "logs", f"run*_rank{rank}.out")):
            m = re.search(r"run(\d+)_rank", os.path.basename(path))
            found.append((int(m.group(1)) if m else -1, os.path.getmtime(path), path))
        return [max(found)[2]] if found else []
    if machine is not None:
        return [p for p in (os.path.join(state_dir, "logs", f"agent-{machine}.log"),
                            os.path.join(state_dir, "logs", "agents-step.log")) if os.path.exists(p)][:1]
    out = [os.path.join(state_dir, "logs", "controller.log")]
    if slurm_job:
        out.append(os.path.join(state_dir, "slurm", "logs", f"slurm-{slurm_job}.out"))
    return [p for p in out if os.path.exists(p)]


def cmd_logs(a) -> int:
    files = log_files(a.state_dir, a.rank, a.machine, getattr(a, "slurm_job", None))
    if not files:
        what = (f"rank {a.rank}'s output" if a.rank is not None else
                f"machine {a.machine}'s agent log" if a.machine else "a controller log")
        raise UserError(f"no {what} in {os.path.abspath(a.state_dir)}")
    for path in files:
        if len(files) > 1:
            print(f"==> {path} <==")
        print(_tail(path, a.lines))
    return 0


def add_parsers(sub) -> None:
    for name, fn, hlp in (("status", cmd_status, "live state of the current/last job"),
                          ("report", cmd_report, "the job's report (ETTR, incidents)"),
                          ("machines", cmd_machines, "machines and their states")):
        s = sub.add_parser(name, help=hlp)
        state_options(s)
        if name == "status":
            s.add_argument("--watch", action="store_true", help="refresh in place until the job ends "
                                                               "(plain lines when not a terminal)")
            s.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (--watch)")
        if name == "report":
            s.add_argument("--json", help="write the JSON report here")
            s.add_argument("--html", help="write the HTML report here")
        s.set_defaults(fn=fn)

    v = sub.add_parser("versions", help="the job's code versions")
    state_options(v)
    v.set_defaults(fn=cmd_versions)

    lg = sub.add_parser("logs", help="the controller's log (and a Slurm job's output), a machine's agent log, or a "
                                     "rank's training output")
    lg.add_argument("--state-dir", default=DEFAULT_STATE)
    lg.add_argument("--slurm-job", metavar="ID", help="the Slurm job (stalwart slurm sbatch/run) whose logs to show")
    lg.add_argument("--rank", type=int, help="this rank's training output (its newest run)")
    lg.add_argument("--machine", help="this machine's agent log, e.g. m3")
    lg.add_argument("-n", "--lines", type=int, default=50, help="the last this many lines (default 50)")
    lg.set_defaults(fn=cmd_logs)

    st = sub.add_parser("stacks", help="stacks captured for an incident (hangs, fail-slow)")
    st.add_argument("incident", type=int)
    st.add_argument("--state-dir", default=DEFAULT_STATE)
    st.add_argument("--db", help="SQLAlchemy URL of the controller's store (default: the state dir's)")
    st.add_argument("--job", default="latest")
    st.set_defaults(fn=cmd_stacks)
