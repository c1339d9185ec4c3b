"""Classify why a worker stopped, from the tail of its log and its exit status.

Pure: text in, `Symptom` out. The agent calls `classify` on every worker exit and sends
the symptom with the incident; the controller's policy decides what to do (evict at once
when `machine_certain`, roll back code when `user_code`, stop-time checks otherwise).

Order matters: several messages often appear together, and the first *cause* wins over
its consequences. A CUDA error makes NCCL abort; a dead peer makes gloo report
"Connection reset by peer" on every survivor. Symptoms that are the consequence of
another rank's failure (gloo/NCCL peer errors) are marked `secondary=True`: they say
"look elsewhere", never "this machine is bad". The precedence, highest first:

    disk_full > gpu_oom > cuda_error / illegal_memory_access > nan > cpu_oom
    > collective_timeout > nccl_error > gloo_error (peer loss: secondary)
    > user_code_exception / library_exception (from the final Python traceback)
    > segfault > abort > killed > unknown

A secondary symptom never wins over a primary one found in the same text.
"""

from __future__ import annotations

import os
import re
import signal as _signal
from dataclasses import dataclass

CATEGORIES = ("explicit", "implicit", "user_code")
MAX_DETAIL = 400


@dataclass(frozen=True)
class Symptom:
    """What a worker's exit looks like.

    name: one of cuda_error, illegal_memory_access, nccl_error, gloo_error,
      collective_timeout, cpu_oom, gpu_oom, nan, user_code_exception, library_exception,
      segfault, abort, killed, disk_full, unknown.
    category: "explicit" (clear message / exit code), "implicit" (hang, NaN) or
      "user_code" (an error traceable to the job's own code).
    machine_certain: the message by itself proves this machine is faulty.
    detail: the line (or summary) that decided.
    user_code: the job's code is the likely culprit (rollback candidate).
    secondary: a consequence of another rank's failure, not a root cause.
    rank: the rank named in torchrun-style "[rankN]:" prefixes, when present.
    location: "file:line" of the innermost frame of the deciding traceback, if any.
    """

    name: str
    category: str
    machine_certain: bool
    detail: str
    user_code: bool = False
    secondary: bool = False
    rank: int | None = None
    location: str | None = None


# Prefixes torchrun and the c10d logger put before worker lines: "[default0]:[rank0]: ".
_PREFIX = re.compile(r"^(?:\[default\d+\]:)?(?:\[rank\d+\]:)?(?:\s(?=\S))?")
_RANK = re.compile(r"\[rank(\d+)\]:")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')

