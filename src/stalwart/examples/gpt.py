"""The bundled tiny 3D-parallel GPT: ``python -m stalwart.examples.gpt`` (or under torchrun).

Tensor parallelism inside a stage (``model``), a GPipe pipeline across stages (``pipeline``),
data parallelism across replicas (gradient all-reduce averaged in the DP group), a pure
per-step batch (``data``). Ranks follow Megatron's ``tp-cp-ep-dp-pp`` order:
``rank = tp + TP*(dp + DP*pp)``.

With the stalwart worker SDK present it runs through ``stalwart.worker.init`` (metrics,
in-memory checkpoints, chaos); ``--plain`` uses bare ``torch.distributed`` instead, with
metrics printed as JSON lines by global rank 0 and optional checkpoints in ``--ckpt-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from stalwart.examples.data import VOCAB_SIZE, batch_for
from stalwart.examples.model import GPTConfig, GPTStage, TPInfo
from stalwart.examples.pipeline import StageLinks, gpipe_step
from stalwart.protocol import Env
from stalwart.topology import Topology
from stalwart.worker.teardown import release_process_groups as _release_process_groups


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def parse_args(argv: Sequence[str] | None = None,
               env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse the command line; --tp/--pp/--dp/--steps default to STALWART_TP/PP/DP/STEPS."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog="python -m stalwart.examples.gpt", description=__doc__)
    p.add_argument("--tp", type=int, default=_env_int(env, Env.TP, 1))
    p.add_argument("--pp", type=int, default=_env_int(env, Env.PP, 1))
    p.add_argument("--dp", type=int, default=_env_int(env, Env.DP, 0),
                   help="data-parallel size (default: world_size / (tp*pp))")
    p.add_argument("--steps", type=int, default=_env_int(env, Env.STEPS, 200))
    p.add_argument("--seed", type=int, default=None, help="default: the SDK's seed, else 1234")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear LR warm-up steps")
    p.add_argument("--ckpt-every", type=int, default=1, help="0 disables checkpoints")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--log-every", type=int, default=1,
                   help="global rank 0 prints metrics every N steps (0: only the summary)")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout (s)")
    p.add_argument("--min-compute-s", type=float, default=0.0,
                   help="forward and backward of a step compute at least this long (sleeps the rest; "
                        "the pipeline's sends and receives do not count): "
                        "emulates a bigger model's step time")
    p.add_argument("--slow-while", metavar="FILE",
                   help="while FILE exists, a step's compute lasts at least 1 s (a test paces the job)")
    p.add_argument("--plain", action="store_true",
                   help="bare torch.distributed instead of the stalwart worker SDK")
    p.add_argument("--ckpt-dir", default=None, help="--plain only: checkpoint directory")
    args = p.parse_args(argv)
    for name in ("tp", "pp", "steps", "batch", "micro_batches", "layers", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.dp, args.ckpt_every, args.log_every, args.warmup, args.min_compute_s) < 0 or args.lr <= 0:
        raise ValueError("--dp, --ckpt-every, --log-every, --warmup and --min-compute-s must be "
                         ">= 0, --lr > 0")
    return args


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The GPTConfig the arguments describe."""
    return GPTConfig(vocab_size=VOCAB_SIZE, d_model=args.d_model, n_heads=args.heads,
                     d_ff=args.d_ff, n_layers=args.layers, seq_len=args.seq)


