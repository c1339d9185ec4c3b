"""What every command shares: exit codes, the user's mistakes, logging, the state dir, the controller's
client (its URL and credentials from options or the environment), the job options, JSON output."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from stalwart import auth
from stalwart.backends import statedir
from stalwart.chaos import catalogue
from stalwart.client import Client, ControllerUnreachable
from stalwart.errors import UserError

__all__ = ["CONTROLLER_ENV", "DEFAULT_STATE", "EXIT", "LOG_LEVELS", "TLS_CA_ENV", "TOKEN_FILE_ENV", "UserError",
           "chaos_help", "api_client", "client_options", "controller_options", "controller_url", "job_options",
           "labels", "log_handler", "log_level", "offline_report", "print_json", "report", "setup_logging",
           "spec_from_args", "state_options", "write_atomic"]

DEFAULT_STATE = ".stalwart"


class EXIT:
    """The command's exit codes (docs/cli.md): what a script can tell apart without reading stderr."""
    OK = 0
    JOB_FAILED = 1          # the job ran and failed or was cancelled (`run`, `status --watch`)
    USAGE = 2               # a mistake in the command line or the files it names (argparse's own too)
    UNREACHABLE = 3         # the controller did not answer
    REFUSED = 4             # the controller answered with an error (unknown job, unauthorized, conflict)
    INTERRUPTED = 130       # Ctrl-C (128 + SIGINT)


# where every command that talks to a controller finds it, when no option says
CONTROLLER_ENV = "STALWART_CONTROLLER"
TOKEN_FILE_ENV = "STALWART_TOKEN_FILE"
TLS_CA_ENV = "STALWART_TLS_CA"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """argparse type of --log-level: one of LOG_LEVELS, in any case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)} (got {text!r})")
    return text.upper()


def log_handler(fmt: str = "text") -> logging.Handler:
    """A log handler on stderr: plain lines, or one JSON object per record (`json`: python-json-logger,
    with time, logger, level, message and any `extra` fields)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter
        handler.setFormatter(JsonFormatter("%(asctime)s %(name)s %(levelname)s %(message)s",
                                           rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    return handler


def setup_logging(level: str, fmt: str = "text") -> None:
    """The process's logging (once per process: a no-op where the root logger has a handler)."""
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[log_handler(fmt)])


def print_json(obj) -> None:
    """`--json`: the object on stdout, one document that json.loads reads (nothing else goes there)."""
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")
    sys.stdout.flush()


def chaos_help() -> str:
    return "chaos kinds:\n" + "\n".join(f"  {k:<14} {v}" for k, v in catalogue.KINDS.items())


def write_atomic(path: str, text: str) -> None:
    """Readers see the old file or the whole new one, never a half-written one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def labels(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--label takes KEY=VALUE (got {item!r})")
        out[key.strip()] = value.strip()
    return out


def job_options(r: argparse.ArgumentParser) -> None:
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


def spec_from_args(a):
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
        d["standby"] = a.standby if a.standby == "auto" else int_arg("--standby", a.standby)
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


def int_arg(name: str, v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise UserError(f"{name} takes a number or 'auto' (got {v!r})") from None


def client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default=os.environ.get(TOKEN_FILE_ENV) or None,
                   help=f"the controller's token (default: ${TOKEN_FILE_ENV}, else ${auth.TOKEN_ENV} (the token "
                        f"itself), else <state-dir>/{auth.TOKEN_FILE})")
    p.add_argument("--tls-ca", default=os.environ.get(TLS_CA_ENV) or None,
                   help=f"CA file to verify an https controller's certificate (default: ${TLS_CA_ENV})")


def controller_options(p: argparse.ArgumentParser, required: bool = False) -> None:
    """--controller URL (default $STALWART_CONTROLLER) and its credentials."""
    env = os.environ.get(CONTROLLER_ENV) or None
    p.add_argument("--controller", default=env, required=required and env is None,
                   help=f"controller URL, e.g. http://10.0.0.1:7420 (default: ${CONTROLLER_ENV}"
                        + (")" if required else ", else the one of --state-dir)"))
    client_options(p)


def state_options(p: argparse.ArgumentParser, controller: bool = True, job: bool = True) -> None:
    """--state-dir, and for the commands that talk to a controller --controller, its credentials and --job."""
    p.add_argument("--state-dir", default=DEFAULT_STATE)
    if controller:
        controller_options(p)
    if job:
        p.add_argument("--job", default="latest", help="job id, or latest (default)")


def controller_url(a) -> str:
    if getattr(a, "controller", None):
        return a.controller
    path = os.path.join(a.state_dir, "controller.json")
    if not os.path.exists(path):
        raise UserError(f"no controller found for state dir {a.state_dir} (pass --controller URL)")
    with open(path) as f:
        return json.load(f)["url"]


def api_client(a, timeout: float) -> Client:
    """A client of the controller of `a` (--controller or the state dir's), with its token
    (--token-file, $STALWART_TOKEN or the state dir's token file) and --tls-ca."""
    try:
        return Client(controller_url(a), timeout=timeout,
                      token=auth.client_token(getattr(a, "token_file", None), a.state_dir),
                      ca=getattr(a, "tls_ca", None))
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None


def offline_report(a, job: str = "latest") -> dict:
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


def report(a) -> dict:
    try:
        return api_client(a, 5).get(f"/api/jobs/{a.job}")
    except (UserError, ControllerUnreachable):
        if getattr(a, "controller", None):
            raise
        return offline_report(a, a.job)
