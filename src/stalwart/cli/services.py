"""`stalwart controller` and `stalwart agent`: the two long-running services."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.parse

from stalwart.backends import statedir
from stalwart.cli.common import (DEFAULT_STATE, TLS_CERT_ENV, TLS_KEY_ENV, UserError, controller_options, labels,
                                 state_options, write_atomic)
from stalwart.security import auth, identity
from stalwart.transport.client import ApiError, Client, ControllerUnreachable


def cmd_controller(a) -> int:
    from sqlalchemy import exc as sa_exc

    from stalwart.controller.api.server import ApiServer
    from stalwart.controller.service import Controller
    host, _, port = a.listen.rpartition(":")
    if not port.isdigit():
        raise UserError(f"--listen must be HOST:PORT (got {a.listen!r})")
    if bool(a.tls_cert) != bool(a.tls_key):
        raise UserError("--tls-cert and --tls-key go together")
    if (a.tls_client_ca or a.tls_require_client_cert or a.tls_crl) and not a.tls_cert:
        raise UserError("client certificates (--tls-client-ca) need HTTPS: give --tls-cert and --tls-key")
    try:
        token = auth.controller_token(a.state_dir, a.token_file)
        tls = auth.server_tls(a.tls_cert, a.tls_key, a.tls_client_ca, a.tls_require_client_cert, a.tls_crl) \
            if a.tls_cert else None
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None
    token_path = a.token_file or os.path.join(a.state_dir, auth.TOKEN_FILE)
    if auth.loose_permissions(token_path):
        logging.getLogger("stalwart").warning("the token file %s is readable by others (chmod 600 it)", token_path)
    store_host = a.store_host or (host if host not in ("", "0.0.0.0") else "127.0.0.1")
    from stalwart.backends.config import load as load_backend
    from stalwart.controller.api.channel import raise_open_files
    raise_open_files()
    # (the database goes with the state dir unless --db says otherwise: it named ./.stalwart
    # whatever --state-dir said, and a controller started elsewhere died on a traceback)
    db = a.db or statedir.db_url(a.state_dir)
    from stalwart.chaos.controller import self_kill
    try:
        ctl = Controller(db, a.state_dir, store_host=store_host, heartbeat_s=a.heartbeat,
                         missed_beats=a.missed_beats, abandon_running=a.abandon_running,
                         backend=load_backend(a.backend) if a.backend else None, secret_file=a.secret_file,
                         checkpoint_dir=a.checkpoint_dir, lease=a.lease, url=a.advertise, on_lease_lost=_lease_lost,
                         on_phase=self_kill(a.state_dir) if a.chaos_self_kill else None)
    except sa_exc.OperationalError as e:
        raise UserError(f"cannot open the database {db}: {e.orig}") from None
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None
    srv = ApiServer(ctl, host or "0.0.0.0", int(port), token=token, tls=tls)
    # the read-only token of Prometheus and the dashboard (stalwart.security.identity)
    write_secret(os.path.join(a.state_dir, identity.READER_FILE), identity.reader_token(ctl.secret))
    srv.start()
    from stalwart.controller.gcpolicy import settle_when  # (start-up objects out of the collector)
    threading.Thread(target=settle_when, args=(ctl.rendezvous.imported,), name="gc-settle", daemon=True).start()
    # where this host's CLI, a local cluster's agents and its supervisor find it (written before
    # the port file, which says the controller is up)
    local_host = a.advertise or ("127.0.0.1" if host in ("", "0.0.0.0") else host)
    write_atomic(os.path.join(a.state_dir, "controller.json"), json.dumps(
        {"url": f"{'https' if tls else 'http'}://{local_host}:{srv.port}", "pid": os.getpid()}))
    if a.port_file:
        write_atomic(a.port_file, str(srv.port))
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


def _lease_lost(why: str) -> None:
    """Another controller took the lease: this one stops acting at once (nothing more is
    committed or sent) and exits with a code of its own, for its supervisor to read."""
    from stalwart.controller.store.lease import EXIT_LEASE_LOST
    logging.getLogger("stalwart").error("lost the lease: %s; exiting (code %d)", why, EXIT_LEASE_LOST)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


def controller_urls(a) -> list[str]:
    """--controller: one URL, or an active controller and its standbys, comma-separated."""
    urls = [u.strip() for u in (a.controller or "").split(",") if u.strip()]
    if not urls:
        raise UserError("--controller needs a URL (or several, comma-separated)")
    return urls


def write_secret(path: str, text: str) -> None:
    """Write a credential to `path`, mode 0600 (replaced atomically)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


