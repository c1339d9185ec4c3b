"""The `stalwart slurm` commands: `submit` (the controller on this host), `sbatch` (the controller
inside the allocation, then log out) and `run` (what the batch script runs on the allocation's
first node, taking the job over after a requeue).

How each runs on Slurm is in `backends/slurm_submit.py` and `backends/slurm_alloc.py`; here are
the arguments, the checks a user's mistake fails with, and the lines the user reads. The
controller's modules are imported where a command runs, so that building the parser stays cheap.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
from typing import Any

import yaml

from stalwart.backends.slurm import NOTES, JobInfo, SlurmError, ended_reason, job_info, run_cli
from stalwart.backends.slurm_alloc import COMMENT_PREFIX, InsideCluster, batch_script, gpu_request, remember
from stalwart.backends.slurm_submit import SlurmCluster, default_advertise
from stalwart.cli.common import job_options, spec_from_args
from stalwart.controller.cluster.standby import standby_count
from stalwart.errors import StalwartError, UserError


def cmd_slurm_submit(a) -> int:
    from stalwart.backends.launch import run_job
    spec = spec_from_args(a)
    if a.spare < 0:
        raise UserError(f"--spare must be >= 0 (got {a.spare})")
    sbatch = gpu_request(a, spec.gpus_per_machine) + list(a.sbatch_arg or [])
    if a.partition:
        sbatch.append(f"--partition={a.partition}")
    if a.time:
        sbatch.append(f"--time={a.time}")
    total = spec.machines + standby_count(spec) + a.spare
    cluster = SlurmCluster(a.state_dir, total, spec.gpus_per_machine, a.advertise or default_advertise(),
                           heartbeat_s=spec.policy.heartbeat_s, missed_beats=spec.policy.missed_beats,
                           log_level=a.log_level, sbatch_args=sbatch, agent_prefix=shlex.split(a.agent_prefix or ""),
                           agent_args=list(a.agent_arg), srun_args=list(a.srun_arg))
    cluster.cfg.drain = a.drain
    if a.dry_run:
        print("# " + " ".join(shlex.quote(x) for x in cluster.backend.sbatch_argv(total, "agents.sh")))
        print(cluster.backend.batch_script(0), end="")
        return 0
    print(f"stalwart: controller here ({cluster.advertise}); asking Slurm for {total} nodes "
          f"({spec.machines} active, {standby_count(spec)} standby, {a.spare} spare)", flush=True)
    shown: list[str] = []

    def waiting(got: int, want: int, state: str) -> None:
        line = f"stalwart: {got}/{want} agents up (allocation {cluster.backend.main_allocation()} {state})"
        if not shown or shown[-1] != line:
            print(line, flush=True)
            shown.append(line)
    cluster.on_wait = waiting

    def start() -> None:
        try:
            cluster.start(timeout=a.start_timeout)
        except SlurmError as e:
            raise UserError(str(e)) from None
        print(f"stalwart: Slurm allocation {cluster.backend.main_allocation()}; machines "
              f"{', '.join(cluster.names)}", flush=True)
    return run_job(cluster, spec, start)


def add_parsers(sub) -> None:
    s = sub.add_parser("slurm", help="run jobs on a Slurm cluster", conflict_handler="resolve").add_subparsers(
        dest="slurm_cmd", required=True)
    add_run_parsers(s)
    p = s.add_parser("submit", help="a job on Slurm nodes, the controller here until the job ends (slurm sbatch "
                                    "runs it in the allocation instead)")
    job_options(p)
    node_options(p)
    p.add_argument("--srun-arg", action="append", default=[],
                   help="one more option for the agents' srun, e.g. --srun-arg=--container-image=IMAGE (repeatable)")
    p.add_argument("--drain", choices=("auto", "never"), default="auto",
                   help="auto (default): drain an evicted node, or exclude it from refills where Slurm refuses; "
                        "never: only exclude it")
    p.add_argument("--spare", type=int, default=0, help="more idle nodes in the allocation (default 0)")
    p.add_argument("--partition", help="sbatch --partition")
    p.add_argument("--time", help="sbatch --time (the allocation's time limit)")
    p.add_argument("--sbatch-arg", action="append", help="one more sbatch option, e.g. --account=ml (repeatable)")
    p.add_argument("--agent-prefix", help="a command line the agent runs under on each node (a container "
                                          "launcher, numactl...)")
    p.add_argument("--agent-arg", action="append", default=[],
                   help="one more option for every node's agent, e.g. --nic=ib0, or --shared-host where several "
                        "Slurm nodes share one host (repeatable)")
    p.add_argument("--advertise", help="this host's address as the nodes reach it (default: its name's)")
    p.add_argument("--start-timeout", type=float, default=120.0,
                   help="seconds for the agents to register once the allocation runs (default 120)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch command and batch script, do nothing")
    p.add_argument("--state-dir", default=".stalwart")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    p.set_defaults(fn=cmd_slurm_submit)


class AllocationEnding(StalwartError):
    """Slurm is ending this allocation (SIGTERM to the batch script)."""


def _notes_printer(path: str):
    seen = [0]

    def tick() -> None:
        try:
            with open(path) as f:
                f.seek(seen[0])
                text = f.read()
        except OSError:
            return
        seen[0] += len(text.encode())
        for line in text.splitlines():
            print(f"stalwart: {line}", flush=True)
    return tick


def _running_job(state_dir: str, job_id: str) -> int | None:
    """The stalwart job this allocation ran before it was requeued, if it still runs."""
    from stalwart.backends.statedir import db_path, db_url
    from stalwart.controller.service import RUNNING_STATES
    from stalwart.controller.store.db import Store
    try:
        with open(os.path.join(state_dir, "slurm", "state.json")) as f:
            main = json.load(f).get("main")
    except (OSError, ValueError):
        return None
    if str(main) != str(job_id) or not os.path.exists(db_path(state_dir)):
        return None
    store = Store(db_url(state_dir))
    try:
        running = store.jobs_in_state(RUNNING_STATES)
    finally:
        store.close()
    return int(running[-1]["id"]) if running else None


def cmd_slurm_run(a) -> int:
    from stalwart.backends.launch import run_job
    from stalwart.backends.slurm_agent import node_address
    env = os.environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise UserError("stalwart slurm run runs inside a Slurm allocation (a batch script, or salloc); "
                        "to submit one, use stalwart slurm sbatch")
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    state_dir = os.path.abspath(a.state_dir)
    remember(job_id, state_dir)
    restarts = int(env.get("SLURM_RESTART_COUNT") or "0")
    resume = _running_job(state_dir, job_id) if restarts > 0 else None
    spec = spec_from_args(a)
    want = spec.machines + standby_count(spec)
    if nodes < want:
        raise UserError(f"the allocation has {nodes} node(s); the job needs {want} ({spec.machines} active, "
                        f"{standby_count(spec)} standby): sbatch --nodes={want} or more")
    refill = list(a.sbatch_arg or [])
    if not refill:
        try:
            info = job_info(job_id)
        except SlurmError:
            info = None
        refill = (info or JobInfo(job_id, "")).like_this()
    here = env.get("SLURMD_NODENAME") or os.uname().nodename
    cluster = InsideCluster(state_dir, job_id, nodes, spec.gpus_per_machine, node_address(here),
                            list(a.srun_arg or []), heartbeat_s=spec.policy.heartbeat_s,
                            missed_beats=spec.policy.missed_beats, log_level=a.log_level, sbatch_args=refill,
                            agent_prefix=shlex.split(a.agent_prefix or ""), agent_args=list(a.agent_arg))
    cluster.cfg.drain = a.drain
    print(f"stalwart: Slurm job {job_id}" + (f" (requeued, run {restarts + 1})" if restarts else "") +
          f": controller on {here} ({cluster.advertise}), agents on {nodes} node(s) "
          f"({spec.machines} active, {standby_count(spec)} standby, {nodes - want} spare); state in {state_dir}",
          flush=True)

    def ending(*_: Any) -> None:
        """Slurm ends the allocation: a requeue (its restart count went up) leaves the job running
        in the store for the next run to take over; any other end cancels it with Slurm's reason."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            info = job_info(job_id)
        except SlurmError:
            info = None
        if info is not None and info.restarts > restarts:
            cluster.halt_controller()
            print(f"stalwart: Slurm requeued allocation {job_id}: the job resumes when it runs again", flush=True)
            raise AllocationEnding()
        why = ended_reason(job_id, info) or f"the Slurm allocation {job_id} ended ({info.state if info else 'GONE'})"
        print(f"stalwart: {why}: the job stops", flush=True)
        job = resume if resume is not None else _running_job(state_dir, job_id)
        if job is not None and cluster.url:
            try:
                cluster.client(timeout=2).post(f"/api/jobs/{job}/cancel", {"reason": why})
            except Exception:           # (the controller is going too: the store says running)
                pass
        raise AllocationEnding()
    signal.signal(signal.SIGTERM, ending)

    def start() -> None:
        try:
            cluster.start(timeout=a.start_timeout, takeover=resume is not None)
        except SlurmError as e:
            raise UserError(str(e)) from None
        if resume is not None:
            print(f"stalwart: job {resume} taken over: it resumes from its newest checkpoint", flush=True)
    try:
        return run_job(cluster, spec, start, job=resume, tick=_notes_printer(os.path.join(cluster.cfg.dir, NOTES)))
    except AllocationEnding:
        return 143                 # (the cluster is stopped: run_job's finally)


