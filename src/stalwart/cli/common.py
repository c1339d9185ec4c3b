"""What every command shares: the user's mistakes, the state dir, the controller's client, the job options."""
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

__all__ = ["DEFAULT_STATE", "UserError", "chaos_help", "api_client", "client_options", "controller_url", "job_options",
           "labels", "offline_report", "report", "setup_logging", "spec_from_args", "state_options", "write_atomic"]

DEFAULT_STATE = ".stalwart"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


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
    p.add_argument("--token-file", help=f"the controller's token (default: ${auth.TOKEN_ENV}, else "
                                        f"<state-dir>/{auth.TOKEN_FILE})")
    p.add_argument("--tls-ca", help="CA file to verify an https controller's certificate")


def state_options(p: argparse.ArgumentParser, controller: bool = True, job: bool = True) -> None:
    """--state-dir, and for the commands that talk to a controller --controller, its credentials and --job."""
    p.add_argument("--state-dir", default=DEFAULT_STATE)
    p.add_argument("--slurm-job", metavar="ID", help="the Slurm job (stalwart slurm sbatch/run) whose state dir to use")
    if controller:
        p.add_argument("--controller", help="controller URL (default: the one of --state-dir)")
        client_options(p)
    if job:
        p.add_argument("--job", default="latest")


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
