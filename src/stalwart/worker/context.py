"""The worker SDK's context: rank, topology, process groups, metrics, checkpoints, chaos hooks."""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import traceback
from typing import Any, Iterable

import torch
import torch.distributed as dist

import stalwart.worker.durable as durable
import stalwart.worker.memckpt as memckpt
from stalwart.devices.simgpu import fatal_line, slowdown_factor
from stalwart import protocol
from stalwart.protocol import Env
from stalwart.topology import Topology
from stalwart.worker.link import AgentLink
from stalwart.worker.simgpu_view import SimGpuView
from stalwart.worker.standby import take_link
from stalwart.worker.teardown import release_process_groups
from stalwart.worker.warmup import untitle_warm, warm_up_torch

GROUP_KINDS = ("tp", "cp", "ep", "dp", "pp")


def _env_int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


class Context:
    """What `stalwart.worker.init()` returns. See the README's "Worker SDK" section."""

    def __init__(self, tp: int | None = None, pp: int | None = None, dp: int | None = None,
                 cp: int | None = None, ep: int | None = None, timeout_s: float = 60.0,
                 attach: bool = False):
        # attach: the script built its own process groups (`init_process_group`, a framework's
        # strategy); the context joins them and never destroys them
        self.attached = attach
        # from here on this process' steps are the SDK's to report: the start-up hook's own
        # optimizer-step counting stands down (see Env.SDK_STEPS)
        os.environ[Env.SDK_STEPS] = "1"
        self._chaos: dict[str, protocol.WorkerChaos] = {}
        self._imported_at = time.time()       # torch and the training script are loaded
        self._activation = threading.Event()
        self._activation_env: dict[str, str] = {}
        self.link = take_link(self._on_agent_message) or \
            AgentLink(os.environ.get(Env.AGENT_SOCK), self._on_agent_message)
        if os.environ.get(Env.STANDBY) == "1":
            self._wait_for_activation()
            self._imported_at = time.time()   # (a warm worker was loaded long before)
        env = os.environ
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        if attach and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        elif attach and self.world_size > 1:
            raise RuntimeError("stalwart.worker.attach() joins the script's own process groups: "
                               "call torch.distributed.init_process_group first")
        self.local_rank = _env_int("LOCAL_RANK", 0)
        self.run = _env_int(Env.RUN, None)
        self.job = env.get(Env.JOB, "local")
        local_world = _env_int("LOCAL_WORLD_SIZE", self.world_size)
        gpm = _env_int(Env.GPUS_PER_MACHINE, local_world)
        machines = _env_int(Env.MACHINES, max(1, self.world_size // max(1, gpm)))
        sizes = {k: _env_int(getattr(Env, k.upper()), None) for k in GROUP_KINDS}
        given = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
        for k in GROUP_KINDS:  # the agent's layout wins: it is the job's layout
            if sizes[k] is None:
                sizes[k] = given[k]
        for k in ("tp", "pp", "cp", "ep"):
            sizes[k] = sizes[k] or 1
        if sizes["dp"] is None:
            sizes["dp"] = self.world_size // (sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["ep"])
        self.topology = Topology(machines, gpm, tp=sizes["tp"], pp=sizes["pp"], dp=sizes["dp"],
                                 cp=sizes["cp"], ep=sizes["ep"])
        self.coords = self.topology.coords(self.rank)
        self.seed = _env_int(Env.SEED, 0)
        self.steps = _env_int(Env.STEPS, None)
        self.ckpt_dir = env.get(Env.CKPT_DIR) or os.path.abspath("checkpoints")
        self.ckpt_every = _env_int(Env.CKPT_EVERY, 10)
        self.timeout_s = timeout_s
        # A dual-phase replay (stop-time diagnostics) trains a throw-away copy of the job: it must
        # never write the job's checkpoints nor restore from them.
        self.replay = env.get(Env.REPLAY) == "1"
        # ...on fewer layers where the job honours it (0: keep the job's own depth)
        self.replay_layers = _env_int(Env.REPLAY_LAYERS, 0) if self.replay else 0
        shm = None if self.replay else env.get(Env.SHM_DIR)
        # STALWART_MEM_OVERLAP=1: the snapshot's copy overlaps the next step's forward and backward
        # and `on_gradients` waits for it before the optimizer step (off by default: on a CPU host
        # the side thread's hand-offs of the interpreter lock cost the step more than the copy)
        self.mem = memckpt.MemCheckpointer(shm, self.rank, slots=max(2, _env_int(Env.MEM_SLOTS, 2)),
                                           on_commit=self._shard_committed,
                                           overlap=env.get(Env.MEM_OVERLAP, "0") == "1") \
            if shm else None
        self._overlap_said = False
        self.cuda = torch.cuda.is_available() and env.get(Env.FORCE_CPU) != "1"
        self.device = torch.device(f"cuda:{self.local_rank}" if self.cuda else "cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.gpu = SimGpuView(None if self.cuda else env.get(Env.SIMGPU), self.local_rank)
        if attach:
            self.groups: dict[str, Any] = {}
            self.group_ranks = {kind: tuple(next(r for r in self.topology.groups(kind) if self.rank in r))
                                for kind in GROUP_KINDS}
        else:
            self._init_process_groups()
        self._step_t0 = time.time()
        self._compute_s = 0.0
        self._base_compute_s = 0.0      # compute time without the simulated GPU's throttling
        self._throttled_s = 0.0
        # seconds the training thread spent inside the SDK's per-step calls (begin_step,
        # on_gradients, report, the in-memory checkpoint): what stalwart costs a step
        self.blocking_s = 0.0
        self.blocking_parts = {"begin": 0.0, "gradients": 0.0, "report": 0.0, "snapshot": 0.0}
        self._local_grad_norm: float | None = None
        self._last_report: float | None = None
        self._last_reported: int | None = None    # the step of the last report
        self._ckpt_since_report = False     # an in-memory snapshot came after the last report
        self._begin_t = time.time()
        self.link.send(protocol.Hello(rank=self.rank, pid=os.getpid(), run=self.run, imported=self._imported_at,
                               ready=time.time()))

    def _shard_committed(self, step: int, path: str) -> None:
        """A snapshot is complete (the background commit thread): tell the agent at once, so it
        streams the backup and makes durable copies without polling the shared memory."""
        self.link.send(protocol.Shard(rank=self.rank, step=step, path=path))

    # -- set-up ------------------------------------------------------------------------------
    def _wait_for_activation(self) -> None:
        """A warm standby: torch is imported; block until the agent hands us our ranks."""
        warm_up_torch()
        self.link.send_now(protocol.StandbyReady(pid=os.getpid()))
        self._activation.wait()
        os.environ.update(self._activation_env)
        os.environ.pop(Env.STANDBY, None)
        untitle_warm()

    def _init_process_groups(self) -> None:
        backend = "nccl" if self.cuda else "gloo"
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.run is not None:
            # The controller hosts the rendezvous store; a per-run prefix means a restart never
            # reads the addresses of an earlier run (pytorch#135712).
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  self.world_size, is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"stalwart/run{self.run}/", store)
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
        elif self.world_size > 1 or "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, init_method="env://", rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        self.groups = {}
        self.group_ranks: dict[str, tuple[int, ...]] = {}
        for kind in GROUP_KINDS:
            for ranks in self.topology.groups(kind):
                if self.rank not in ranks:
                    continue
                self.group_ranks[kind] = tuple(ranks)
                # a group of one needs no communicator; the others synchronize among their own
                # members only, so a restart does not wait on a world-wide barrier per group
                self.groups[kind] = None if len(ranks) == 1 else dist.new_group(
                    list(ranks), timeout=timeout, use_local_synchronization=True)

    def _on_agent_message(self, msg: protocol.ToWorker) -> None:
        if isinstance(msg, protocol.Activate):
            self._activation_env = dict(msg.env)
            self._activation.set()
        elif isinstance(msg, protocol.WorkerChaos):
            self._chaos[msg.kind] = msg

    # -- restore -----------------------------------------------------------------------------
    def restore(self) -> tuple[int, Any]:
        """(first step to run, state to load) — (0, None) on a fresh start.

        Under stalwart the controller names the step to restore (STALWART_RESTORE_STEP); under a
        plain launcher the newest complete durable checkpoint is used.
        """
        path = os.environ.get(Env.RESTORE_PATH)
        if path:   # the agent materialized this rank's shard (own memory, a peer's, or durable)
            step, state = memckpt.load(path, self.rank)
            self.link.send(protocol.Restored(rank=self.rank, step=step, tier=os.environ.get(Env.RESTORE_TIER, "?")))
            return step + 1, state
        step = _env_int(Env.RESTORE_STEP, None)
        if step is None and self.run is None:
            steps = durable.complete_steps(self.ckpt_dir, self.world_size)
            step = steps[-1] if steps else -1
        if step is None or step < 0:
            return 0, None
        state = durable.load(self.ckpt_dir, step, self.rank)
        self.link.send(protocol.Restored(rank=self.rank, step=step, tier="durable"))
        return step + 1, state

    def _blocked(self, part: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.blocking_s += dt
        self.blocking_parts[part] += dt

    # -- per-step hooks ----------------------------------------------------------------------
    def chaos_active(self, kind: str, step: int) -> bool:
        """True when chaos of `kind` was armed on this worker and applies from `step` on."""
        c = self._chaos.get(kind)
        return c is not None and step >= c.from_step

    def maybe_hang(self, step: int, where: str = "pp") -> None:
        """Block forever here when the `stage-hang` chaos is armed and applies from `step` on.

        Call it in the training loop's communication path, just before a rank hands a tensor to
        a neighbour: `where="pp"` before each pipeline send (activations forward, gradients
        backward), `where="dp"` before the data-parallel all-reduce. A job with a pipeline hangs
        at its first `pp` call (its neighbour then blocks in recv, the other replicas in the
        all-reduce); a job with pp == 1 has no pipeline and hangs at the `dp` call instead. The
        process stays alive and runnable (a sleep loop, not SIGSTOP): only its stack tells it
        apart, which is the case the hang analyzer's stack grouping is for.
        """
        if not self.chaos_active("stage-hang", step):
            return
        if where != "pp" and not (where == "dp" and self.topology.pp == 1):
            return
        self.log(f"stage-hang chaos: blocking in the {where} communication of step {step}")
        while True:
            time.sleep(0.5)

    def begin_step(self, step: int) -> None:
        """Call at the start of every step.

        A step's duration runs from the end of the previous step (its report) so that the time
        between steps (checkpointing, logging) counts as part of training, not as lost time.
        """
        t0 = time.perf_counter()
        if self._last_report is None:
            self._step_t0 = time.time()
        gpu = self.gpu.state()                # (one look at the simulated GPU a step)
        err = fatal_line(gpu)
        if err is not None:
            raise RuntimeError(err)           # what a CUDA call on a dead GPU raises
        self._blocked("begin", t0)
        self._begin_t = time.time()
        slow = slowdown_factor(gpu)
        self._throttled_s = 0.0
        if slow > 1.0 and self._base_compute_s > 0:
            # a throttled GPU computes slower: the time is the step's compute, as on a real one
            self._throttled_s = (slow - 1.0) * self._base_compute_s
            time.sleep(self._throttled_s)

    def fence_snapshot(self) -> None:
        """Wait until the newest overlapped snapshot's copy is done (STALWART_MEM_OVERLAP=1; call
        before the state's tensors change), and say once in the rank's log why snapshots stopped
        overlapping, if they did."""
        self.mem.fence()
        if self.mem.overlap_off is not None and not self._overlap_said:
            self._overlap_said = True
            self.log(f"in-memory checkpoint: {self.mem.overlap_off}")

    def on_gradients(self, step: int, params: Iterable[torch.Tensor], comm_s: float = 0.0) -> None:
        """Call after backward and before the data-parallel reduction of the gradients (and so
        before the optimizer step: with STALWART_MEM_OVERLAP=1 the previous step's in-memory
        checkpoint, copied while this step computed, is complete when it returns).

        `comm_s`: seconds of this step so far spent communicating (a pipeline's sends and
        receives), left out of the compute time reported: a stage waiting for a slow neighbour
        does not compute slowly, and the fail-slow rounds compare compute times."""
        t0 = time.perf_counter()
        if self.mem is not None and self.mem.overlap:   # the previous copy is done before the state changes
            self.fence_snapshot()
            self._blocked("snapshot", t0)
            t0 = time.perf_counter()
        grads = [p.grad for p in params if p.grad is not None]
        self._compute_s = max(0.0, time.time() - self._begin_t - max(0.0, comm_s))
        self._base_compute_s = max(0.0, self._compute_s - self._throttled_s)   # what a cool GPU takes
        if self.chaos_active("nan", step):
            for g in grads:
                g.fill_(float("nan"))
        if grads:   # one reduction and one sync for every gradient, not one per tensor
            with torch.no_grad():
                norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                self._local_grad_norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        else:
            self._local_grad_norm = 0.0
        if self.gpu.corrupts() and grads:
            # Silent data corruption (a mercurial core): the buffers handed to the reduction are
            # wrong although the norm this rank computed looked fine, so the per-rank norms do not
            # name the machine; the non-finite update shows only after the reduction.
            grads[0].view(-1)[0] = float("inf")
        self._blocked("gradients", t0)

    def report(self, step: int, loss: float | None = None, grad_norm: float | None = None,
               tokens: int | None = None, **extra: float) -> None:
        """Report step metrics (sent to the agent off the training thread)."""
        t0 = time.perf_counter()
        now = time.time()
        msg = {"type": "step", "rank": self.rank, "step": step, "t": now, "dur": now - self._step_t0,
               "loss": loss, "grad_norm": grad_norm, "tokens": tokens,
               "local_grad_norm": self._local_grad_norm, "compute_s": self._compute_s}
        msg.update(extra)
        # with an every-step checkpoint (the last report was followed by one) the step's commit
        # follows in a moment: the report goes with its message, and no thread is woken while
        # this one trains (see worker/link.py); a job checkpointing now and then wakes it
        self.link.send(msg, wake=not self._ckpt_since_report)
        self._ckpt_since_report = False
        self._last_reported = step
        self._last_report = self._step_t0 = now
        self._blocked("report", t0)

    def checkpoint(self, state: Any, step: int) -> None:
        """Checkpoint the state reached after `step`.

        Under a stalwart agent: into shared memory, every step (the step blocks for the copy; the
        agent streams it to a backup peer and to the durable tier every `ckpt_every` steps). With
        STALWART_MEM_OVERLAP=1 the copy runs while the next step computes: the state's tensors
        must not change until the next `on_gradients` returns (a change through torch's in-place
        ops is seen and the copies go back to blocking this call, said once in the log). Without
        an agent: a durable file every `ckpt_every` steps.
        """
        if self.mem is not None:
            t0 = time.perf_counter()
            self.mem.snapshot(state, step)
            self._ckpt_since_report = True
            self._blocked("snapshot", t0)
            return
        if self.replay:
            return
        last = self.steps is not None and step + 1 >= self.steps
        if (step + 1) % self.ckpt_every == 0 or last:
            meta = durable.save(self.ckpt_dir, step, self.rank, state, layout=self.topology_dict())
            self.link.send(protocol.Ckpt(rank=self.rank, step=step, tier="durable",
                                  location=durable.shard_paths(self.ckpt_dir, step, self.rank)[0],
                                  checksum=meta["crc32"]))

    def topology_dict(self) -> dict:
        t = self.topology
        return {"tp": t.tp, "pp": t.pp, "dp": t.dp, "cp": t.cp, "ep": t.ep,
                "machines": t.machines, "gpus_per_machine": t.gpus_per_machine}

    def log(self, text: str) -> None:
        print(f"[rank {self.rank}] {text}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        """Flush metrics and leave the process groups; call once at the end of training.

        The groups are destroyed and their communication threads joined here (``self.groups``
        is emptied), not at the interpreter's exit, where a gloo thread's late release can abort
        a finished run (``stalwart.worker.teardown``): let models that hold a group go first.

        Called from a `finally` while an exception propagates, it reports nothing as done: the
        agent sees the non-zero exit instead.
        """
        if self.mem is not None:
            self.mem.close()       # the last step's shard is committed before we say done
        exc = sys.exc_info()[1]
        if exc is None:
            self.link.send_now(protocol.Done(rank=self.rank))
        elif not isinstance(exc, KeyboardInterrupt):
            # Tell the agent now: tearing down an interpreter that imported torch takes about half
            # a second after the traceback, and the agent would only see the exit after it.
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.link.send_now(protocol.Failing(rank=self.rank, traceback=tb[-8192:]))
        self.link.close()
        if not self.attached:      # an attached script's groups are its own to destroy
            release_process_groups(self.groups)