CREDENTIAL_FILE = "machine.credential"
JOIN_ENV = "STALWART_JOIN_TOKEN"
ENROLL_WAIT_S = 120.0


def agent_credential(a, workdir: str) -> str:
    """The agent's bearer token: its machine's credential (`<workdir>/machine.credential`, got by
    enrolling with --join-token-file on first start), else --token-file / $STALWART_TOKEN; ""
    (none) for an agent with a client certificate (--tls-cert), which is its credential."""
    if a.tls_cert:
        if not a.tls_key:
            raise UserError("--tls-cert and --tls-key go together")
        if a.join_token_file or os.environ.get(JOIN_ENV, "").strip():
            raise UserError("an agent with a client certificate (--tls-cert) needs no join token: its "
                            "certificate names its machine")
        if not all(u.startswith("https://") for u in controller_urls(a)):
            raise UserError("a client certificate (--tls-cert) needs an https:// --controller")
        return ""
    cred = os.path.join(workdir, CREDENTIAL_FILE)
    try:
        if os.path.exists(cred):
            return auth.read_token_file(cred)
        join = auth.read_token_file(a.join_token_file) if a.join_token_file else \
            os.environ.get(JOIN_ENV, "").strip() or None
        if join:
            client = Client(controller_urls(a)[0], timeout=10, token=join, ca=a.tls_ca)
            deadline = time.monotonic() + ENROLL_WAIT_S       # (the controller may still be starting)
            try:
                while True:
                    try:
                        got = client.post(f"/api/agents/{urllib.parse.quote(a.machine_id, safe='')}/enroll", {})
                        break
                    except ControllerUnreachable as e:
                        if time.monotonic() > deadline:
                            raise UserError(f"cannot enroll machine {a.machine_id}: {e}") from None
                        time.sleep(1.0)
            except ApiError as e:
                raise UserError(f"cannot enroll machine {a.machine_id}: {e}") from None
            finally:
                client.close()
            os.makedirs(workdir, exist_ok=True)
            write_secret(cred, got["credential"])
            return got["credential"]
        token = auth.client_token(a.token_file)
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None
    if token is None:
        raise UserError("the agent needs a credential: --join-token-file FILE (a one-time join token: "
                        "`stalwart join-token` on the controller's host), or the operator's --token-file")
    return token


