"""The tiny GPT of the example, with Megatron-style tensor parallelism.

Layout choices (documented here once):

- Attention heads and the MLP hidden size are split across the TP ranks. QKV and FC1 are
  column-parallel (each rank holds the output rows of its heads / its slice of d_ff); the
  attention output projection and FC2 are row-parallel (each rank holds the matching input
  columns, the partial outputs are summed with an ``all_reduce`` in the TP group, and the bias
  is added once after the sum).
- Embeddings (token and position), LayerNorms and the LM head are **replicated** on every TP
  rank of the stage that holds them: the vocabulary is 96 characters, too small to shard.
  Their gradients come out identical on every TP rank, because the column-parallel input
  operator all-reduces the activation gradient in backward (Megatron's ``f``/``g`` pair).
- Pipeline stage ``p`` of ``pp`` holds the global layers ``p*L/pp … (p+1)*L/pp - 1``; the
  first stage also holds the embeddings, the last the final LayerNorm and the LM head.
- Initialisation does not depend on the layout: every parameter is drawn in full from a
  generator seeded by ``(seed, parameter name)`` (names use the *global* layer index) and the
  TP shard is then sliced out, so every layout trains the same model.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``n_heads`` and ``d_ff`` must be divisible by tp, ``n_layers`` by pp."""

    vocab_size: int = 96
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 256
    n_layers: int = 4
    seq_len: int = 64

    def validate(self, tp: int = 1, pp: int = 1) -> None:
        """Raise ValueError when the shape or the TP/PP split is impossible."""
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % tp:
            raise ValueError(f"tp={tp} does not divide the number of heads {self.n_heads}")
        if self.d_ff % tp:
            raise ValueError(f"tp={tp} does not divide d_ff {self.d_ff}")
        if self.n_layers % pp:
            raise ValueError(f"pp={pp} does not divide the number of layers {self.n_layers}")


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in its tensor-parallel group (``group`` is None when size is 1)."""

    rank: int = 0
    size: int = 1
    group: object = None


def full_param(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """The full (unsharded) initial value of one parameter: N(0, std²), or ones/zeros.

    ``std > 0`` draws from a generator seeded by ``(seed, crc32(name))``; ``std == 0`` gives
    zeros; ``std < 0`` gives ones (LayerNorm weights).
    """
    if std == 0:
        return torch.zeros(shape)
    if std < 0:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=gen) * std


def _rows(t: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    n = t.shape[0] // tp.size
    return t[tp.rank * n:(tp.rank + 1) * n].clone()


def _cols(t: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    n = t.shape[1] // tp.size
    return t[:, tp.rank * n:(tp.rank + 1) * n].clone()


class _CopyToTP(torch.autograd.Function):
    """Megatron ``f``: identity forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: D102
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: D102
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Enter a column-parallel region (gradient summed over the TP group in backward)."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp.group)


def reduce_from_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Leave a row-parallel region (partial outputs summed over the TP group)."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp.group)


class ParallelAttention(nn.Module):
    """Causal self-attention with this rank's heads: column-parallel QKV, row-parallel proj."""

    def __init__(self, cfg: GPTConfig, layer: int, seed: int, tp: TPInfo):
        super().__init__()
        d, p = cfg.d_model, f"blocks.{layer}.attn"
        self.tp, self.heads = tp, cfg.n_heads // tp.size
        self.head_dim = d // cfg.n_heads
        q, k, v = (_rows(full_param(f"{p}.{n}.weight", (d, d), seed, 0.02), tp) for n in "qkv")
        self.qkv_weight = nn.Parameter(torch.cat([q, k, v]))
        self.qkv_bias = nn.Parameter(torch.zeros(3 * d // tp.size))
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.proj_weight = nn.Parameter(_cols(full_param(f"{p}.proj.weight", (d, d), seed,
                                                         proj_std), tp))
        self.proj_bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        b, t, _ = x.shape
        qkv = F.linear(copy_to_tp(x, self.tp), self.qkv_weight, self.qkv_bias)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for z in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return reduce_from_tp(F.linear(y, self.proj_weight), self.tp) + self.proj_bias


class ParallelMLP(nn.Module):
    """GELU MLP: column-parallel FC1 (slice of d_ff), row-parallel FC2."""

    def __init__(self, cfg: GPTConfig, layer: int, seed: int, tp: TPInfo):
        super().__init__()
        d, f, p = cfg.d_model, cfg.d_ff, f"blocks.{layer}.mlp"
        self.tp = tp
        self.fc1_weight = nn.Parameter(_rows(full_param(f"{p}.fc1.weight", (f, d), seed, 0.02),
                                             tp))
        self.fc1_bias = nn.Parameter(torch.zeros(f // tp.size))
        fc2_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.fc2_weight = nn.Parameter(_cols(full_param(f"{p}.fc2.weight", (d, f), seed,
                                                        fc2_std), tp))
        self.fc2_bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = F.gelu(F.linear(copy_to_tp(x, self.tp), self.fc1_weight, self.fc1_bias))
        return reduce_from_tp(F.linear(h, self.fc2_weight), self.tp) + self.fc2_bias


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig, layer: int, seed: int, tp: TPInfo):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = ParallelAttention(cfg, layer, seed, tp)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = ParallelMLP(cfg, layer, seed, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# Parameters split across TP ranks (the rest are replicated); used for the global grad norm.
TP_SHARDED_SUFFIXES = ("qkv_weight", "qkv_bias", "proj_weight", "fc1_weight", "fc1_bias",
                       "fc2_weight")


class GPTStage(nn.Module):
    """The part of the GPT held by one (TP rank, PP stage): a contiguous run of layers.

    ``forward`` takes token ids ``[b, t]`` on the first stage and activations ``[b, t, d]``
    elsewhere; it returns logits ``[b, t, vocab]`` on the last stage, activations otherwise.
    """

    def __init__(self, cfg: GPTConfig, seed: int, tp: TPInfo | None = None,
                 pp_rank: int = 0, pp_size: int = 1):
        super().__init__()
        tp = tp or TPInfo()
        cfg.validate(tp.size, pp_size)
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank {pp_rank} is not a stage of a pipeline of {pp_size}")
        if not 0 <= tp.rank < tp.size:
            raise ValueError(f"tp rank {tp.rank} is not in a TP group of size {tp.size}")
        self.cfg, self.tp = cfg, tp
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        per = cfg.n_layers // pp_size
        self.layer_ids = list(range(pp_rank * per, (pp_rank + 1) * per))
        if self.is_first:
            self.tok_emb = nn.Parameter(full_param("tok_emb", (cfg.vocab_size, cfg.d_model),
                                                   seed, 0.02))
            self.pos_emb = nn.Parameter(full_param("pos_emb", (cfg.seq_len, cfg.d_model),
                                                   seed, 0.01))
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, seed, tp) for i in self.layer_ids})
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Parameter(full_param("head", (cfg.vocab_size, cfg.d_model), seed,
                                                0.02))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self.is_first:
            if x.dim() != 2 or x.shape[1] > self.cfg.seq_len:
                raise ValueError(f"first stage expects token ids [b, <= {self.cfg.seq_len}], "
                                 f"got shape {tuple(x.shape)}")
            x = self.tok_emb[x] + self.pos_emb[: x.shape[1]]
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = F.linear(self.ln_f(x), self.head)
        return x

    def is_tp_sharded(self, name: str) -> bool:
        """Whether parameter ``name`` is split across TP ranks (else it is replicated)."""
        return name.endswith(TP_SHARDED_SUFFIXES)
