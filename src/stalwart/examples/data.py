"""Data for the tiny GPT example: a deterministic character corpus and pure batch functions.

The corpus is generated in code from a fixed seed (no downloads, no files): simple English-like
sentences over a small lexicon, so a character model can learn letters, words and spacing
quickly. The vocabulary is fixed (printable ASCII plus newline, 96 symbols), so it depends
neither on the corpus nor on the training seed.

The batch of a step is a pure function of ``(seed, step)`` for the global batch, and the data-
parallel shard is a contiguous slice of it: ``batch_for(seed, step, dp_rank, dp_size, ...)``.
No iterator state exists, so a restore at step ``s`` continues exactly, and layouts with the
same global batch see the same samples.
"""

from __future__ import annotations

import functools
import random

import torch

VOCAB_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB_CHARS)  # 96
_CHAR_TO_ID = {ch: i for i, ch in enumerate(VOCAB_CHARS)}

_CORPUS_SEED = 20260101
_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
_ADJECTIVES = ["quick", "lazy", "small", "large", "red", "green", "quiet", "bright", "old", "new"]
_NOUNS = ["fox", "dog", "cat", "bird", "tree", "river", "house", "stone", "garden", "machine"]
_VERBS = ["sees", "finds", "builds", "moves", "likes", "paints", "checks", "carries", "opens"]
_PLACES = ["in the garden", "near the river", "at the house", "under the tree", "on the hill"]


def _sentence(rng: random.Random) -> str:
    """One sentence of the toy grammar."""
    subject = rng.choice(_NAMES)
    obj = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    form = rng.randrange(4)
    if form == 0:
        text = f"{subject} {rng.choice(_VERBS)} {obj}"
    elif form == 1:
        text = f"{subject} {rng.choice(_VERBS)} {obj} {rng.choice(_PLACES)}"
    elif form == 2:
        text = f"{subject} has {rng.randrange(2, 10)} {rng.choice(_NOUNS)}s"
    else:
        text = f"{obj} is {rng.choice(_ADJECTIVES)}"
    return text[0].upper() + text[1:] + "."


@functools.lru_cache(maxsize=4)
def corpus_text(n_chars: int = 65536) -> str:
    """Return the deterministic training text (exactly ``n_chars`` characters)."""
    if n_chars < 256:
        raise ValueError(f"corpus needs at least 256 characters, got {n_chars}")
    rng = random.Random(_CORPUS_SEED)
    parts: list[str] = []
    total = 0
    while total < n_chars:
        line = " ".join(_sentence(rng) for _ in range(rng.randrange(2, 6))) + "\n"
        parts.append(line)
        total += len(line)
    return "".join(parts)[:n_chars]


def encode(text: str) -> torch.Tensor:
    """Encode text into a 1-D int64 tensor of token ids; unknown characters raise ValueError."""
    try:
        return torch.tensor([_CHAR_TO_ID[ch] for ch in text], dtype=torch.int64)
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the example vocabulary") from None


def decode(ids: torch.Tensor) -> str:
    """Decode a 1-D tensor of token ids back to text."""
    return "".join(VOCAB_CHARS[int(i)] for i in ids)


@functools.lru_cache(maxsize=4)
def corpus_tokens(n_chars: int = 65536) -> torch.Tensor:
    """The encoded corpus (cached per process)."""
    return encode(corpus_text(n_chars))


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step): splitmix64 of both, so nearby pairs differ."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return x & (2**63 - 1)


def global_offsets(seed: int, step: int, global_batch: int, seq_len: int,
                   n_tokens: int) -> torch.Tensor:
    """Start offsets of the ``global_batch`` windows of step ``step`` (pure in its arguments)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if n_tokens <= seq_len + 1:
        raise ValueError(f"corpus of {n_tokens} tokens is too short for seq_len {seq_len}")
    gen = torch.Generator().manual_seed(_mix(seed, step))
    return torch.randint(0, n_tokens - seq_len - 1, (global_batch,), generator=gen)


def batch_for(seed: int, step: int, dp_rank: int, dp_size: int, global_batch: int,
              seq_len: int, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[global_batch // dp_size, seq_len]`` for one DP rank at one step.

    The global batch is a pure function of ``(seed, step)``; DP rank ``r`` takes rows
    ``r*B/dp … (r+1)*B/dp - 1``, so the union over DP ranks is the same for every layout.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in a DP group of size {dp_size}")
    if global_batch % dp_size:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
    data = corpus_tokens() if tokens is None else tokens
    offsets = global_offsets(seed, step, global_batch, seq_len, int(data.numel()))
    local = global_batch // dp_size
    mine = offsets[dp_rank * local:(dp_rank + 1) * local]
    idx = mine[:, None] + torch.arange(seq_len + 1)[None, :]
    windows = data[idx]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