def cmd_agent(a) -> int:
    from stalwart import protocol
    from stalwart.agent.daemon import Agent
    from stalwart.agent.probeset import ProbeSetupError
    from stalwart.agent.workdir import WorkdirInUse
    if a.gpus is not None:
        logging.getLogger("stalwart").warning("--gpus is deprecated: it is --gpus-per-machine (the GPUs of "
                                              "this machine; `stalwart sim --gpus` is the whole job's)")
        a.gpus_per_machine = a.gpus
    if not protocol.MACHINE_ID_RE.match(a.machine_id):
        raise UserError(f"--machine-id {a.machine_id!r}: {protocol.MACHINE_ID_RULE}")
    workdir = a.workdir or os.path.join(DEFAULT_STATE, "machines", a.machine_id)
    urls = controller_urls(a)
    token = agent_credential(a, workdir)
    # nothing this agent starts (the user's workers, diagnostics) inherits a credential (nor
    # where its certificate's key is)
    for name in (auth.TOKEN_ENV, JOIN_ENV, TLS_CERT_ENV, TLS_KEY_ENV):
        os.environ.pop(name, None)
    try:
        client = Client(urls[0], timeout=10, token=token, ca=a.tls_ca, cert=a.tls_cert, key=a.tls_key)
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None
    try:
        agent = Agent(client, a.machine_id, workdir,
                      address=a.address, gpus=a.gpus_per_machine, heartbeat_s=a.heartbeat, network_file=a.network_file,
                      kmsg=a.kmsg, controller_file=a.controller_file, labels=labels(a.label), nic=a.nic or None,
                      shared_host=a.shared_host, controllers=urls)
    except (ProbeSetupError, WorkdirInUse) as e:
        raise UserError(str(e)) from None
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown())
    try:
        agent.serve_forever()
    except KeyboardInterrupt:
        agent.shutdown()
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("controller", help="run the controller service")
    c.add_argument("--secret-file", help=f"the controller's secret, which checkpoint keys and agents' "
                   f"credentials derive from (default: <state-dir>/{auth.SECRET_FILE}, made on first start); "
                   "controllers sharing a database share it")
    c.add_argument("--db", help="SQLAlchemy URL (sqlite:///… or postgresql+psycopg://…; default: "
                                "<state-dir>/stalwart.db)")
    c.add_argument("--listen", default="127.0.0.1:7420",
                   help="HOST:PORT for the HTTP API (port 0 = any; default: this host only; 0.0.0.0:7420 for all)")
    c.add_argument("--token-file", help=f"the API's bearer token (default: <state-dir>/{auth.TOKEN_FILE}, made "
                                        "on first start, mode 0600)")
    c.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM; with --tls-key)")
    c.add_argument("--tls-key", help="the certificate's private key (PEM)")
    c.add_argument("--tls-client-ca", metavar="PEM", help="mutual TLS: ask clients for a certificate and "
                   "verify it against this CA; a verified certificate naming a machine, an operator or a reader "
                   "is a credential (docs/security.md), a token still works for clients without one")
    c.add_argument("--tls-crl", metavar="PEM", help="with --tls-client-ca: the CA's certificate revocation list; "
                   "a revoked client certificate gets no connection. The TLS files are read again when they "
                   "change (renew the list before its next-update time: an expired one refuses every certificate)")
    c.add_argument("--tls-require-client-cert", action="store_true",
                   help="with --tls-client-ca: refuse the TLS handshake of a client without a certificate "
                        "(its tokens no longer reach the API; HTTPS liveness probes need one too)")
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
    c.add_argument("--checkpoint-dir", metavar="DIR|URL", help="where durable checkpoints go: a directory every "
                   "agent sees at the same path, or an fsspec URL such as s3://bucket/llm (default: "
                   "<state-dir>/checkpoints)")
    c.add_argument("--lease", nargs="?", const="", metavar="NAME",
                   help="several controllers share this database (PostgreSQL): the one holding the lease acts, "
                        "the others wait as standbys and take over within seconds of its silence (NAME: "
                        "this controller's name in the lease; default host:pid). A controller that lost "
                        "the lease exits with code 75")
    c.add_argument("--chaos-self-kill", action="store_true",
                   help="chaos for restart tests: SIGKILL this controller as a job enters the phase named in "
                        "<state-dir>/chaos/controller-kill (once)")
    c.set_defaults(fn=cmd_controller)

    g = sub.add_parser("agent", help="run the agent of one machine")
    controller_options(g, required=True)
    g.add_argument("--machine-id", required=True)
    g.add_argument("--workdir")
    g.add_argument("--address", default="127.0.0.1")
    g.add_argument("--gpus-per-machine", type=int, default=1, help="GPUs of this machine (default 1)")
    g.add_argument("--gpus", type=int, help=argparse.SUPPRESS)      # (deprecated: --gpus-per-machine)
    g.add_argument("--heartbeat", type=float, default=1.0)
    g.add_argument("--network-file", help="local backend: JSON of the machines' network namespaces")
    g.add_argument("--kmsg", help="host kernel log to follow: FILE or off (default: /dev/kmsg when readable)")
    g.add_argument("--nic", action="append", default=[], metavar="IFACE", help="interface or RDMA device to "
                   "watch (repeatable; default: the default route's interface and every RDMA port)")
    g.add_argument("--shared-host", action="store_true", help="other agents share this host: no host-wide probes")
    g.add_argument("--join-token-file", help="a one-time join token: the agent enrolls its machine with it on "
                   f"first start and keeps the machine's credential in <workdir>/{CREDENTIAL_FILE}")
    g.add_argument("--controller-file", help="JSON file {\"url\": ...} to re-read the controller's "
                                             "address from when it is unreachable (it may restart elsewhere)")
    g.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="a topology label of this machine, e.g. switch=leaf3 or pod=p1 (repeatable); the "
                        "controller prefers standbys near an evicted machine's group")
    g.set_defaults(fn=cmd_agent)

    j = sub.add_parser("join-token", help="print a one-time join token for an agent (on the controller's host)")
    state_options(j, controller=False, job=False)
    j.add_argument("--machine", help="the machine id it enrolls (it may enroll that id again); "
                                     "default: any one new machine id")
    j.add_argument("--ttl", type=float, default=identity.JOIN_TTL_S, help="seconds it stays valid")
    j.set_defaults(fn=cmd_join_token)


def cmd_join_token(a) -> int:
    if not os.path.exists(os.path.join(a.state_dir, auth.SECRET_FILE)):
        raise UserError(f"no controller secret in {a.state_dir} (run this on the controller's host, "
                        "with its --state-dir, or ask the API: POST /api/join-tokens)")
    if not 0 < a.ttl <= 30 * 86400:
        raise UserError("--ttl must be between 0 and 30 days in seconds")
    print(identity.join_token(auth.controller_secret(a.state_dir), a.machine, a.ttl))
    return 0
