"""What `srun` starts on each node of a stalwart allocation: names the node's machine
(`m<first + SLURM_NODEID>`), learns its topology labels and address from Slurm, then becomes the
node's agent (`stalwart agent … --label switch=… --label slurm.node=…`).

    python -m stalwart.backends.slurm_agent --config STATE/slurm/backend.json --first K
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import socket
import sys

from stalwart.agent import keeper
from stalwart.agent.paths import ckpt_root
from stalwart.backends.slurm import SlurmBackend, SlurmConfig, SlurmError, node_info
from stalwart.security import auth, identity


def node_address(node: str) -> str:
    """The node's address as Slurm reaches it (NodeAddr), else its host name's."""
    try:
        info = node_info(node)
        addr = info.address if info else ""
        ipaddress.ip_address(addr)
        return addr
    except (SlurmError, ValueError):
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def controller_url(cfg: SlurmConfig) -> str:
    """Where the controller is now: its published address (it may have restarted on another
    port since the config was written), else the config's."""
    try:
        with open(os.path.join(cfg.state_dir, "controller.json")) as f:
            return str(json.load(f)["url"])
    except (OSError, ValueError, KeyError):
        return cfg.controller_url


def machine_of(first: int, env: dict[str, str]) -> str:
    return f"m{first + int(env.get('SLURM_NODEID', '0'))}"


def join_token_file(cfg: SlurmConfig, machine: str, workdir: str) -> str | None:
    """A join token made for `machine` (0600, in its workdir), when this node can read the
    controller's secret in the shared state dir (as it could its token): the agent then holds
    its machine's credential only, and the controller may drain its node. None: the state dir
    holds no secret (the agent uses the token file)."""
    if not os.path.exists(os.path.join(cfg.state_dir, auth.SECRET_FILE)):
        return None
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "join.token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(identity.join_token(auth.controller_secret(cfg.state_dir), machine) + "\n")
    return path


def agent_argv(cfg: SlurmConfig, first: int, env: dict[str, str], join_file: str | None = None) -> list[str]:
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    machine = machine_of(first, env)
    labels = SlurmBackend(cfg).labels(node)
    if env.get("SLURM_JOB_ID"):
        labels["slurm.job"] = env["SLURM_JOB_ID"]
    argv = [cfg.python, "-m", "stalwart.cli", "agent", "--controller", controller_url(cfg),
            "--machine-id", machine, *(["--join-token-file", join_file] if join_file else
                                       ["--token-file", cfg.token_file]),
            "--controller-file", os.path.join(cfg.state_dir, "controller.json"),
            "--workdir", cfg.workdir.format(state_dir=cfg.state_dir, machine=machine, node=node),
            "--gpus-per-machine", str(cfg.gpus), "--heartbeat", str(cfg.heartbeat_s), "--address", node_address(node),
            "--log-level", cfg.log_level]
    for k, v in sorted(labels.items()):
        argv += ["--label", f"{k}={v}"]
    return argv + list(cfg.agent_args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stalwart.backends.slurm_agent")
    ap.add_argument("--config", required=True, help="the backend's JSON config (<state-dir>/slurm/backend.json)")
    ap.add_argument("--first", type=int, default=0, help="the first node's machine index")
    a = ap.parse_args(argv)
    try:
        cfg = SlurmConfig.load(a.config)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: cannot read {a.config}: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    machine = machine_of(a.first, env)
    workdir = cfg.workdir.format(state_dir=cfg.state_dir, machine=machine, node=node)
    # a machine that starts here is new (a refill, or a requeued allocation on whatever nodes it
    # got): checkpoint memory at its path is an earlier agent's, never this one's

    shutil.rmtree(ckpt_root(workdir), ignore_errors=True)
    args = agent_argv(cfg, a.first, env, join_token_file(cfg, machine, workdir))
    os.environ.update(cfg.env)
    sys.stdout.flush()
    return keeper.keep(args)        # a dead agent is started again: its workers are adopted, not lost


if __name__ == "__main__":
    sys.exit(main())