@dataclass
class PlainContext:
    """The training context over bare torch.distributed (the SDK's surface, no agent).

    Checkpoints, if ``ckpt_dir`` is set, are ``torch.save``d per rank and restored on the next
    start; without it nothing is saved and every start is fresh.
    """

    rank: int
    world_size: int
    coords: dict[str, int]
    groups: dict[str, Any]
    group_ranks: dict[str, tuple[int, ...]]
    seed: int = 1234
    ckpt_dir: str | None = None

    @classmethod
    def init(cls, tp: int, pp: int, dp: int, timeout_s: float = 60.0,
             ckpt_dir: str | None = None, env: Mapping[str, str] | None = None
             ) -> "PlainContext":
        """Join the job from torchrun's environment (single process when WORLD_SIZE is unset)."""
        env = os.environ if env is None else env
        world, rank = _env_int(env, "WORLD_SIZE", 1), _env_int(env, "RANK", 0)
        dp = dp or max(world // (tp * pp), 1)
        if tp * pp * dp != world:
            raise ValueError(f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} != world size {world}")
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        topo = Topology(1, world, tp=tp, pp=pp, dp=dp)
        groups: dict[str, Any] = {}
        mine: dict[str, tuple[int, ...]] = {}
        for kind in ("tp", "dp", "pp"):
            for ranks in topo.groups(kind):  # every rank creates every group, same order
                pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s)) \
                    if world > 1 else None
                if rank in ranks:
                    groups[kind], mine[kind] = pg, ranks
        return cls(rank, world, topo.coords(rank), groups, mine, ckpt_dir=ckpt_dir)

    def _path(self, step: int) -> str:
        return os.path.join(self.ckpt_dir, f"step{step:08d}-rank{self.rank}.pt")

    def _saved_steps(self) -> list[int]:
        if not self.ckpt_dir or not os.path.isdir(self.ckpt_dir):
            return []
        tail = f"-rank{self.rank}.pt"
        return sorted(int(n[4:-len(tail)]) for n in os.listdir(self.ckpt_dir)
                      if n.startswith("step") and n.endswith(tail))

    def restore(self) -> tuple[int, dict | None]:
        """(0, None) on a fresh start, else (step after the checkpoint, the saved state).

        The step is the newest one every rank holds (a world all-reduce MIN), so ranks that
        died one checkpoint apart still resume together.
        """
        saved = self._saved_steps()
        newest = torch.tensor([saved[-1] if saved else -1])
        if self.world_size > 1:
            dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        step = int(newest)
        if step < 0:
            return 0, None
        if step not in saved:
            raise ValueError(f"rank {self.rank} has no checkpoint of step {step} in "
                             f"{self.ckpt_dir} (has {saved})")
        return step + 1, torch.load(self._path(step), weights_only=True)

    def begin_step(self, step: int) -> None:
        """Nothing to do without an agent."""

    def on_gradients(self, step: int, params: list[torch.Tensor], comm_s: float = 0.0) -> None:
        """Nothing to do without an agent."""

    def report(self, step: int, **metrics: float) -> None:
        """Nothing to report to without an agent (``train`` prints the metrics itself)."""

    def checkpoint(self, state: dict, step: int) -> None:
        """Save this rank's state after ``step`` atomically (keeping the newest two) when a
        checkpoint directory is set; otherwise do nothing."""
        if not self.ckpt_dir:
            return
        os.makedirs(self.ckpt_dir, exist_ok=True)
        tmp = self._path(step) + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self._path(step))
        for old in self._saved_steps()[:-2]:
            os.remove(self._path(old))

    def finish(self) -> None:
        """Leave the process groups (see ``stalwart.worker.teardown``)."""
        _release_process_groups(self.groups)


def lr_at(step: int, base_lr: float, warmup: int) -> float:
    """Learning rate of ``step``: linear warm-up over ``warmup`` steps, then constant.

    A pure function of the step, so a restored run uses exactly the rate of the original.
    """
    return base_lr * min(1.0, (step + 1) / warmup) if warmup > 0 else base_lr


def allreduce_mean(params: list[torch.Tensor], group: Any, size: int) -> None:
    """Average the gradients of ``params`` over a group with one flat all-reduce."""
    if size == 1:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def global_loss_and_norm(stage: GPTStage, local_loss: torch.Tensor | None,
                         coords: Mapping[str, int], dp: int, world_size: int
                         ) -> tuple[float, float]:
    """The global-batch mean loss and the full model's grad norm, known on every rank.

    One world all-reduce of ``[loss, sum of squared grads]``: the loss counts on the last
    stage's TP rank 0 (divided by dp); squared grads of TP-sharded parameters count on every
    TP rank, of replicated ones on TP rank 0 only; both only on DP rank 0 for the norm.
    """
    device = next(stage.parameters()).device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    if coords["dp"] == 0:
        for name, p in stage.named_parameters():
            if p.grad is not None and (coords["tp"] == 0 or stage.is_tp_sharded(name)):
                sq += p.grad.double().pow(2).sum()
    loss = torch.zeros((), dtype=torch.float64, device=device)
    if local_loss is not None and coords["tp"] == 0:
        loss += local_loss.double() / dp
    vec = torch.stack([loss, sq])
    if world_size > 1:
        dist.all_reduce(vec)
    return float(vec[0]), float(vec[1].sqrt())


