"""Kernel-log probe: NVIDIA Xids, kernel panics, OOM kills and disk I/O errors.

Reads only *new* kernel log lines, from `/dev/kmsg` (non-blocking; one record per read;
starts at the end of the ring buffer) or from a plain file (tests, chaos, a dmesg dump)
that is followed like `tail -f` from its size at construction (or from the start with
`from_start=True`). Checked every 2 s by default (Table 3: OS kernel faults in 2 s).

`parse_line` is pure and accepts both the /dev/kmsg record format
("6,1234,5678,-;message") and dmesg's ("[  123.456] message").

Events:
  gpu_xid (fatal + machine-certain for `gpu.FATAL_XIDS`, else info), gpu_lost ("fallen
  off the bus"), kernel_panic (fatal, machine-certain), disk_fault (EXT4/XFS/block-layer
  I/O errors: fatal, machine-certain), cpu_oom (the OOM killer killed a process: warn,
  the process's own exit tells the rest), hung_task / soft_lockup (warn), nic_timeout
  (NETDEV WATCHDOG: warn).
"""

from __future__ import annotations

import errno
import os
import re
from typing import Any

from stalwart.agent.probes.base import HealthEvent, Probe
from stalwart.agent.probes.gpu import FATAL_XIDS

_KMSG_RECORD = re.compile(r"^\d+,\d+,\d+,[^;]*;")
_DMESG_TIME = re.compile(r"^\[\s*\d+\.\d+\]\s*")
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),\s*(.*)")
_OFF_BUS = re.compile(r"NVRM: GPU at PCI:([0-9A-Fa-f:.]+).*fallen off the bus")
_OOM = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Kill(?:ed)? process (\d+) \(([^)]*)\)")
_DISK = re.compile(
    r"(EXT4-fs (?:error|warning \(device [^)]*\): ext4_end_bio)|EXT4-fs \([^)]*\): (?:I/O error|"
    r"Remounting filesystem read-only|ext4_journal_check_start)|XFS \([^)]*\): (?:metadata I/O error|"
    r"log I/O error|Corruption|.*shutting down filesystem)|Buffer I/O error on dev|"
    r"blk_update_request: (?:critical medium|I/O) error|I/O error, dev \S+, sector|"
    r"critical medium error, dev)"
)
_DEVICE = re.compile(r"(?:dev(?:ice)? |\()((?:sd|nvme|vd|xvd|hd|dm-|md)[\w-]*)")
_PANIC = re.compile(r"Kernel panic - not syncing|kernel BUG at|Oops: ")
_HUNG = re.compile(r"task (\S+):(\d+) blocked for more than (\d+) seconds")
_LOCKUP = re.compile(r"watchdog: BUG: soft lockup")
_NETDEV = re.compile(r"NETDEV WATCHDOG: (\S+) \([^)]*\): transmit queue \d+ timed out")


def _message(line: str) -> str:
    line = line.rstrip("\n")
    if _KMSG_RECORD.match(line):
        return _KMSG_RECORD.sub("", line, count=1)
    return _DMESG_TIME.sub("", line, count=1)


def parse_line(line: str) -> tuple[str, str, bool, dict[str, Any]] | None:
    """One kernel log line -> (kind, severity, machine_certain, detail), or None if benign."""
    msg = _message(line)
    if m := _XID.search(msg):
        code = int(m.group(2))
        fatal = code in FATAL_XIDS
        return ("gpu_xid", "fatal" if fatal else "info", fatal, {"pci": m.group(1), "xid": code, "text": msg})
    if m := _OFF_BUS.search(msg):
        return ("gpu_lost", "fatal", True, {"pci": m.group(1), "text": msg})
    if _PANIC.search(msg):
        return ("kernel_panic", "fatal", True, {"text": msg})
    if m := _OOM.search(msg):
        return ("cpu_oom", "warn", False, {"pid": int(m.group(1)), "process": m.group(2), "text": msg})
    if _DISK.search(msg):
        dev = _DEVICE.search(msg)
        return ("disk_fault", "fatal", True, {"device": dev.group(1) if dev else None, "text": msg})
    if m := _HUNG.search(msg):
        return ("hung_task", "warn", False, {"task": m.group(1), "pid": int(m.group(2)), "text": msg})
    if _LOCKUP.search(msg):
        return ("soft_lockup", "warn", False, {"text": msg})
    if m := _NETDEV.search(msg):
        return ("nic_timeout", "warn", False, {"interface": m.group(1), "text": msg})
    return None


class KmsgProbe(Probe):
    """Follows the kernel log at `source` ("/dev/kmsg" or a file) and parses new lines."""

    name = "kmsg"

    def __init__(
        self, source: str = "/dev/kmsg", interval_s: float = 2.0, from_start: bool = False, max_lines: int = 10000
    ) -> None:
        super().__init__()
        if interval_s <= 0:
            raise ValueError(f"kernel log probe interval must be > 0 s, got {interval_s}")
        self.source = source
        self.interval_s = interval_s
        self.max_lines = max_lines
        self._is_kmsg = os.path.realpath(source) == "/dev/kmsg"
        self._fd: int | None = None
        self._offset = 0
        self._partial = ""
        if self._is_kmsg:
            self._fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK)
            if not from_start:
                os.lseek(self._fd, 0, os.SEEK_END)
        elif not from_start:
            try:
                self._offset = os.path.getsize(source)
            except OSError:
                self._offset = 0  # appears later: read it from its start

    def close(self) -> None:
        """Close /dev/kmsg if it is open."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _kmsg_lines(self) -> list[str]:
        assert self._fd is not None
        lines: list[str] = []
        while len(lines) < self.max_lines:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them
                    continue
                raise
            if not record:
                break
            # Continuation lines (" KEY=value") follow the first line of a record.
            lines.append(record.decode("utf-8", "replace").split("\n", 1)[0])
        return lines

    def _file_lines(self) -> list[str]:
        try:
            size = os.path.getsize(self.source)
        except OSError:
            return []
        if size < self._offset:  # truncated or rotated: start again
            self._offset, self._partial = 0, ""
        if size == self._offset:
            return []
        with open(self.source, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        text = self._partial + data.decode("utf-8", "replace")
        *complete, self._partial = text.split("\n")
        return complete[-self.max_lines :]

    def new_lines(self) -> list[str]:
        """Kernel log lines that appeared since the last call."""
        return self._kmsg_lines() if self._is_kmsg else self._file_lines()

    def check(self, now: float) -> list[HealthEvent]:
        """Parse the new kernel log lines into events."""
        events = []
        for line in self.new_lines():
            found = parse_line(line)
            if found:
                kind, severity, certain, detail = found
                events.append(self.event(kind, severity, certain, now, **detail))
        return events