def cmd_slurm_sbatch(a) -> int:
    spec = spec_from_args(a)
    if a.spare < 0:
        raise UserError(f"--spare must be >= 0 (got {a.spare})")
    state_dir = os.path.abspath(a.state_dir)
    nodes = spec.machines + standby_count(spec) + a.spare
    sbatch = gpu_request(a, spec.gpus_per_machine)
    sbatch += [f"--partition={a.partition}"] if a.partition else []
    sbatch += [f"--time={a.time}"] if a.time else []
    sbatch += list(a.sbatch_arg or [])
    name = f"stalwart-{os.urandom(3).hex()}"
    spec_path = os.path.join(state_dir, "job.yaml")
    script = batch_script(a, spec_path, state_dir, nodes, sbatch, name)
    if a.dry_run:
        print(script, end="")
        return 0
    os.makedirs(os.path.join(state_dir, "slurm", "logs"), exist_ok=True)
    with open(spec_path, "w") as f:
        yaml.safe_dump(spec.to_dict(), f, sort_keys=False)
    path = os.path.join(state_dir, "slurm", "sbatch.sh")
    with open(path, "w") as f:
        f.write(script)
    try:
        out = run_cli(["sbatch", "--parsable", f"--comment={COMMENT_PREFIX}{state_dir}", path])
    except SlurmError as e:
        raise UserError(str(e)) from None
    job_id = out.strip().split(";")[0]
    remember(job_id, state_dir)
    print(f"stalwart: Slurm job {job_id} submitted ({nodes} nodes: {spec.machines} active, "
          f"{standby_count(spec)} standby, {a.spare} spare); the controller runs in the allocation, "
          f"you may log out\n"
          f"stalwart: follow it: stalwart status --slurm-job {job_id}   (its output: "
          f"{state_dir}/slurm/logs/slurm-{job_id}.out)\n"
          f"stalwart: stop it: scancel --name={name}   (the allocation and its refills)", flush=True)
    return 0


