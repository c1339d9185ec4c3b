"""Commands that read a job: `status`, `report`, `machines`, `versions`, `stacks`, `whatif`. Each asks
the controller (--controller, $STALWART_CONTROLLER or the state dir's); `report`, `machines`,
`stacks` and `whatif` read the state dir's store when no controller runs there. `--json` prints what the API
answered."""
from __future__ import annotations

import json
import os

from stalwart.cli.common import (
    EXIT,
    UserError,
    api_client,
    offline_report,
    print_json,
    report,
    state_options,
    state_store_url,
)
from stalwart.errors import NotFound
from stalwart.transport.client import ControllerUnreachable

ENDED_BADLY = ("failed", "cancelled")


def cmd_status(a) -> int:
    if a.watch:
        from stalwart.console.watch import watch
        if a.interval <= 0:
            raise UserError(f"--interval must be > 0 (got {a.interval})")
        if a.json:
            raise UserError("--json prints one status; --watch refreshes it: give one of them")
        client = api_client(a, 10)
        last: dict = {}

        def fetch() -> dict:
            last.update(client.get(f"/api/jobs/{a.job}"))
            return last
        watch(fetch, a.interval)
        return EXIT.JOB_FAILED if last.get("state") in ENDED_BADLY else EXIT.OK
    rep = report(a)
    if a.json:
        print_json(rep)
        return EXIT.OK
    live = rep.get("live") or {}
    print(f"job {rep['job']}: {live.get('state', rep['state'])}" + (f" ({rep['reason']})" if rep.get("reason") else ""))
    target = f"/{rep['steps_target']}" if rep.get("steps_target") else ""       # none for a plain script
    loss = live.get("loss", rep["final_loss"])          # none until the SDK reports one
    print(f"  step {live.get('step', rep['steps_completed'])}{target}"
          + (f"  loss {loss}" if loss is not None else "")
          + f"  run {live.get('run', len(rep['runs']))}  ETTR {rep['ettr']:.3f}")
    warm = set(live.get("standby_warm") or ())
    for m in rep["machines"]:
        note = " (warm)" if m["id"] in warm else ""
        print(f"  machine {m['id']:<6} {m['state'] + note:<9} {m.get('address') or ''} {m.get('reason') or ''}")
    for inc in rep["incidents"]:
        print(f"  incident {inc['id']}: {inc['symptom']} -> {inc['mechanism']} evicted {inc['machines_evicted']}")
    return 0


def cmd_report(a) -> int:
    from stalwart.console.progress import summary
    from stalwart.controller.report.html import load_series, render
    rep = report(a)
    rep.pop("live", None)
    if a.json and a.json != "-":
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    if a.html:
        live = a.controller or os.path.exists(os.path.join(a.state_dir, "controller.json"))
        with open(a.html, "w") as f:
            f.write(render(rep, load_series(api_client(a, 10) if live else None, a.state_dir, rep["job_id"])))
    if a.json == "-":
        print_json(rep)          # (stdout holds the JSON alone)
    else:
        print(summary(rep))
    return 0


def cmd_versions(a) -> int:
    vs = api_client(a, 10).get(f"/api/jobs/{a.job}/versions")["versions"]
    if a.json:
        print_json({"versions": vs})
        return 0
    for v in vs:
        print(f"{v['id']:>3} {v['hash'][:12]} {v['status']:<11} {v['mode']:<6} {v['source']}"
              + (f"  ({v['reason']})" if v.get("reason") else ""))
    return 0


def cmd_machines(a) -> int:
    try:
        ms = api_client(a, 5).get("/api/machines")["machines"]
    except (UserError, ControllerUnreachable):
        if a.controller:
            raise
        ms = offline_report(a)["machines"]
    if a.json:
        print_json({"machines": ms})
        return 0
    for m in ms:
        print(f"{m['id']:<8} {m['state']:<9} {m.get('address') or '':<16} {m.get('reason') or ''}")
    return 0