_CUDA_ERROR = re.compile(r"CUDA error: ([^\n]+)")
_CUDA_OTHER = re.compile(
    r"(CUDA driver error: [^\n]+|CUBLAS_STATUS_\w+[^\n]*|cuDNN error: [^\n]+|"
    r"CUDA initialization: [^\n]+|CUDA-capable device\(s\) is/are busy or unavailable)"
)
# CUDA errors that only a broken GPU / driver produces.
_CUDA_MACHINE = (
    "no CUDA-capable device is detected",
    "uncorrectable ECC error encountered",
    "uncorrectable NVLink error",
    "unspecified launch failure",
    "GPU has fallen off the bus",
    "CUDA-capable device(s) is/are busy or unavailable",
)
_GPU_OOM = re.compile(r"CUDA out of memory")
_DISK_FULL = re.compile(r"(?:No space left on device|\[Errno 28\]|Disk quota exceeded|\[Errno 122\])")
# torch.save onto a full filesystem reports only a stream failure.
_TORCH_SAVE_FAIL = re.compile(r"(?:PytorchStreamWriter failed writing|basic_ios::clear: iostream error)")
_NAN = re.compile(
    r"(?:returned nan values|\bloss\b[^\n]*?(?:[=:]|\s)\s*(?:is\s+)?-?nan\b|\bnan loss\b|"
    r"non-finite (?:loss|values)|\bNaN or Inf found\b|\bencountered NaN\b)",
    re.IGNORECASE,
)
_CPU_OOM = re.compile(
    r"(?:Out of memory: Kill(?:ed)? process|Memory cgroup out of memory|oom-kill:|"
    r"invoked oom-killer|oom_reaper|^MemoryError\b|Cannot allocate memory)",
    re.MULTILINE,
)
_TIMEOUT = re.compile(
    r"(?:Watchdog caught collective operation timeout|"
    r"Timed out waiting \d+ms for (?:recv|send) operation|"
    r"failed to pass monitoredBarrier|"
    r"DistStoreError: [^\n]*[Tt]imeout|"
    r"Socket Timeout|wait timeout after \d+ms)"
)
_NCCL = re.compile(r"(?:NCCL error|nccl\w+Error|NCCL communicator was aborted)")
_NCCL_SECONDARY = re.compile(r"ncclRemoteError|remote process exited|Connection closed by remote peer")
_GLOO = re.compile(r"gloo/")
_GLOO_PEER = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe")
_SEGV_TEXT = re.compile(r"(?:Segmentation fault|SIGSEGV|Fatal Python error: Bus error)")
_ABORT_TEXT = re.compile(r"(?:terminate called after throwing|Fatal Python error: Aborted|SIGABRT)")
_TORCHRUN_ROOT = re.compile(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", re.DOTALL)

_LIBRARY_MARKERS = ("site-packages", "dist-packages", os.sep + "torch" + os.sep, os.sep + "stalwart" + os.sep)
_STDLIB = re.compile(r"/lib/python3\.\d+/")


def _strip(text: str) -> list[str]:
    return [_PREFIX.sub("", line.rstrip("\r")) for line in text.splitlines()]


def _last_match(pattern: re.Pattern[str], lines: list[str]) -> str | None:
    """The last line matching `pattern` (its first group when the pattern has one)."""
    for line in reversed(lines):
        m = pattern.search(line)
        if m:
            return (m.group(1) if pattern.groups else line).strip()
    return None


@dataclass(frozen=True)
class _Traceback:
    frames: list[tuple[str, int]]
    exception: str


def _tracebacks(lines: list[str]) -> list[_Traceback]:
    """Every Python traceback in the text: its (file, line) frames and its exception line."""
    out: list[_Traceback] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "Traceback (most recent call last):":
            i += 1
            continue
        frames: list[tuple[str, int]] = []
        i += 1
        exception = ""
        while i < len(lines):
            line = lines[i]
            m = _FRAME.match(line)
            if m:
                frames.append((m.group(1), int(m.group(2))))
            elif line and not line[0].isspace():
                exception = line.strip()
                break
            i += 1
        out.append(_Traceback(frames, exception))
        i += 1
    return out


def _is_library(path: str, code_dir: str | None) -> bool:
    """True when `path` is not the user's code (a library, torch, stalwart, the stdlib)."""
    if path.startswith("<"):
        return True
    if os.sep + os.path.join("stalwart", "examples") + os.sep in path:
        return False  # the bundled example is the job's own training script, not a library
    if any(marker in path for marker in _LIBRARY_MARKERS):
        return True
    if code_dir is not None:
        root = os.path.normpath(code_dir)
        return not (os.path.normpath(path) == root or os.path.normpath(path).startswith(root + os.sep))
    return bool(_STDLIB.search(path))


def _signal_of(exit_code: int | None, sig: int | None) -> int | None:
    if sig is not None:
        return sig
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code < 160:  # shells report death by signal N as 128 + N
        return exit_code - 128
    return None


def _sig_name(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def classify(log_tail: str, exit_code: int | None, signal: int | None, code_dir: str | None) -> Symptom:
    """Name the most likely root cause of a worker's exit.

    log_tail: the last lines of the worker's stdout+stderr (torchrun prefixes allowed).
    exit_code: the process exit status (negative = killed by that signal), or None.
    signal: the terminating signal when known separately, or None.
    code_dir: the job's code directory; a traceback whose innermost frame lies inside it
      (and not in site-packages / torch / stalwart) is a user-code exception.
    """
    if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
        raise ValueError(f"exit_code must be an int or None, got {exit_code!r}")
    if signal is not None and (isinstance(signal, bool) or not isinstance(signal, int) or signal <= 0):
        raise ValueError(f"signal must be a positive int or None, got {signal!r}")
    lines = _strip(log_tail or "")
    text = "\n".join(lines)
    m = _RANK.search(log_tail or "")
    rank = int(m.group(1)) if m else None
    tbs = [tb for tb in _tracebacks(lines) if "ChildFailedError" not in tb.exception]
    final = tbs[-1] if tbs else None
    location = f"{final.frames[-1][0]}:{final.frames[-1][1]}" if final and final.frames else None

    def sym(name: str, category: str, certain: bool, detail: str, **kw: object) -> Symptom:
        if len(detail) > MAX_DETAIL:
            detail = detail[: MAX_DETAIL - 3] + "..."
        return Symptom(name, category, certain, detail, rank=rank, location=location, **kw)  # type: ignore[arg-type]

    secondary: Symptom | None = None

    if line := _last_match(_DISK_FULL, lines):
        return sym("disk_full", "explicit", False, line)
    if line := _last_match(_GPU_OOM, lines):
        return sym("gpu_oom", "explicit", False, line)
    if line := _last_match(_CUDA_ERROR, lines):
        if "illegal memory access" in line:
            return sym("illegal_memory_access", "explicit", False, "CUDA error: " + line)
        if "device-side assert" in line:
            return sym("cuda_error", "user_code", False, "CUDA error: " + line, user_code=True)
        certain = any(s in line for s in _CUDA_MACHINE)
        return sym("cuda_error", "explicit", certain, "CUDA error: " + line)
    if line := _last_match(_CUDA_OTHER, lines):
        return sym("cuda_error", "explicit", any(s in line for s in _CUDA_MACHINE), line)
    if line := _last_match(_NAN, lines):
        return sym("nan", "implicit", False, line)
    if line := _last_match(_CPU_OOM, lines):
        return sym("cpu_oom", "explicit", False, line)
    if line := _last_match(_TIMEOUT, lines):
        return sym("collective_timeout", "implicit", False, line)
    if line := _last_match(_NCCL, lines):
        if _NCCL_SECONDARY.search(text):
            secondary = sym("nccl_error", "explicit", False, line, secondary=True)
        else:
            return sym("nccl_error", "explicit", False, line)
    if secondary is None and (line := _last_match(_GLOO, lines)):
        if _GLOO_PEER.search(line):
            secondary = sym("gloo_error", "explicit", False, line, secondary=True)
        else:
            return sym("gloo_error", "explicit", False, line)
    if line := _last_match(_TORCH_SAVE_FAIL, lines):
        return sym("disk_full", "explicit", False, "torch.save write failed (disk full?): " + line)

    sig = _signal_of(exit_code, signal)
    final_is_peer_error = final is not None and bool(_GLOO.search(final.exception) or _NCCL.search(final.exception))
    if final is not None and final.frames and not final_is_peer_error:
        innermost = final.frames[-1][0]
        if _is_library(innermost, code_dir):
            return sym("library_exception", "explicit", False, final.exception)
        return sym("user_code_exception", "user_code", False, final.exception, user_code=True)
    if secondary is not None:
        # torchrun's own summary names the rank that failed first: prefer it.
        m = _TORCHRUN_ROOT.search(text)
        if m:
            root = classify("", int(m.group(1)), None, code_dir)
            return Symptom(**{**root.__dict__, "detail": "torchrun root cause: " + root.detail})
        return secondary
    if sig == _signal.SIGSEGV or (line := _last_match(_SEGV_TEXT, lines)):
        return sym("segfault", "explicit", False, line or f"killed by {_sig_name(_signal.SIGSEGV)}")
    if sig == _signal.SIGBUS:
        return sym("segfault", "explicit", False, f"killed by {_sig_name(sig)}")
    if sig == _signal.SIGABRT or (line := _last_match(_ABORT_TEXT, lines)):
        return sym("abort", "explicit", False, line or f"killed by {_sig_name(_signal.SIGABRT)}")
    if sig == _signal.SIGKILL:
        # A bare "Killed" from a shell follows any SIGKILL: only kernel OOM text (above) means OOM.
        return sym("worker_crash", "explicit", False, "killed by SIGKILL with no error text")
    if exit_code in (None, 0) and sig is None:
        m = _TORCHRUN_ROOT.search(text)
        if m:
            return classify("", int(m.group(1)), None, code_dir)
    if sig is not None:
        return sym("unknown", "explicit", False, f"killed by {_sig_name(sig)}")
    return sym("unknown", "explicit", False, f"exit code {exit_code}" if exit_code is not None else "no exit status")
