"""What every command shares: exit codes, the user's mistakes, logging, the state dir, the controller's
client (its URL and credentials from options or the environment), the job options, JSON output."""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys

from stalwart.backends import statedir
from stalwart.chaos import catalogue
from stalwart.controller.cluster.standby import standby_count
from stalwart.errors import UserError
from stalwart.security import auth
from stalwart.transport.client import Client, ControllerUnreachable

__all__ = ["CONTROLLER_ENV", "DEFAULT_STATE", "EXIT", "EXTRAS", "LOG_LEVELS", "TLS_CA_ENV", "TLS_CERT_ENV",
           "TLS_KEY_ENV", "TOKEN_FILE_ENV", "UserError", "chaos_help", "api_client", "client_options",
           "controller_options", "controller_url",
           "job_options", "labels", "log_handler", "log_level", "missing_extra_line", "need_controller",
           "offline_report", "print_json", "report", "setup_logging", "spec_from_args", "state_options",
           "state_store_url", "torchrun_options", "write_atomic"]

DEFAULT_STATE = ".stalwart"


# What each extra brings (the modules its code imports): the base install is a training image's
# (the worker SDK and the agent); a command that needs more says which extra, in one line.
EXTRAS = {"controller": ("sqlalchemy", "aiohttp", "scipy", "prometheus_client", "rich", "uvloop"),
          "postgres": ("psycopg",), "k8s": ("kubernetes",)}


def extra_of(module: str | None) -> str | None:
    """The extra that installs `module` (a dotted name), None if none does."""
    top = (module or "").split(".")[0]
    return next((extra for extra, mods in EXTRAS.items() if top in mods), None)


def missing_extra_line(command: str, module: str | None) -> str | None:
    extra = extra_of(module)
    if extra is None:
        return None
    what = {"controller": "the controller", "postgres": "the PostgreSQL driver",
            "k8s": "the Kubernetes client"}[extra]
    return f"{command} needs {what}: pip install 'stalwart[{extra}]'"


def need_controller(command: str) -> None:
    """Before a command that runs the control plane starts anything."""
    for mod in EXTRAS["controller"]:
        if mod == "uvloop":
            continue        # (optional: the asyncio loop where it is missing)
        if importlib.util.find_spec(mod) is None:
            raise UserError(missing_extra_line(command, mod))


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
TLS_CERT_ENV = "STALWART_TLS_CERT"
TLS_KEY_ENV = "STALWART_TLS_KEY"
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
    r.add_argument("--backup-every", help="push in-memory checkpoints to the backup peer every K steps, "
                                          "or 'auto' (paced by their measured cost; the default)")
    r.add_argument("--standby", help="standby machines: a number or 'auto' (P99 sizing)")
    r.add_argument("--chaos", action="append", help="KIND@step=S,machine=M[,rank=R] (repeatable)")
    r.add_argument("--env", action="append", help="KEY=VALUE for the workers (repeatable)")


def torchrun_options(r: argparse.ArgumentParser) -> None:
    """torchrun's options, so that a torchrun command line becomes a stalwart one by changing its
    first word: those that mean something here, and those that do not (accepted, with a note)."""
    t = r.add_argument_group("torchrun's options")
    t.add_argument("--nnodes", help="machines (as --machines; a MIN:MAX range runs MAX machines)")
    t.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                   help="ranks per machine (as --gpus-per-machine)")
    t.add_argument("-m", "--module", action="store_true", help="the command is a Python module (python -m)")
    t.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="run the command as it is, not with python")
    t.add_argument("--standalone", action="store_true", help=argparse.SUPPRESS)
    for name in IGNORED_TORCHRUN:
        under = name.replace("-", "_")
        names = [f"--{name}"] + ([f"--{under}"] if under != name else [])
        t.add_argument(*names, dest=f"torchrun_{under}", help=argparse.SUPPRESS)


