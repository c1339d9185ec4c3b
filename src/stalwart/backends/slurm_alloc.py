"""Slurm with the controller inside the allocation: `stalwart slurm sbatch` and `stalwart slurm run`.

    stalwart slurm sbatch --nodes 4 --standby 1 --gpus-per-node 8 --partition gpu --time 24:00:00 \\
        --state-dir /shared/llm -- python train.py

writes the job's spec and a batch script into the state dir (which every node must see), submits
it with `sbatch` and exits: the user may log out. The batch script runs `stalwart slurm run` on the
allocation's first node, which starts the controller there, `srun`s one agent per node of the
allocation (with the `--srun-arg`s: pyxis' --container-image, --mpi, --cpu-bind...), submits the
job, prints its progress to the job's output file and exits with the job's result (0 succeeded,
1 not), ending the allocation. A user's own `#SBATCH` script runs `stalwart slurm run` the same way.

The allocation is `--requeue`able: when Slurm requeues it (a preemption with PreemptMode=REQUEUE, a
node failure, `scontrol requeue`), the batch script runs again and `stalwart slurm run` takes the
job over: the controller restarts on the same store, the agents register again, and the job goes on
from its newest checkpoint (the new nodes' memory is empty: the durable tier, under the state dir).

`stalwart status/report --slurm-job ID` find the state dir of a Slurm job from a registry of the
jobs submitted (`~/.stalwart/slurm-jobs/ID`, or `$STALWART_SLURM_JOBS`), else from the job's
comment (`stalwart:<state dir>`).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

import yaml

from stalwart import auth
from stalwart.backends.slurm import NOTES, JobInfo, SlurmError, ended_reason, job_info, run_cli
from stalwart.backends.local import LocalCluster
from stalwart.backends.slurm_submit import SlurmCluster
from stalwart.errors import UserError

REGISTRY_ENV = "STALWART_SLURM_JOBS"
COMMENT_PREFIX = "stalwart:"


# -- which state dir a Slurm job uses --------------------------------------------------------------
def registry_dir() -> str:
    return os.environ.get(REGISTRY_ENV) or os.path.join(os.path.expanduser("~"), ".stalwart", "slurm-jobs")


def remember(job_id: str, state_dir: str) -> None:
    """Note that Slurm job `job_id` runs the stalwart job of `state_dir`."""
    try:
        os.makedirs(registry_dir(), exist_ok=True)
        with open(os.path.join(registry_dir(), str(job_id)), "w") as f:
            f.write(os.path.abspath(state_dir) + "\n")
    except OSError:
        pass                 # the job's comment says it too (sbatch)


def state_dir_of(job_id: str) -> str:
    """The state dir of Slurm job `job_id` (UserError when nothing says)."""
    if not str(job_id).isdigit():
        raise UserError(f"--slurm-job takes a Slurm job id (got {job_id!r})")
    try:
        with open(os.path.join(registry_dir(), str(job_id))) as f:
            return f.read().strip()
    except OSError:
        pass
    try:
        info = job_info(str(job_id))
    except SlurmError as e:
        raise UserError(f"cannot ask Slurm about job {job_id}: {e}") from None
    if info is not None and info.comment.startswith(COMMENT_PREFIX):
        return info.comment[len(COMMENT_PREFIX):]
    raise UserError(f"Slurm job {job_id} is not a stalwart job this user submitted (no {registry_dir()}/{job_id}, "
                    f"no '{COMMENT_PREFIX}' comment): pass --state-dir")


# -- stalwart slurm run: inside the allocation ----------------------------------------------------
class InsideCluster(SlurmCluster):
    """The controller on this node (the allocation's first), restarted like the local cluster's,
    and the agents of the allocation's nodes in one `srun` step; refills are new allocations."""

    def __init__(self, state_dir: str, job_id: str, nodes: int, gpus_per_node: int, advertise: str,
                 srun_args: list[str], **kw: Any):
        super().__init__(state_dir, nodes, gpus_per_node, advertise, **kw)
        self.job_id = job_id
        self.cfg.inside = True
        self.cfg.srun_args = list(srun_args)
        self.step: subprocess.Popen | None = None
        self.requeued = False        # keep the refill allocations: their agents serve the next run

    def start(self, timeout: float = 60.0, takeover: bool = False) -> str:   # type: ignore[override]
        import threading
        os.makedirs(self.state_dir, exist_ok=True)
        self.token = auth.create_token_file(self.token_file)      # (kept: a requeued run reuses it)
        self.store_host = self.advertise
        self._stopping.clear()
        self._start_controller(f"{self.listen_host}:0", timeout, extra=[] if takeover else ["--abandon-running"])
        self.start_agents(self.agents_url(), self.n)
        self.wait_registered(timeout)
        threading.Thread(target=self._supervise, name="controller-supervisor", daemon=True).start()
        return self.url or ""

    def start_agents(self, controller_url: str, count: int) -> list[str]:
        self.cfg.controller_url = controller_url
        self.cfg.save()
        job = self.job_id

        def note(st: dict[str, Any]) -> None:
            st["main"] = job
            if job not in st["allocations"]:
                st["allocations"].append(job)
            st["next"] = max(int(st.get("next", 0)), count)      # m0..m{count-1}: this allocation's
        self.backend.state.read(note)
        self.names = [f"m{i}" for i in range(count)]
        self.step = self._spawn(self.backend.srun_argv(0, count), "agents-step.log")
        return self.names

    def wait_registered(self, timeout: float) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout
        from stalwart.client import ControllerUnreachable
        while True:
            try:
                alive = {m["id"] for m in client.get("/api/machines")["machines"] if m.get("alive")}
            except ControllerUnreachable:
                alive = set()
            if set(self.names) <= alive:
                return
            if self.on_wait:
                self.on_wait(len(set(self.names) & alive), len(self.names), "RUNNING")
            if self.step is not None and self.step.poll() is not None:
                raise RuntimeError(f"the agents' srun step exited (code {self.step.returncode}); see "
                                   f"{self.state_dir}/logs/agents-step.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agents did not register within {timeout:.0f}s; see "
                                   f"{self.state_dir}/logs/agents-step.log")
            time.sleep(0.2)

    def halt_controller(self) -> None:
        """Stop the controller at once, as it is: Slurm is killing the agents for a requeue, and
        the controller must not take that for lost machines (it would start recovering, with no
        standby left). The next run's controller takes the job over from the store."""
        self._stopping.set()                    # (no restart by the supervisor)
        self.requeued = True
        proc = self.controller
        if proc is not None and proc.poll() is None:
            proc.kill()

    def stop(self) -> None:
        from stalwart.agent.workers import kill_tree
        if self.step is not None:
            kill_tree(self.step.pid, grace_s=2.0)     # srun passes SIGTERM to the agents, then ends the step
            self.step = None
        if self.requeued:
            LocalCluster.stop(self)                   # (not SlurmCluster's: no release of the refills)
        else:
            super().stop()


class AllocationEnding(Exception):
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
    import json

    from stalwart.backends.statedir import db_path, db_url
    from stalwart.controller.service import RUNNING_STATES
    from stalwart.controller.store import Store
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
    from stalwart.cli.common import spec_from_args
    from stalwart.controller.pool import standby_count
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


# -- stalwart slurm sbatch: submit and log out ------------------------------------------------------
def batch_script(a, spec_path: str, state_dir: str, nodes: int, sbatch: list[str], name: str) -> str:
    """The batch script of `stalwart slurm sbatch`: its #SBATCH options and `stalwart slurm run`."""
    opts = [f"--job-name={name}", f"--nodes={nodes}", "--no-kill", "--requeue", "--exclusive",
            "--open-mode=append", f"--output={state_dir}/slurm/logs/slurm-%j.out"] + sbatch
    run = [sys.executable, "-m", "stalwart.cli", "slurm", "run", "--config", spec_path, "--state-dir", state_dir,
           "--log-level", a.log_level, "--drain", a.drain, "--start-timeout", str(a.start_timeout)]
    run += [f"--srun-arg={x}" for x in a.srun_arg or []] + [f"--agent-arg={x}" for x in a.agent_arg or []]
    run += [f"--sbatch-arg={x}" for x in sbatch]              # (refills ask for nodes of the same kind)
    if a.agent_prefix:
        run += ["--agent-prefix", a.agent_prefix]
    return ("#!/bin/sh\n" + "".join(f"#SBATCH {shlex.quote(o)}\n" for o in opts) +
            "# stalwart's controller runs here, on the allocation's first node; one agent per node (generated)\n"
            "exec " + " ".join(shlex.quote(x) for x in run) + "\n")


def gpu_request(a, gpus: int) -> list[str]:
    if a.gres:
        return [f"--gres={a.gres}"]
    if a.no_gpu_request or gpus <= 0:
        return []
    return [f"--gpus-per-node={gpus}"]


def cmd_slurm_sbatch(a) -> int:
    from stalwart.cli.common import spec_from_args
    from stalwart.controller.pool import standby_count
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


def add_parsers(s, job_options) -> None:
    b = s.add_parser("sbatch", help="submit a job whose controller runs in the allocation (then log out)")
    job_options(b)
    b.add_argument("--nodes", dest="machines", type=int, help="active nodes (the job's machines)")
    b.add_argument("--gpus-per-node", dest="gpus_per_machine", type=int,
                   help="GPUs per node: the job's, and sbatch --gpus-per-node unless --gres says otherwise")
    b.add_argument("--gres", help="sbatch --gres instead of --gpus-per-node, e.g. gpu:h100:8")
    b.add_argument("--no-gpu-request", action="store_true", help="ask Slurm for no GPUs (CPU nodes, simulated GPUs)")
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
