"""Disk probe: free space and a tiny write+fsync on each watched directory.

- disk_full (fatal, not machine-certain: a shared filesystem fills for everyone) when a
  directory's free space drops below its threshold: `min_free_bytes` (default 1 GiB) or
  `min_free_ratio` of the filesystem (default 2%), whichever is smaller, so a small
  tmpfs is not "full" merely for being small. A write that fails with ENOSPC / EDQUOT is
  also disk_full.
- disk_fault (fatal, machine-certain) when writing, fsyncing, reading back or removing a
  4 KiB probe file fails any other way (EIO, EROFS, a mismatch on read-back).

`fake_free_bytes_file`: when this file exists, its content (an integer) replaces the
free byte count of every directory; chaos's `disk-full` and the tests use it on
filesystems they cannot fill.
"""

from __future__ import annotations

import errno
import os
import shutil

from stalwart.agent.probes.base import HealthEvent, Probe

GiB = 1 << 30
PROBE_FILE = ".stalwart-disk-probe"
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def low_space(free: int, total: int, min_free_bytes: int, min_free_ratio: float) -> bool:
    """Pure: is `free` below min(min_free_bytes, min_free_ratio * total)?"""
    return free < min(min_free_bytes, min_free_ratio * total)


class DiskProbe(Probe):
    """Watches `dirs` (checkpoint, log and scratch directories) every `interval_s`."""

    name = "disk"

    def __init__(
        self,
        dirs: list[str],
        min_free_bytes: int = GiB,
        min_free_ratio: float = 0.02,
        interval_s: float = 10.0,
        write_probe: bool = True,
        fake_free_bytes_file: str | None = None,
    ) -> None:
        super().__init__()
        if not dirs:
            raise ValueError("the disk probe needs at least one directory to watch")
        if min_free_bytes < 0 or not 0 <= min_free_ratio < 1:
            raise ValueError(
                f"disk thresholds must be >= 0 bytes and a ratio in [0, 1), got {min_free_bytes}, {min_free_ratio}"
            )
        if interval_s <= 0:
            raise ValueError(f"disk probe interval must be > 0 s, got {interval_s}")
        self.dirs = [os.fspath(d) for d in dirs]
        self.min_free_bytes = min_free_bytes
        self.min_free_ratio = min_free_ratio
        self.interval_s = interval_s
        self.write_probe = write_probe
        self.fake_free_bytes_file = fake_free_bytes_file

    def _fake_free(self) -> int | None:
        if not self.fake_free_bytes_file:
            return None
        try:
            with open(self.fake_free_bytes_file, encoding="ascii") as f:
                text = f.read().strip()
        except FileNotFoundError:
            return None
        try:
            return max(0, int(text))
        except ValueError:
            raise ValueError(f"{self.fake_free_bytes_file} must hold a byte count, got {text[:40]!r}") from None

    def _write_probe(self, directory: str) -> OSError | str | None:
        path = os.path.join(directory, PROBE_FILE)
        payload = os.urandom(4096)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            with open(path, "rb") as f:
                back = f.read()
            os.unlink(path)
        except OSError as exc:
            return exc
        return None if back == payload else "read-back mismatch"

    def check(self, now: float) -> list[HealthEvent]:
        """Check free space and (optionally) write a probe file in every directory."""
        events: list[HealthEvent] = []
        fake = self._fake_free()
        for d in self.dirs:
            try:
                usage = shutil.disk_usage(d)
            except OSError as exc:
                events.append(self.event("disk_fault", "fatal", True, now, dir=d, error=str(exc)))
                continue
            free = usage.free if fake is None else fake
            if low_space(free, usage.total, self.min_free_bytes, self.min_free_ratio):
                events.append(
                    self.event("disk_full", "fatal", False, now, dir=d, free_bytes=free, total_bytes=usage.total)
                )
                continue
            if self.write_probe:
                err = self._write_probe(d)
                if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
                    events.append(
                        self.event("disk_full", "fatal", False, now, dir=d, free_bytes=free, error=str(err))
                    )
                elif err is not None:
                    events.append(self.event("disk_fault", "fatal", True, now, dir=d, error=str(err)))
        return events