# torchrun options that mean nothing under stalwart, and why (one line each when given)
IGNORED_TORCHRUN = {
    "rdzv-backend": "the controller hosts each run's rendezvous store",
    "rdzv-endpoint": "the controller hosts each run's rendezvous store",
    "rdzv-id": "the controller hosts each run's rendezvous store",
    "rdzv-conf": "the controller hosts each run's rendezvous store",
    "master-addr": "the controller hosts each run's rendezvous store",
    "master-port": "the controller hosts each run's rendezvous store",
    "node-rank": "machines get their ranks from the controller",
    "max-restarts": "stalwart restarts by its policy (policy.max_restarts_without_progress)",
    "monitor-interval": "agents watch their workers every heartbeat",
    "start-method": "workers are started by the agents",
    "role": "every worker is a trainer",
    "log-dir": "workers' logs are in the state dir: stalwart logs --rank R",
    "redirects": "workers' logs are in the state dir: stalwart logs --rank R",
    "tee": "rank 0's output and every rank's stderr are on the console (--log-ranks)",
    "local-addr": "agents give the workers their addresses",
    "run-path": "use -m or a script path",
}


def torchrun_spec(a, d: dict) -> None:
    """Fold torchrun's options of `a` into the spec dict `d`; a note for each meaningless one."""
    if getattr(a, "nnodes", None) is not None:
        text = a.nnodes
        lo, sep, hi = text.partition(":")
        try:
            nodes = int(hi if sep else lo)
        except ValueError:
            raise UserError(f"--nnodes takes a number or MIN:MAX (got {text!r})") from None
        if sep:
            note(f"--nnodes {text}: elastic ranges are not used; the job runs on {nodes} machines "
                 "and standbys replace lost ones")
        if a.machines is not None and a.machines != nodes:
            raise UserError(f"--nnodes {text} and --machines {a.machines} disagree")
        d["machines"] = nodes
    if getattr(a, "nproc_per_node", None) is not None:
        try:
            n = int(a.nproc_per_node)
        except ValueError:
            raise UserError(f"--nproc-per-node takes a number of ranks per machine (got {a.nproc_per_node!r})") \
                from None
        if a.gpus_per_machine is not None and a.gpus_per_machine != n:
            raise UserError(f"--nproc-per-node {n} and --gpus-per-machine {a.gpus_per_machine} disagree")
        d["gpus_per_machine"] = n
    if getattr(a, "standalone", False):
        note("--standalone is what stalwart run always is: a local controller and its machines")
    for name, why in IGNORED_TORCHRUN.items():
        if getattr(a, "torchrun_" + name.replace("-", "_"), None) is not None:
            note(f"--{name} is not used: {why}")


def note(text: str) -> None:
    print(f"stalwart: note: {text}", file=sys.stderr)


def is_python(exe: str) -> bool:
    from stalwart.spec.commandline import is_python as named_python   # spec: not on --help's path
    return named_python(exe)


def launch_command(cmd: list[str], module: bool, no_python: bool) -> list[str]:
    """The command torchrun would run: `-m MOD ...` and a script are run by this Python (as
    torchrun runs them with its own), `--no-python` as given; a command that starts with an
    interpreter or an executable (the `--` form) as given."""
    if module:
        return [sys.executable, "-m", *cmd]
    if no_python:
        return cmd
    first = cmd[0]
    if is_python(first):
        return cmd
    if first.endswith(".py") or (os.path.isfile(first) and not os.access(first, os.X_OK)):
        return [sys.executable, *cmd]
    return cmd


