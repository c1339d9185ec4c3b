"""The workers' output: on `stalwart run`'s console as torchrun shows it, and `stalwart logs`
(which also shows a machine's agent log, and the controller's with a Slurm job's output).

Each agent writes a worker's stdout and stderr to `<state-dir>/machines/<m>/logs/run<N>_rank<R>.out`
and `.err` (agent/workers.py; a warm worker's files take that name when it gets its rank). A
`LogTail` follows those files from where they ended when it started and hands out their new
complete lines prefixed `[rank<R>]:`, as `torchrun --tee` does: by default rank 0's output and every
rank's stderr (where errors and tracebacks go), or the ranks `--log-ranks` names.
"""
from __future__ import annotations

import glob
import os
import re
import sys
import time

from stalwart.cli.common import DEFAULT_STATE, UserError

NAME = re.compile(r"run(\d+)_rank(\d+)\.(out|err)$")


def parse_ranks(text: str | None) -> set[int] | None:
    """`--log-ranks`: 'all' (None), 'none' (empty), or a comma list of ranks and ranges (0,2-3)."""
    if text is None or text == "all":
        return None
    if text == "none":
        return set()
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            out.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise UserError(f"--log-ranks takes 'all', 'none' or ranks like 0,2-3 (got {text!r})") from None
    return out


def log_files(state_dir: str) -> list[tuple[int, int, str, str]]:
    """(run, rank, 'out'|'err', path) of every worker log of the state dir's machines."""
    out = []
    for path in glob.glob(os.path.join(state_dir, "machines", "*", "logs", "run*_rank*.*")):
        m = NAME.search(os.path.basename(path))
        if m:
            out.append((int(m.group(1)), int(m.group(2)), m.group(3), path))
    return sorted(out)


class LogTail:
    """New lines of the workers' logs. `ranks`: whose stdout to show (None: all); `errors`: every
    rank's stderr too. Files that existed at the start are read from their end (an earlier job's)."""

    def __init__(self, state_dir: str, ranks: set[int] | None = frozenset({0}), errors: bool = True,
                 from_start: bool = False, run: int | None = None):
        self.state_dir, self.ranks, self.errors, self.run = state_dir, ranks, errors, run
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}
        if not from_start:
            for *_, path in log_files(state_dir):
                self.offsets[path] = _size(path)

    def wanted(self, rank: int, stream: str) -> bool:
        return self.ranks is None or rank in self.ranks or (self.errors and stream == "err")

    def lines(self, final: bool = False) -> list[str]:
        """The complete lines written since the last call (`final`: an unfinished last line too)."""
        out = []
        for run, rank, stream, path in log_files(self.state_dir):
            if (self.run is not None and run != self.run) or not self.wanted(rank, stream):
                continue
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read(1 << 20)
            except OSError:
                continue
            self.offsets[path] = start + len(data)
            data = self.partial.pop(path, b"") + data
            *done, rest = data.split(b"\n")
            if rest and final:
                done.append(rest)
            elif rest:
                self.partial[path] = rest
            # (torch's own exception hook already writes a rank's traceback as `[rankN]:...`)
            prefix = f"[rank{rank}]:"
            out += [text if text.startswith(prefix) else prefix + text
                    for text in (line.decode(errors="replace") for line in done)]
        return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _job_running(a) -> bool:
    from stalwart.backends.statedir import StateDirLock
    return StateDirLock(a.state_dir).held_elsewhere() is not None


def _tail(path: str, lines: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 256 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def service_logs(state_dir: str, machine: str | None, slurm_job: str | None) -> list[str]:
    """A machine's agent log (`machine`), else the controller's and the Slurm job's output."""
    if machine is not None:
        return [p for p in (os.path.join(state_dir, "logs", f"agent-{machine}.log"),
                            os.path.join(state_dir, "logs", "agents-step.log")) if os.path.exists(p)][:1]
    out = [os.path.join(state_dir, "logs", "controller.log")]
    if slurm_job:
        out.append(os.path.join(state_dir, "slurm", "logs", f"slurm-{slurm_job}.out"))
    return [p for p in out if os.path.exists(p)]


def cmd_service_logs(a) -> int:
    files = service_logs(a.state_dir, a.machine, a.slurm_job)
    if not files:
        what = f"machine {a.machine}'s agent log" if a.machine else "a controller log"
        raise UserError(f"no {what} in {os.path.abspath(a.state_dir)}")
    for path in files:
        if len(files) > 1:
            print(f"==> {path} <==")
        print(_tail(path, a.lines))
    return 0


def cmd_logs(a) -> int:
    if a.machine is not None or a.controller_log:
        return cmd_service_logs(a)
    if not os.path.isdir(os.path.join(a.state_dir, "machines")):
        raise UserError(f"no workers' logs in {os.path.abspath(a.state_dir)} (run a job first, or pass --state-dir)")
    files = log_files(a.state_dir)
    run = a.run if a.run is not None else max((f[0] for f in files), default=None)
    ranks = None if a.rank is None else {a.rank}
    tail = LogTail(a.state_dir, ranks=ranks, errors=a.rank is None, from_start=True, run=None if a.all_runs else run)
    printed = 0
    for line in tail.lines(final=not a.follow):
        print(line)
        printed += 1
    if not a.follow:
        if not printed:         # (say so: an empty answer reads as a broken command)
            said = "no rank wrote anything" if a.rank is None else f"rank {a.rank} wrote nothing"
            where = "in any run" if a.all_runs or run is None else f"in run {run}"
            hint = "" if a.all_runs or run is None or run <= 1 else " (--all-runs for the earlier runs)"
            print(f"stalwart: {said} {where}{hint}", file=sys.stderr)
        return 0
    tail.run = None            # a restart's new run goes on in new files
    try:
        while True:
            for line in tail.lines():
                print(line, flush=True)
            if not _job_running(a):
                for line in tail.lines(final=True):
                    print(line)
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        return 0


def add_parsers(sub) -> None:
    g = sub.add_parser("logs", help="the workers' output (stdout and stderr, prefixed [rankR]:), a machine's "
                                    "agent log, or the controller's")
    g.add_argument("--rank", type=int, help="only this rank (default: every rank)")
    g.add_argument("--run", type=int, help="this run (default: the newest)")
    g.add_argument("--all-runs", action="store_true", help="every run, oldest first")
    g.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    g.add_argument("--machine", help="this machine's agent log instead, e.g. m3")
    g.add_argument("--controller-log", action="store_true",
                   help="the controller's log instead (and the Slurm job's output with --slurm-job)")
    g.add_argument("-n", "--lines", type=int, default=50,
                   help="with --machine or --controller-log: the last this many lines (default 50)")
    g.add_argument("--state-dir", default=DEFAULT_STATE)
    g.add_argument("--slurm-job", metavar="ID",
                   help="the Slurm job (stalwart slurm sbatch/run) whose state dir to read")
    g.set_defaults(fn=cmd_logs)


def print_lines(lines: list[str], stream=None) -> None:
    stream = stream or sys.stdout
    for line in lines:
        stream.write(line + "\n")
    stream.flush()