def run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `slurm sbatch` and `slurm run` (the second gets them from the first)."""
    p.add_argument("--srun-arg", action="append", default=[],
                   help="one more option for the agents' srun, e.g. --srun-arg=--container-image=IMAGE, "
                        "--srun-arg=--mpi=pmix, --srun-arg=--cpu-bind=none (repeatable)")
    p.add_argument("--agent-arg", action="append", default=[],
                   help="one more option for every node's agent, e.g. --agent-arg=--nic=ib0 (repeatable)")
    p.add_argument("--agent-prefix", help="a command line the agent runs under on each node (numactl...)")
    p.add_argument("--drain", choices=("auto", "never"), default="auto",
                   help="auto (default): drain an evicted node, or exclude it from refills where Slurm refuses "
                        "(no operator rights); never: only exclude it")
    p.add_argument("--start-timeout", type=float, default=120.0,
                   help="seconds for the agents to register once the allocation runs (default 120)")
    p.add_argument("--state-dir", default=".stalwart", help="on storage every node sees (default .stalwart)")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")


def node_options(p) -> None:
    """The allocation's nodes and the GPUs asked of Slurm: the same for `sbatch` and `submit`."""
    p.add_argument("--nodes", dest="machines", type=int, help="active nodes (the job's machines)")
    p.add_argument("--gpus-per-node", dest="gpus_per_machine", type=int,
                   help="GPUs per node: the job's, and sbatch --gpus-per-node unless --gres says otherwise")
    p.add_argument("--gres", help="sbatch --gres instead of --gpus-per-node, e.g. gpu:h100:8")
    p.add_argument("--no-gpu-request", action="store_true", help="ask Slurm for no GPUs (CPU nodes, simulated GPUs)")


def add_run_parsers(s) -> None:
    b = s.add_parser("sbatch", help="submit a job whose controller runs in the allocation (then log out)")
    job_options(b)
    node_options(b)
    b.add_argument("--spare", type=int, default=0, help="more idle nodes in the allocation (default 0)")
    b.add_argument("--partition", help="sbatch --partition")
    b.add_argument("--time", help="sbatch --time (the allocation's time limit)")
    b.add_argument("--sbatch-arg", action="append", help="one more sbatch option, e.g. --sbatch-arg=--account=ml "
                                                         "(repeatable; refills get it too)")
    run_options(b)
    b.add_argument("--dry-run", action="store_true", help="print the batch script, submit nothing")
    b.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    b.set_defaults(fn=cmd_slurm_sbatch)

    r = s.add_parser("run", help="inside an allocation (a batch script): run a job on its nodes, the controller "
                                 "here; takes the job over when the allocation was requeued")
    job_options(r)
    r.add_argument("--sbatch-arg", action="append",
                   help="an sbatch option for refills (repeatable; default: this allocation's partition, "
                        "account, GRES and time limit)")
    run_options(r)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    r.set_defaults(fn=cmd_slurm_run)