def check_command(cmd: list[str], workdir: str) -> None:
    """A script, module or executable that does not exist is one line, before anything starts."""
    from stalwart.spec.commandline import python_target
    target = python_target(cmd)
    if target is not None and target[1] == "script":
        path = os.path.join(workdir, cmd[target[0]])
        if not os.path.isfile(path):
            raise UserError(f"script {cmd[target[0]]} does not exist (in {workdir})")
        return
    if target is not None and target[1] == "module":
        if os.path.abspath(cmd[0]) == os.path.abspath(sys.executable):
            top = cmd[target[0]].split(".")[0]
            sys.path.insert(0, workdir)
            try:
                found = importlib.util.find_spec(top) is not None
            except (ImportError, ValueError):
                found = False
            finally:
                sys.path.remove(workdir)
            if not found:
                raise UserError(f"module {top} not found (in {workdir} or this Python's packages)")
        return
    exe = cmd[0]
    if "/" in exe:
        if not os.path.exists(os.path.join(workdir, exe)):
            raise UserError(f"{exe} does not exist (in {workdir})")
    elif shutil.which(exe) is None:
        raise UserError(f"command {exe} not found on PATH")


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
    torchrun_spec(a, d)
    reshaped = any(getattr(a, k, None) is not None for k in ("machines", "gpus_per_machine", "tp", "pp", "nnodes",
                                                                "nproc_per_node"))
    if a.config and reshaped and a.dp is None:
        d.pop("dp", None)           # the config's dp was derived from its own shape: derive it again
    if a.standby is not None:
        d["standby"] = a.standby if a.standby == "auto" else int_arg("--standby", a.standby)
    if getattr(a, "backup_every", None) is not None:
        d["backup_every"] = a.backup_every if a.backup_every == "auto" else int_arg("--backup-every", a.backup_every)
    if a.chaos:
        d["chaos"] = list(d.get("chaos", [])) + a.chaos
    cmd = list(a.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd:
        d["command"] = launch_command(cmd, getattr(a, "module", False), getattr(a, "no_python", False))
    if not d.get("command"):
        raise UserError("no training command given: stalwart run [options] train.py ... "
                        "(or -- python train.py ...)")
    if d["command"][0] in ("python", "python3"):
        d["command"] = [sys.executable] + d["command"][1:]
    d["code_dir"] = d.get("code_dir") or os.getcwd()
    d["workdir"] = d.get("workdir") or os.getcwd()     # where the user ran the command: relative paths land here
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
        catalogue.validate_against(catalogue.parse(c), spec.machines + standby_count(spec),
                                   spec.gpus_per_machine, spec.machines)
    check_command(spec.command, spec.workdir or os.getcwd())
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
    p.add_argument("--tls-cert", default=os.environ.get(TLS_CERT_ENV) or None,
                   help="this client's certificate (PEM; with --tls-key) for a controller that verifies them "
                        "(--tls-client-ca): it is the credential of a request without a token "
                        f"(default: ${TLS_CERT_ENV})")
    p.add_argument("--tls-key", default=os.environ.get(TLS_KEY_ENV) or None,
                   help=f"the client certificate's private key (PEM; default: ${TLS_KEY_ENV})")


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
    p.add_argument("--slurm-job", metavar="ID", help="the Slurm job (stalwart slurm sbatch/run) whose state dir to use")
    if controller:
        controller_options(p)
    if job:
        p.add_argument("--job", default="latest", help="job id, or latest (default)")


def resolve_slurm_job(a) -> None:
    """--slurm-job ID: the state dir is the one that Slurm job runs in."""
    if getattr(a, "slurm_job", None):
        from stalwart.backends.slurm_alloc import state_dir_of
        a.state_dir = state_dir_of(a.slurm_job)


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
    (--token-file, $STALWART_TOKEN or the state dir's token file; "" when none: a client
    certificate alone may be the credential), --tls-ca and --tls-cert/--tls-key."""
    try:
        return Client(controller_url(a), timeout=timeout,
                      token=auth.client_token(getattr(a, "token_file", None), a.state_dir) or "",
                      ca=getattr(a, "tls_ca", None), cert=getattr(a, "tls_cert", None),
                      key=getattr(a, "tls_key", None))
    except auth.AuthConfigError as e:
        raise UserError(str(e)) from None


def state_store_url(a) -> str:
    """The store a read command falls back to when no controller answers: the state dir's (the
    caller re-raises when --controller named one that did not answer)."""
    if not os.path.exists(statedir.db_path(a.state_dir)):
        raise UserError(f"no controller and no stalwart state in {os.path.abspath(a.state_dir)} "
                        "(pass --controller, --state-dir or --db)")
    return statedir.db_url(a.state_dir)


def offline_report(a, job: str = "latest") -> dict:
    from stalwart.controller.report.build import build_report
    from stalwart.controller.store.db import Store
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