def cmd_stacks(a) -> int:
    """The stacks captured for an incident, grouped the way the analyzer grouped them."""
    if a.db:
        inc = offline_incident(a.db, a.job, a.incident)
    else:
        try:
            inc = api_client(a, 30).get(f"/api/jobs/{a.job}/incidents/{a.incident}")
        except (UserError, ControllerUnreachable):
            if a.controller:
                raise
            inc = offline_incident(state_store_url(a), a.job, a.incident)
    if not inc["stacks"]:
        raise UserError(f"incident {a.incident} ({inc['symptom']}) has no captured stacks")
    print(f"incident {a.incident}: {inc['symptom']} — {inc.get('analysis') or ''}")
    for group in inc["stacks"]:
        print(f"\n== {len(group['processes'])} process(es): {', '.join(group['processes'])}")
        print("   " + group["stack"].replace("\n", "\n   ")[-3000:])
    return 0


def cmd_whatif(a) -> int:
    """The what-if straggler analysis (`stalwart.analyzer.whatif`) of a job: the controller's answer
    (`GET /api/jobs/{job}/whatif`), or with `--db` or no controller, computed from the store."""
    from stalwart.analyzer.whatif import render
    from stalwart.sim.whatif import from_store
    if a.microbatches < 1:
        raise UserError(f"--microbatches must be >= 1 (got {a.microbatches})")
    url = a.db
    if url is None:
        try:
            res = api_client(a, 60).get(f"/api/jobs/{a.job}/whatif?microbatches={a.microbatches}")
            job_id = res.pop("job_id")
        except (UserError, ControllerUnreachable):
            if a.controller:
                raise
            url = state_store_url(a)
    if url is not None:
        job_id, res = from_store(url, str(a.job), a.microbatches)
    if a.json:
        print_json({"job_id": job_id, **res})
    else:
        print(render(job_id, res))
    return 0


def offline_incident(url: str, job: str, incident: int) -> dict:
    """One incident as `GET /api/jobs/{job}/incidents/{id}` answers it, read from a store."""
    from stalwart.controller.api.dashboard import incident_detail
    from stalwart.controller.report.build import build_report
    from stalwart.controller.store.db import Store
    store = Store(url)
    try:
        row = store.latest_job() if job == "latest" else store.job(int(job)) if job.isdigit() else None
        if row is None:
            raise UserError(f"no job {job} in {url}")
        try:
            return incident_detail(build_report(store, row["id"]), store.incidents(row["id"]),
                                   store.events(row["id"]), incident)
        except NotFound as e:
            raise UserError(str(e)) from None
    finally:
        store.close()


def add_parsers(sub) -> None:
    for name, fn, hlp in (("status", cmd_status, "live state of the current/last job"),
                          ("report", cmd_report, "the job's report (ETTR, incidents)"),
                          ("machines", cmd_machines, "machines and their states")):
        s = sub.add_parser(name, help=hlp)
        state_options(s)
        if name != "report":
            s.add_argument("--json", action="store_true", help="print the answer as JSON on stdout")
        if name == "status":
            s.add_argument("--watch", action="store_true", help="refresh in place until the job ends "
                                                               "(plain lines when not a terminal)")
            s.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (--watch)")
        if name == "report":
            s.add_argument("--json", nargs="?", const="-", metavar="FILE",
                           help="write the JSON report to FILE, or on stdout (alone there) with - or no FILE")
            s.add_argument("--html", help="write the HTML report here")
        s.set_defaults(fn=fn)

    v = sub.add_parser("versions", help="the job's code versions")
    state_options(v)
    v.add_argument("--json", action="store_true", help="print the answer as JSON on stdout")
    v.set_defaults(fn=cmd_versions)

    st = sub.add_parser("stacks", help="stacks captured for an incident (hangs, fail-slow)")
    st.add_argument("incident", type=int)
    state_options(st)
    st.add_argument("--db", help="read this store (SQLAlchemy URL) instead of asking a controller")
    st.set_defaults(fn=cmd_stacks)

    w = sub.add_parser("whatif", help="how much faster a finished job would have been without its slowest "
                                      "rank / machine / pipeline stage")
    state_options(w)
    w.add_argument("--db", help="read this store (SQLAlchemy URL) instead of asking a controller")
    w.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (pipeline model)")
    w.add_argument("--json", action="store_true", help="print the analysis as JSON on stdout")
    w.set_defaults(fn=cmd_whatif)
