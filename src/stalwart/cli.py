"""The `stalwart` command. User mistakes end in a one-line `error: …` and a non-zero exit."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from stalwart import auth
from stalwart.backends import statedir
from stalwart.chaos import catalogue
from stalwart.client import ApiError, Client, ControllerUnreachable
from stalwart.errors import StalwartError

DEFAULT_STATE = ".stalwart"


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit code 2."""


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _chaos_help() -> str:
    return "chaos kinds:\n" + "\n".join(f"  {k:<14} {v}" for k, v in catalogue.KINDS.items())


# -- controller / agent services -----------------------------------------------------------------
def cmd_controller(a) -> int:
    from sqlalchemy import exc as sa_exc

    from stalwart.controller.api import ApiServer
    from stalwart.controller.service import Controller
    _setup_logging(a.log_level)
    host, _, port = a.listen.rpartition(":")
    if not port.isdigit():
        raise UserError(f"--listen must be HOST:PORT (got {a.listen!r})")
    if bool(a.tls_cert) != bool(a.tls_key):
        raise UserError("--tls-cert and --tls-key go together")
    try:
        token = auth.controller_token(a.state_dir, a.token_file)
        tls = auth.server_tls(a.tls_cert, a.tls_key) if a.tls_cert else None
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None
    token_path = a.token_file or os.path.join(a.state_dir, auth.TOKEN_FILE)
    if auth.loose_permissions(token_path):
        logging.getLogger("stalwart").warning("the token file %s is readable by others (chmod 600 it)", token_path)
    store_host = a.store_host or (host if host not in ("", "0.0.0.0") else "127.0.0.1")
    from stalwart.backends.base import load as load_backend
    from stalwart.controller.channel import raise_open_files
    raise_open_files()
    # (the database goes with the state dir unless --db says otherwise: it named ./.stalwart
    # whatever --state-dir said, and a controller started elsewhere died on a traceback)
    db = a.db or statedir.db_url(a.state_dir)
    try:
        ctl = Controller(db, a.state_dir, store_host=store_host, heartbeat_s=a.heartbeat,
                         missed_beats=a.missed_beats, abandon_running=a.abandon_running,
                         backend=load_backend(a.backend) if a.backend else None)
    except sa_exc.OperationalError as e:
        raise UserError(f"cannot open the database {db}: {e.orig}") from None
    srv = ApiServer(ctl, host or "0.0.0.0", int(port), token=token, tls=tls)
    srv.start()
    from stalwart.controller.gcpolicy import settle_when      # (start-up objects out of the collector)
    threading.Thread(target=settle_when, args=(ctl.rendezvous.imported,), name="gc-settle", daemon=True).start()
    # where this host's CLI, a local cluster's agents and its supervisor find it (written before
    # the port file, which says the controller is up)
    local_host = a.advertise or ("127.0.0.1" if host in ("", "0.0.0.0") else host)
    _write_atomic(os.path.join(a.state_dir, "controller.json"), json.dumps(
        {"url": f"{'https' if tls else 'http'}://{local_host}:{srv.port}", "pid": os.getpid()}))
    if a.port_file:
        _write_atomic(a.port_file, str(srv.port))
    logging.getLogger("stalwart").info("controller listening on %s://%s:%s (token in %s)",
                                       "https" if tls else "http", host, srv.port, token_path)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):     # (a signal ends the wait at once: its handler sets it)
            pass
    except KeyboardInterrupt:
        pass
    t = time.time()
    srv.stop()
    ctl.close()
    logging.getLogger("stalwart").info("controller stopped in %.2fs", time.time() - t)
    # everything is closed (the database included): skip the interpreter's teardown of torch
    # (~0.7 s), which every stop of a cluster would otherwise wait for
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write_atomic(path: str, text: str) -> None:
    """Readers see the old file or the whole new one, never a half-written one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def cmd_agent(a) -> int:
    from stalwart.agent.daemon import Agent
    from stalwart.agent.probeset import ProbeSetupError
    _setup_logging(a.log_level)
    try:
        token = auth.client_token(a.token_file)
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None
    if token is None:
        raise UserError(f"the agent needs the controller's token: --token-file FILE or ${auth.TOKEN_ENV} "
                        f"(the controller keeps it in <its state dir>/{auth.TOKEN_FILE})")
    try:
        client = Client(a.controller, timeout=10, token=token, ca=a.tls_ca)
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None
    try:
        agent = Agent(client, a.machine_id, a.workdir or os.path.join(DEFAULT_STATE, "machines", a.machine_id),
                      address=a.address, gpus=a.gpus, heartbeat_s=a.heartbeat, network_file=a.network_file,
                      kmsg=a.kmsg, controller_file=a.controller_file, labels=_labels(a.label), nic=a.nic or None,
                      shared_host=a.shared_host)
    except ProbeSetupError as e:
        raise UserError(str(e)) from None
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown())
    try:
        agent.serve_forever()
    except KeyboardInterrupt:
        agent.shutdown()
    return 0


def _labels(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--label takes KEY=VALUE (got {item!r})")
        out[key.strip()] = value.strip()
    return out


# -- run --------------------------------------------------------------------------------------
def _spec_from_args(a):
    from stalwart.spec import JobSpec
    d: dict = {}
    if a.config:
        if not os.path.exists(a.config):
            raise UserError(f"config file {a.config} does not exist")
        d = JobSpec.from_yaml(a.config).to_dict()
    for key in ("name", "machines", "gpus_per_machine", "tp", "pp", "dp", "steps", "ckpt_every"):
        v = getattr(a, key)
        if v is not None:
            d[key] = v
    if a.standby is not None:
        d["standby"] = a.standby if a.standby == "auto" else _int_arg("--standby", a.standby)
    if a.chaos:
        d["chaos"] = list(d.get("chaos", [])) + a.chaos
    cmd = list(a.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd:
        d["command"] = cmd
    if not d.get("command"):
        raise UserError("no training command given: stalwart run [options] -- python train.py ...")
    if d["command"][0] in ("python", "python3"):
        d["command"] = [sys.executable] + d["command"][1:]
    d.setdefault("code_dir", os.getcwd())
    if a.env:
        env = dict(d.get("env", {}))
        for kv in a.env:
            if "=" not in kv:
                raise UserError(f"--env takes KEY=VALUE (got {kv!r})")
            k, v = kv.split("=", 1)
            env[k] = v
        d["env"] = env
    if "machines" not in d:
        raise UserError("--machines is required (or a config file that sets machines)")
    spec = JobSpec.from_dict(d)
    for c in spec.chaos:
        from stalwart.controller.pool import standby_count
        catalogue.validate_against(catalogue.parse(c), spec.machines + standby_count(spec),
                                   spec.gpus_per_machine, spec.machines)
    return spec


def _int_arg(name: str, v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise UserError(f"{name} takes a number or 'auto' (got {v!r})") from None


def cmd_submit(a) -> int:
    """Queue a job on a running controller; it starts when enough machines are free (FIFO)."""
    spec = _spec_from_args(a)
    client = _client(a, 30)
    job = client.post("/api/jobs", {"spec": spec.to_dict()})["job"]
    st = client.get(f"/api/jobs/{job}")
    state = (st.get("live") or {}).get("state") or st.get("state")
    where = f" --state-dir {a.state_dir}" if not a.controller else f" --controller {a.controller}"
    print(f"stalwart: job {job} submitted ({state}): {' '.join(spec.command)}\n"
          f"stalwart: follow it with: stalwart status --job {job} --watch{where}", flush=True)
    return 0


def cmd_run(a) -> int:
    from stalwart.backends.local import LocalCluster
    from stalwart.backends.statedir import StateDirBusy, StateDirLock
    from stalwart.controller.pool import standby_count
    spec = _spec_from_args(a)
    if a.spare < 0:
        raise UserError(f"--spare must be >= 0 (got {a.spare})")
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
                               missed_beats=spec.policy.missed_beats, log_level=a.log_level)
        print(f"stalwart: starting a controller and {total} machines ({spec.machines} active, "
              f"{standby_count(spec)} standby, {a.spare} spare) in {os.path.abspath(a.state_dir)}", flush=True)
        from stalwart.backends.launch import run_job
        return run_job(cluster, spec, cluster.start)
    finally:
        lock.release()


# -- status / report / inject / machines -------------------------------------------------------
def _controller_url(a) -> str:
    if getattr(a, "controller", None):
        return a.controller
    path = os.path.join(a.state_dir, "controller.json")
    if not os.path.exists(path):
        raise UserError(f"no controller found for state dir {a.state_dir} (pass --controller URL)")
    with open(path) as f:
        return json.load(f)["url"]


def _client(a, timeout: float) -> Client:
    """A client of the controller of `a` (--controller or the state dir's), with its token
    (--token-file, $STALWART_TOKEN or the state dir's token file) and --tls-ca."""
    try:
        return Client(_controller_url(a), timeout=timeout,
                      token=auth.client_token(getattr(a, "token_file", None), a.state_dir),
                      ca=getattr(a, "tls_ca", None))
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None


def _offline_report(a, job: str = "latest") -> dict:
    from stalwart.controller.report import build_report
    from stalwart.controller.store import Store
    if not os.path.exists(statedir.db_path(a.state_dir)):
        raise UserError(f"no stalwart state in {os.path.abspath(a.state_dir)} (run a job first, or pass --state-dir)")
    store = Store(statedir.db_url(a.state_dir))
    try:
        row = store.latest_job() if job == "latest" else store.job(int(job))
        if row is None:
            raise UserError("no job in this state dir")
        return build_report(store, row["id"])
    finally:
        store.close()


def _report(a) -> dict:
    try:
        return _client(a, 5).get(f"/api/jobs/{a.job}")
    except (UserError, ControllerUnreachable):
        if getattr(a, "controller", None):
            raise
        return _offline_report(a, a.job)


def cmd_status(a) -> int:
    if a.watch:
        from stalwart.watch import watch
        if a.interval <= 0:
            raise UserError(f"--interval must be > 0 (got {a.interval})")
        client = _client(a, 10)
        return watch(lambda: client.get(f"/api/jobs/{a.job}"), a.interval)
    rep = _report(a)
    live = rep.get("live") or {}
    print(f"job {rep['job']}: {live.get('state', rep['state'])}" + (f" ({rep['reason']})" if rep.get("reason") else ""))
    print(f"  step {live.get('step', rep['steps_completed'])}/{rep['steps_target']}"
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
    rep = _report(a)
    rep.pop("live", None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    if a.html:
        live = a.controller or os.path.exists(os.path.join(a.state_dir, "controller.json"))
        with open(a.html, "w") as f:
            f.write(render(rep, load_series(_client(a, 10) if live else None, a.state_dir, rep["job_id"])))
    print(summary(rep))
    return 0


def cmd_inject(a) -> int:
    catalogue.check_kind(a.kind)
    text = f"{a.kind}@machine={a.machine}" + (f",rank={a.rank}" if a.rank is not None else "")
    for kv in a.param or []:
        if "=" not in kv:
            raise UserError(f"--param takes KEY=VALUE (got {kv!r})")
        text += "," + kv
    out = _client(a, 5).post(f"/api/jobs/{a.job}/inject", {"chaos": text})
    print(f"injected {out['chaos']['kind']} on m{out['chaos']['machine']}")
    return 0


def cmd_update(a) -> int:
    from stalwart.spec import parse_duration
    if not os.path.isdir(a.code):
        raise UserError(f"--code {a.code} is not a directory")
    mode = "urgent" if a.urgent else ("window" if a.window and a.only_window else "lazy")
    window = parse_duration(a.window) if a.window else None
    row = _client(a, 60).post(
        f"/api/jobs/{a.job}/versions", {"code": os.path.abspath(a.code), "mode": mode, "window_s": window})
    when = {"urgent": "now", "lazy": "at the next failure" + (f" or within {a.window}" if a.window else ""),
            "window": f"when its window ({a.window}) expires"}[mode]
    print(f"code version {row['id']} ({row['hash'][:12]}) registered as {row['status']}; applied {when}")
    return 0


def cmd_versions(a) -> int:
    vs = _client(a, 10).get(f"/api/jobs/{a.job}/versions")["versions"]
    for v in vs:
        print(f"{v['id']:>3} {v['hash'][:12]} {v['status']:<11} {v['mode']:<6} {v['source']}"
              + (f"  ({v['reason']})" if v.get("reason") else ""))
    return 0


def cmd_machines(a) -> int:
    try:
        ms = _client(a, 5).get("/api/machines")["machines"]
    except (UserError, ControllerUnreachable):
        ms = _offline_report(a)["machines"]
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
        import shutil

        from stalwart.agent.paths import orphans
        gone = orphans()
        for root in gone:
            shutil.rmtree(root, ignore_errors=True)
        print(f"freed the checkpoint memory of {len(gone)} machine(s) whose directory is gone")
    return 0


# -- parser ---------------------------------------------------------------------------------
def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help=f"the controller's token (default: ${auth.TOKEN_ENV}, else "
                                        f"<state-dir>/{auth.TOKEN_FILE})")
    p.add_argument("--tls-ca", help="CA file to verify an https controller's certificate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stalwart",
                                description="Keep large PyTorch training jobs training through failures.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add = sub.add_parser
    sub.add_parser = lambda *a, **kw: _add(*a, parents=[common], **kw)

    c = sub.add_parser("controller", help="run the controller service")
    c.add_argument("--db", help="SQLAlchemy URL (sqlite:///… or postgresql+psycopg://…; default: "
                                "<state-dir>/stalwart.db)")
    c.add_argument("--listen", default="127.0.0.1:7420",
                   help="HOST:PORT for the HTTP API (port 0 = any; default: this host only; 0.0.0.0:7420 for all)")
    c.add_argument("--token-file", help=f"the API's bearer token (default: <state-dir>/{auth.TOKEN_FILE}, made "
                                        "on first start, mode 0600)")
    c.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM; with --tls-key)")
    c.add_argument("--tls-key", help="the certificate's private key (PEM)")
    c.add_argument("--state-dir", default=DEFAULT_STATE)
    c.add_argument("--store-host", help="address workers use to reach this host's rendezvous store")
    c.add_argument("--port-file", help="write the bound port here once listening")
    c.add_argument("--heartbeat", type=float, default=1.0)
    c.add_argument("--missed-beats", type=int, default=3)
    c.add_argument("--abandon-running", action="store_true",
                   help="fail jobs an earlier controller left running instead of taking them over "
                        "(their machines are gone: a fresh local cluster)")
    c.add_argument("--backend", metavar="CONFIG", help="the cluster's backend (JSON: slurm, kubernetes)")
    c.add_argument("--advertise", help="host the agents reach this controller at (in controller.json)")
    c.set_defaults(fn=cmd_controller)

    g = sub.add_parser("agent", help="run the agent of one machine")
    g.add_argument("--controller", required=True, help="controller URL, e.g. http://10.0.0.1:7420")
    g.add_argument("--machine-id", required=True)
    g.add_argument("--workdir")
    g.add_argument("--address", default="127.0.0.1")
    g.add_argument("--gpus", type=int, default=1)
    g.add_argument("--heartbeat", type=float, default=1.0)
    g.add_argument("--network-file", help="local backend: JSON of the machines' network namespaces")
    g.add_argument("--kmsg", help="host kernel log to follow: FILE or off (default: /dev/kmsg when readable)")
    g.add_argument("--nic", action="append", default=[], metavar="IFACE", help="interface or RDMA device to "
                   "watch (repeatable; default: the default route's interface and every RDMA port)")
    g.add_argument("--shared-host", action="store_true", help="other agents share this host: no host-wide probes")
    g.add_argument("--token-file", help=f"the controller's token (default: ${auth.TOKEN_ENV})")
    g.add_argument("--tls-ca", help="CA file to verify an https controller's certificate")
    g.add_argument("--controller-file", help="JSON file {\"url\": ...} to re-read the controller's "
                                             "address from when it is unreachable (it may restart elsewhere)")
    g.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="a topology label of this machine, e.g. switch=leaf3 or pod=p1 (repeatable); the "
                        "controller prefers standbys near an evicted machine's group")
    g.set_defaults(fn=cmd_agent)

    r = sub.add_parser("run", help="run a job on a local cluster", epilog=_chaos_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _job_options(r)
    r.add_argument("--spare", type=int, default=0,
                   help="extra idle machines the standby pool refills from after a failover (default 0)")
    r.add_argument("--state-dir", default=DEFAULT_STATE)
    r.add_argument("--fresh", action="store_true", help="delete the state dir first")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    r.set_defaults(fn=cmd_run)

    sb = sub.add_parser("submit", help="queue a job on a running controller (FIFO until enough machines "
                                       "are free)", epilog=_chaos_help(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _job_options(sb)
    sb.add_argument("--state-dir", default=DEFAULT_STATE)
    sb.add_argument("--controller", help="controller URL (default: the one of --state-dir)")
    _client_options(sb)
    sb.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    sb.set_defaults(fn=cmd_submit)
    return _more_commands(p, sub)


def _job_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("--config", help="job spec in YAML; options given here override it")
    r.add_argument("--name")
    r.add_argument("--machines", type=int)
    r.add_argument("--gpus-per-machine", type=int)
    for k in ("tp", "pp", "dp"):
        r.add_argument(f"--{k}", type=int)
    r.add_argument("--steps", type=int)
    r.add_argument("--ckpt-every", type=int, help="durable checkpoint every K steps")
    r.add_argument("--standby", help="standby machines: a number or 'auto' (P99 sizing)")
    r.add_argument("--chaos", action="append", help="KIND@step=S,machine=M[,rank=R] (repeatable)")
    r.add_argument("--env", action="append", help="KEY=VALUE for the workers (repeatable)")


def _more_commands(p: argparse.ArgumentParser, sub) -> argparse.ArgumentParser:
    for name, fn, hlp in (("status", cmd_status, "live state of the current/last job"),
                          ("report", cmd_report, "the job's report (ETTR, incidents)"),
                          ("machines", cmd_machines, "machines and their states")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("--state-dir", default=DEFAULT_STATE)
        s.add_argument("--controller", help="controller URL (default: the one of --state-dir)")
        _client_options(s)
        s.add_argument("--job", default="latest")
        if name == "status":
            s.add_argument("--watch", action="store_true", help="refresh in place until the job ends "
                                                               "(plain lines when not a terminal)")
            s.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (--watch)")
        if name == "report":
            s.add_argument("--json", help="write the JSON report here")
            s.add_argument("--html", help="write the HTML report here")
        s.set_defaults(fn=fn)

    i = sub.add_parser("inject", help="inject a fault into the running job", epilog=_chaos_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("kind")
    i.add_argument("--machine", type=int, required=True, help="machine index M (machine mM)")
    i.add_argument("--rank", type=int)
    i.add_argument("--param", action="append", help="KEY=VALUE for the kind (code=79, peer=2, rate=1mbit, "
                                                    "fraction=0.1, times=3), repeatable")
    i.add_argument("--state-dir", default=DEFAULT_STATE)
    i.add_argument("--controller")
    _client_options(i)
    i.add_argument("--job", default="latest")
    i.set_defaults(fn=cmd_inject)

    u = sub.add_parser("update", help="register a new code version for hot update")
    u.add_argument("--code", required=True, help="directory with the new code (snapshotted, immutable)")
    u.add_argument("--urgent", action="store_true", help="apply now (stop, restart in place)")
    u.add_argument("--window", help="apply at the latest after this long (e.g. 24h); default: the "
                                    "job's policy.hot_update_window_s")
    u.add_argument("--only-window", action="store_true", help="do not apply at a failure, only when "
                                                              "the window expires")
    v = sub.add_parser("versions", help="the job's code versions")
    for x, fn in ((u, cmd_update), (v, cmd_versions)):
        x.add_argument("--state-dir", default=DEFAULT_STATE)
        x.add_argument("--controller")
        _client_options(x)
        x.add_argument("--job", default="latest")
        x.set_defaults(fn=fn)

    st = sub.add_parser("stacks", help="stacks captured for an incident (hangs, fail-slow)")
    st.add_argument("incident", type=int)
    st.add_argument("--state-dir", default=DEFAULT_STATE)
    st.add_argument("--db", help="SQLAlchemy URL of the controller's store (default: the state dir's)")
    st.add_argument("--job", default="latest")
    st.set_defaults(fn=cmd_stacks)

    k = sub.add_parser("cleanup", help="stop processes a crashed `stalwart run` left behind")
    k.add_argument("--state-dir", default=DEFAULT_STATE)
    k.add_argument("--orphans", action="store_true",
                   help="also free /dev/shm checkpoint memory of machines whose directory was removed")
    k.set_defaults(fn=cmd_cleanup)
    from stalwart.backends.commands import add_commands
    add_commands(sub)        # stalwart slurm …, stalwart k8s …
    from stalwart.sim.command import add_commands as add_sim
    add_sim(sub)             # stalwart sim, stalwart whatif
    _whole_names(p)
    return p


def _whole_names(parser: argparse.ArgumentParser) -> None:
    """Options are given by their whole name, in every (sub)command: `--port 80` is an unknown
    argument, not `--port-file 80` (argparse takes a unique prefix for the option by default)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _whole_names(child)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (UserError, ValueError, StalwartError, ControllerUnreachable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the local cluster could not start: say why, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