def train(ctx: Any, args: argparse.Namespace) -> list[dict[str, float]]:
    """Train with any context exposing the worker SDK's surface; returns per-step metrics.

    Every rank reports the same metrics each step: the global-batch mean ``loss``, the full
    model's ``grad_norm`` (after DP averaging) and ``tokens`` = global batch × seq_len.
    Global rank 0 also prints them as JSON lines (``--log-every``) and a final summary line
    ``{"event": "done", "steps_per_s": ...}`` (measured after the first step).
    """
    torch.set_num_threads(args.threads)
    tp, pp = args.tp, args.pp
    dp = ctx.world_size // (tp * pp)
    if tp * pp * dp != ctx.world_size or (args.dp and args.dp != dp):
        raise ValueError(f"tp*pp*dp = {tp}*{pp}*{args.dp or dp} does not match world size "
                         f"{ctx.world_size}")
    cfg = model_config(args)
    short = getattr(ctx, "replay_layers", 0)
    if short and pp <= short < cfg.n_layers:
        # a dual-phase replay (stop-time diagnostics) runs the same layout on fewer layers
        cfg = dataclasses.replace(cfg, n_layers=short - short % pp)
        ctx.log(f"replay: {cfg.n_layers} of {args.layers} layers")
    cfg.validate(tp, pp)
    if args.batch % (dp * args.micro_batches):
        raise ValueError(f"--batch {args.batch} is not divisible by dp*micro-batches = "
                         f"{dp}*{args.micro_batches}")
    seed = args.seed if args.seed is not None else getattr(ctx, "seed", 1234)
    c = ctx.coords
    tp_info = TPInfo(c["tp"], tp, ctx.groups.get("tp") if tp > 1 else None)
    device = torch.device(getattr(ctx, "device", "cpu"))
    stage = GPTStage(cfg, seed, tp_info, c["pp"], pp).to(device)
    links = StageLinks.from_ranks(ctx.group_ranks["pp"], c["pp"], ctx.groups.get("pp"))
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    start, state = ctx.restore()
    if state is not None:
        stage.load_state_dict(state["model"])  # tensors land on the stage's device
        opt.load_state_dict(state["optim"])
    params = list(stage.parameters())
    history: list[dict[str, float]] = []
    t_first = None
    for step in range(start, args.steps):
        ctx.begin_step(step)
        if getattr(ctx, "chaos_active", None) and ctx.chaos_active("user-error", step):
            # the `user-error` chaos fault: a bug in the training script itself
            raise IndexError(f"user-error chaos: index out of range in the training script at step {step}")
        t0 = time.perf_counter()
        x, y = batch_for(seed, step, c["dp"], dp, args.batch, cfg.seq_len)
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=False)
        # the `stage-hang` chaos fault: the SDK blocks before a pipeline send (with pp == 1,
        # which has none, before the data-parallel all-reduce)
        hang = getattr(ctx, "maybe_hang", None)
        comm = [0.0]                     # seconds in the pipeline's sends and receives
        local_loss = gpipe_step(stage, x, y, args.micro_batches, links,
                                functools.partial(hang, step, "pp") if hang else None, comm)
        min_s = max(args.min_compute_s, 1.0 if args.slow_while and os.path.exists(args.slow_while) else 0.0)
        if min_s > 0:
            time.sleep(max(0.0, min_s - (time.perf_counter() - t0 - comm[0])))
        ctx.on_gradients(step, params, comm_s=comm[0])
        if hang:
            hang(step, "dp")
        allreduce_mean(params, ctx.groups.get("dp"), dp)
        loss, gnorm = global_loss_and_norm(stage, local_loss, c, dp, ctx.world_size)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup)
        opt.step()
        t1 = time.perf_counter()
        metrics = {"loss": loss, "grad_norm": gnorm, "tokens": args.batch * cfg.seq_len}
        ctx.report(step, **metrics)
        if ctx.rank == 0 and args.log_every and step % args.log_every == 0:
            sdk = getattr(ctx, "blocking_s", None)     # (the worker SDK's own time, so far)
            parts = getattr(ctx, "blocking_parts", None)
            print(json.dumps({"step": step, **metrics, "t": round(time.time(), 4),
                              **({"sdk_s": round(sdk, 6)} if sdk is not None else {}),
                              **({"sdk_parts": {k: round(v, 6) for k, v in parts.items()}} if parts else {})}),
                  flush=True)
        history.append({"step": step, **metrics, "step_time": t1 - t0})
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            ctx.checkpoint({"model": stage.state_dict(), "optim": opt.state_dict(),
                            "seed": seed}, step)
        if t_first is None:
            t_first = time.perf_counter()
    if len(history) > 1 and ctx.rank == 0:
        rate = (len(history) - 1) / (time.perf_counter() - t_first)
        print(json.dumps({"event": "done", "steps_per_s": round(rate, 2), "tp": tp, "pp": pp,
                          "dp": dp, "final_loss": history[-1]["loss"]}), flush=True)
    return history


def _sdk_init():
    """``stalwart.worker.init`` if the SDK provides it, else None."""
    try:
        from stalwart import worker
    except ImportError:
        return None
    return getattr(worker, "init", None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse arguments, join the job, train, leave. Bad input exits with 2."""
    ctx = None
    try:
        args = parse_args(argv)
        init = None if args.plain else _sdk_init()
        if init is not None:
            ctx = init(tp=args.tp, pp=args.pp, dp=args.dp or None, timeout_s=args.timeout)
        else:
            ctx = PlainContext.init(args.tp, args.pp, args.dp, args.timeout, args.ckpt_dir)
        train(ctx, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if ctx is not None:
            ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
