"""Durable checkpoints: one file per rank per step, written atomically and checksummed.

Layout: ``<dir>/step_00000042/rank_00003.pt`` and beside it ``rank_00003.json`` holding step, rank,
layout, size and CRC32. The data file is written to a temp name, fsynced and renamed; the JSON is
written last the same way, so a shard is complete exactly when its JSON exists and its CRC matches.
"""
from __future__ import annotations

import io
import json
import os
import zlib
from typing import Any

import torch

from stalwart.errors import StalwartError


class CorruptCheckpoint(StalwartError, RuntimeError):
    """A checkpoint shard is missing, truncated or fails its checksum."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def shard_paths(root: str, step: int, rank: int) -> tuple[str, str]:
    d = step_dir(root, step)
    return os.path.join(d, f"rank_{rank:05d}.pt"), os.path.join(d, f"rank_{rank:05d}.json")


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(root: str, step: int, rank: int, state: Any, layout: dict | None = None) -> dict:
    """Write one rank's state for `step`; returns its metadata (with the checksum)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    data_path, meta_path = shard_paths(root, step, rank)
    os.makedirs(os.path.dirname(data_path), exist_ok=True)
    _atomic_write(data_path, data)
    meta = {"step": step, "rank": rank, "nbytes": len(data), "crc32": f"{zlib.crc32(data):08x}",
            "layout": layout or {}}
    _atomic_write(meta_path, json.dumps(meta).encode())
    return meta


def verify(root: str, step: int, rank: int) -> dict:
    """Check a shard against its checksum; returns its metadata or raises CorruptCheckpoint."""
    data_path, meta_path = shard_paths(root, step, rank)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        with open(data_path, "rb") as f:
            data = f.read()
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"step {step} rank {rank}: {e}") from e
    if len(data) != meta["nbytes"] or f"{zlib.crc32(data):08x}" != meta["crc32"]:
        raise CorruptCheckpoint(f"step {step} rank {rank}: checksum mismatch in {data_path}")
    return meta


def load(root: str, step: int, rank: int) -> Any:
    """Load one rank's state for `step`, verifying its checksum first."""
    verify(root, step, rank)
    data_path, _ = shard_paths(root, step, rank)
    with open(data_path, "rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=True)   # (no code from a file)


def complete_steps(root: str, world_size: int) -> list[int]:
    """Steps for which every rank has a shard with metadata (checksums are checked on load)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        if not name.startswith("step_"):
            continue
        step = int(name[5:])
        if all(os.path.exists(shard_paths(root, step, r)[1]) for r in range(world_size)):
            out.append(step)
    return sorted(out)
